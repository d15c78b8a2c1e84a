"""kiln.Client against a stand-in API (httpx.MockTransport): the requests it makes, the typed
answers it gives back, and the errors it raises with the API's sentence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import kiln
from kiln.app.client.calls import CLOSED, DEFAULT_API_URL, pause_before_asking_again
from kiln.app.core.config import Settings
from tests.app.client.fake_api import FakeApi, job_json, parquet


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def client(api: FakeApi) -> kiln.Client:
    return kiln.Client("http://api", "kiln_key", transport=api.transport())


def test_import_kiln_loads_no_client_until_asked() -> None:
    code = (
        "import sys, kiln; assert 'httpx' not in sys.modules and 'kiln.app.client' not in "
        "sys.modules; from kiln import Client, AsyncClient, ApiError; "
        "assert issubclass(kiln.NotFoundError, ApiError); "
        "assert not {'sqlalchemy', 'celery', 'boto3', 'fastapi'} & set(sys.modules); "
        "print(Client.__module__)"
    )  # a user's program loads the client and the API's schemas, none of the server
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "kiln.app.client.sync"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = kiln.Nope


def test_the_default_url_is_the_settings_default() -> None:
    assert Settings.model_fields["api_url"].default == DEFAULT_API_URL


def test_url_and_key_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_API_URL", "http://kiln.example:9000/")
    monkeypatch.setenv("KILN_API_KEY", "kiln_env")
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=job_json())

    with kiln.Client(transport=httpx.MockTransport(answer)) as client:
        client.job("j1")
    assert str(seen[0].url) == "http://kiln.example:9000/v1/jobs/j1"
    assert seen[0].headers["Authorization"] == "Bearer kiln_env"
    monkeypatch.delenv("KILN_API_KEY")
    with pytest.raises(kiln.ApiError, match="Set KILN_API_KEY"):
        kiln.Client()


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (401, kiln.AuthError),
        (404, kiln.NotFoundError),
        (409, kiln.ConflictError),
        (422, kiln.InvalidRequestError),
        (429, kiln.RateLimitedError),
        (503, kiln.UnavailableError),
        (500, kiln.ApiError),
    ],
)
def test_an_error_answer_raises_its_class_with_the_sentence(
    api: FakeApi, client: kiln.Client, status: int, kind: type[kiln.ApiError]
) -> None:
    api.on(
        "GET",
        "/v1/jobs/j1",
        lambda _r: httpx.Response(
            status, json={"detail": "Something is off."}, headers={"Retry-After": "7"}
        ),
    )
    with pytest.raises(kind) as raised:
        client.job("j1")
    assert type(raised.value) is kind
    assert raised.value.detail == "Something is off."
    assert raised.value.status == status
    assert raised.value.retry_after == 7
    assert str(raised.value) == f"Something is off. (HTTP {status})"


def test_an_answer_that_is_not_json_keeps_its_text(api: FakeApi, client: kiln.Client) -> None:
    api.on("GET", "/v1/jobs/j1", lambda _r: httpx.Response(502, text="Bad gateway from nginx"))
    with pytest.raises(kiln.ApiError, match=r"Bad gateway from nginx \(HTTP 502\)"):
        client.job("j1")


def test_no_api_there_is_a_connection_error_naming_the_url() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    client = kiln.Client("http://nowhere:1", "k", transport=httpx.MockTransport(refuse))
    with pytest.raises(kiln.ConnectionFailedError, match="http://nowhere:1") as raised:
        client.job("j1")
    assert raised.value.status is None


def test_files_go_as_a_multipart_upload_named_as_given(
    api: FakeApi, client: kiln.Client, tmp_path: Path
) -> None:
    photo = tmp_path / "cat.jpg"
    photo.write_bytes(b"jpeg bytes")
    api.on("POST", "/v1/jobs", job_json(), status=202)
    job = client.submit(
        "phash",
        files=[photo, b"raw", ("dog.png", b"png bytes")],
        options={"max_distance": 8},
        idempotency_key="night-1",
        notify="https://hooks.example/kiln",
    )
    assert isinstance(job, kiln.JobOut) and job.id == "j1" and job.counts.total == 2
    sent = api.seen[-1]
    assert sent.headers["Content-Type"].startswith("multipart/form-data")
    body = sent.content.decode("latin-1")
    for name in ("cat.jpg", "input-2", "dog.png"):
        assert f'name="files"; filename="{name}"' in body
    assert "jpeg bytes" in body and "png bytes" in body
    assert '{"max_distance": 8}' in body and "night-1" in body
    hook = '{"url": "https://hooks.example/kiln", "events": ["completed", "failed", "cancelled"]}'
    assert hook in body


def test_uris_and_texts_go_as_json_inputs(api: FakeApi, client: kiln.Client) -> None:
    api.on("POST", "/v1/jobs", job_json(), status=202)
    client.submit(
        "text-embed",
        uris=["s3://photos/a.jpg"],
        texts=["a red bicycle"],
        expires_after="7d",
        notify={"url": "https://hooks.example/k", "events": ["failed"]},
    )
    assert api.body() == {
        "model": "text-embed",
        "inputs": [{"uri": "s3://photos/a.jpg"}, {"text": "a red bicycle"}],
        "expires_after": "7d",
        "notify": {"url": "https://hooks.example/k", "events": ["failed"]},
    }


def test_submit_refuses_nothing_or_both_kinds_before_sending(
    api: FakeApi, client: kiln.Client
) -> None:
    with pytest.raises(ValueError, match="Give files, uris or texts"):
        client.submit("phash")
    with pytest.raises(ValueError, match="in another"):
        client.submit("phash", files=[b"x"], uris=["s3://a/b.jpg"])
    with pytest.raises(ValueError, match="events"):
        client.submit("phash", uris=["s3://a/b.jpg"], notify={"url": "https://x", "events": ["x"]})
    assert api.seen == []


def test_bulk_sends_the_source_and_its_filters(api: FakeApi, client: kiln.Client) -> None:
    api.on("POST", "/v1/jobs", job_json(source={"s3": "s3://photos/2026/"}), status=202)
    job = client.bulk(
        "detector",
        "s3://photos/2026/",
        include=["*.jpg"],
        exclude=["tmp/*"],
        pipeline="nightly",
        output="s3://results/",
        video_fps=0.5,
        idempotency_key="k",
    )
    assert job.source == {"s3": "s3://photos/2026/"}
    assert api.body() == {
        "model": "detector",
        "source": {"s3": "s3://photos/2026/", "include": ["*.jpg"], "exclude": ["tmp/*"]},
        "pipeline": "nightly",
        "output": "s3://results/",
        "video_fps": 0.5,
        "idempotency_key": "k",
    }
    with pytest.raises(TypeError, match="list of globs"):
        client.bulk("detector", "s3://photos/", include="*.jpg")  # a str is a Sequence too


def test_wait_reports_progress_and_returns_the_closed_job(
    api: FakeApi, client: kiln.Client
) -> None:
    answers = iter(
        [
            job_json(status="running", counts={"succeeded": 1, "pending": 1}),
            httpx.Response(503, json={"detail": "The database is busy."}),
            job_json(status="completed", counts={"succeeded": 2, "pending": 0}),
        ]
    )

    def next_answer(_request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        return answer if isinstance(answer, httpx.Response) else httpx.Response(200, json=answer)

    api.on("GET", "/v1/jobs/j1", next_answer)
    seen: list[tuple[str, int]] = []
    job = client.wait(
        kiln.JobOut.model_validate(job_json()),
        progress=lambda j: seen.append((j.status, j.counts.succeeded)),
        poll_interval=0.01,
    )
    assert job.status == "completed" and job.counts.succeeded == 2
    assert seen == [("queued", 0), ("running", 1), ("completed", 2)]  # the 503 waited out
    assert all(float(r.url.params["wait"]) == 0.01 for r in api.seen)


def test_wait_gives_up_after_its_timeout_with_the_last_job(
    api: FakeApi, client: kiln.Client
) -> None:
    api.on("GET", "/v1/jobs/j1", job_json(status="running"))
    with pytest.raises(kiln.JobTimeoutError, match="still running") as raised:
        client.wait("j1", timeout=0.05, poll_interval=0.01)
    assert isinstance(raised.value.job, kiln.JobOut)
    assert raised.value.job.status not in CLOSED


def test_a_pause_after_a_503_is_as_the_api_asked_but_never_past_the_deadline() -> None:
    assert pause_before_asking_again(2.0, None, None, now=0.0) == 2.0
    assert pause_before_asking_again(2.0, 5.0, None, now=0.0) == 5.0
    assert pause_before_asking_again(2.0, 5.0, 103.0, now=100.0) == 3.0
    assert pause_before_asking_again(2.0, 5.0, 99.0, now=100.0) == 0.0


def test_jobs_and_items_page_as_you_iterate(api: FakeApi, client: kiln.Client) -> None:
    def jobs(request: httpx.Request) -> httpx.Response:
        after = request.url.params.get("after")
        page = ["j3", "j2"] if after is None else ["j1"]
        return httpx.Response(
            200, json={"jobs": [job_json(i) for i in page], "next": None if after else "j2"}
        )

    api.on("GET", "/v1/jobs", jobs)
    assert [j.id for j in client.jobs(status="completed")] == ["j3", "j2", "j1"]
    assert api.seen[0].url.params["status"] == "completed"
    assert api.seen[1].url.params["after"] == "j2"
    assert [j.id for j in client.jobs(limit=1)] == ["j3"]
    assert api.seen[-1].url.params["limit"] == "1"

    def items(request: httpx.Request) -> httpx.Response:
        after = int(request.url.params.get("after", 0))
        rows = [
            {"key": f"k{after + n}", "status": "failed", "error": "bad", "attempts": 1,
             "duration_ms": None, "outputs": None}
            for n in (1, 2)
        ]  # fmt: skip
        return httpx.Response(200, json={"items": rows, "next": None if after else "2"})

    api.on("GET", "/v1/jobs/j1/items", items)
    found = list(client.items("j1", status="failed", page_size=2))
    assert [i.key for i in found] == ["k1", "k2", "k3", "k4"]
    assert all(isinstance(i, kiln.ItemOut) and i.error == "bad" for i in found)
    assert api.seen[-1].url.params["status"] == "failed"


def test_results_are_a_table(api: FakeApi, client: kiln.Client) -> None:
    rows = [{"key": "a.jpg", "status": "succeeded"}, {"key": "b.jpg", "status": "failed"}]
    api.on("GET", "/v1/jobs/j1/results", lambda _r: httpx.Response(200, content=parquet(rows)))
    table = client.results("j1")
    assert table.to_pylist() == rows


def test_shards_come_through_presigned_urls_without_the_api_key(
    api: FakeApi, client: kiln.Client
) -> None:
    def signed(key: str) -> dict[str, str]:
        return {"key": key, "url": f"http://s3.local/bucket/{key}?X-Amz-Signature=s"}

    api.on(
        "GET",
        "/v1/jobs/j1/results/urls",
        {
            "job_id": "j1",
            "status": "completed",
            "expires_at": "2026-11-29T05:00:00Z",
            "manifest": signed("j1/manifest.json"),
            "shards": [signed("j1/0.parquet"), signed("j1/1.parquet"), signed("j1/stray.parquet")],
        },
    )
    manifest = {"shards": ["j1/0.parquet", "j1/1.parquet"]}
    api.on("GET", "/bucket/j1/manifest.json", manifest)

    def shard(request: httpx.Request) -> httpx.Response:
        n = request.url.path.removeprefix("/bucket/j1/").removesuffix(".parquet")
        return httpx.Response(200, content=parquet([{"key": f"{n}.jpg", "status": "succeeded"}]))

    for n in (0, 1):
        api.on("GET", f"/bucket/j1/{n}.parquet", shard)
    shards = list(client.iter_result_shards("j1", expires=60))
    assert [s.column("key").to_pylist() for s in shards] == [["0.jpg"], ["1.jpg"]]
    assert api.seen[0].url.params["expires"] == "60"
    fetched = [r for r in api.seen if r.url.host == "s3.local"]
    assert len(fetched) == 3 and all("Authorization" not in r.headers for r in fetched)


def test_shards_without_presigning_are_the_file_s_row_groups(
    api: FakeApi, client: kiln.Client
) -> None:
    api.on(
        "GET",
        "/v1/jobs/j1/results/urls",
        {"detail": "Presigned URLs need S3 storage; download through /v1/jobs/j1/results."},
        status=409,
    )
    rows = [{"key": f"{n}.jpg", "status": "succeeded"} for n in range(5)]
    data = parquet(rows, row_group=2)
    api.on("GET", "/v1/jobs/j1/results", lambda _r: httpx.Response(200, content=data))
    shards = list(client.iter_result_shards("j1"))
    assert [s.num_rows for s in shards] == [2, 2, 1]


def test_download_asks_again_while_groups_are_being_written(
    api: FakeApi, client: kiln.Client, tmp_path: Path
) -> None:
    answers = iter([503, 200])
    api.on(
        "GET",
        "/v1/jobs/j1/groups",
        lambda _r: httpx.Response(s := next(answers), content=b"PAR1" if s == 200 else b"{}"),
    )
    out = tmp_path / "groups.parquet"
    client.download_results("j1", out, groups=True)
    assert out.read_bytes() == b"PAR1"


def test_cancel_and_retry(api: FakeApi, client: kiln.Client) -> None:
    api.on("POST", "/v1/jobs/j1/cancel", job_json(status="cancelling"))
    assert client.cancel("j1").status == "cancelling"
    api.on("POST", "/v1/jobs/j1/retry", job_json("j2", retry_of="j1"), status=201)
    again = client.retry(
        kiln.JobOut.model_validate(job_json()),
        include_cancelled=True,
        idempotency_key="again-1",
        options={"max_distance": 4},
    )
    assert again.id == "j2" and again.retry_of == "j1"
    assert api.seen[-1].headers["Idempotency-Key"] == "again-1"
    assert api.body() == {"include_cancelled": True, "options": {"max_distance": 4}}
    api.on(
        "POST",
        "/v1/jobs/j1/retry",
        {"detail": "Job j1 has no failed items to retry."},
        status=409,
    )
    with pytest.raises(kiln.ConflictError, match="no failed items"):
        client.retry("j1")


def test_estimate_sends_a_bulk_body_and_reads_the_estimate(
    api: FakeApi, client: kiln.Client
) -> None:
    estimate = {
        "objects": 5000, "bytes": 10**9, "images": 4990, "videos": 10, "frames": 600,
        "items": 5590, "sampled": False, "listed": 5000, "rate_per_s": 80.0, "workers": 2,
        "seconds": 69.9, "note": "Listed every object.",
    }  # fmt: skip
    api.on("POST", "/v1/jobs/estimate", estimate)
    found = client.estimate("detector", "s3://photos/", include=["*.jpg"])
    assert isinstance(found, kiln.EstimateOut) and found.items == 5590 and found.seconds == 69.9
    assert api.body() == {
        "model": "detector",
        "source": {"s3": "s3://photos/", "include": ["*.jpg"], "exclude": []},
    }


def test_deliveries_come_from_the_job_s_notify_and_the_secret_from_its_endpoint(
    api: FakeApi, client: kiln.Client
) -> None:
    delivery = {"id": "msg_1", "event": "completed", "status": "delivered", "attempts": 2,
                "last_status": 200}  # fmt: skip
    notify = {"url": "https://hooks.example/k", "events": ["completed"], "deliveries": [delivery]}
    api.on("GET", "/v1/jobs/j1", job_json(status="completed", notify=notify))
    [found] = client.deliveries("j1")
    assert isinstance(found, kiln.DeliveryOut) and found.attempts == 2
    api.on("GET", "/v1/jobs/j2", job_json("j2"))
    assert client.deliveries("j2") == []
    api.on("GET", "/v1/webhooks/secret", {"secret": "whsec_abc"})
    assert client.webhook_secret() == "whsec_abc"


def test_search_sends_an_image_as_a_form_and_a_text_as_json(
    api: FakeApi, client: kiln.Client, tmp_path: Path
) -> None:
    found = {"job_id": "j1", "model": "clip:1", "query": "text", "hits": []}
    api.on("POST", "/v1/jobs/j1/search", found)
    api.on("POST", "/v1/pipelines/lib/search", {**found, "pipeline": "lib"})
    assert client.search("j1", text="a cat", k=3).query == "text"
    assert api.body() == {"text": "a cat", "key": None, "k": 3}
    image = tmp_path / "q.png"
    image.write_bytes(b"png")
    assert client.search(pipeline="lib", image=image).pipeline == "lib"
    assert b'name="file"; filename="q.png"' in api.seen[-1].content  # the route's one `file`
    with pytest.raises(ValueError, match="one of them"):
        client.search("j1", pipeline="lib", text="x")


def test_request_reaches_any_endpoint_with_the_key(api: FakeApi, client: kiln.Client) -> None:
    api.on("GET", "/v1/schedules", [])
    assert client.request("GET", "/v1/schedules").json() == []
    assert api.seen[-1].headers["Authorization"] == "Bearer kiln_key"
    assert json.loads(api.seen[-1].content or b"null") is None

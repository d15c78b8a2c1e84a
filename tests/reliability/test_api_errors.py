"""Bad requests against the live `kiln api`: each answers a 4xx whose JSON `detail` is a
sentence, never a 500. (tests/integration/test_api_edges.py checks some exact sentences.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.services import service_env as process_env
from devstack.services import start_api
from tests.reliability.jobs import sentence_problem
from tests.stack import SOURCE_BUCKET

GOOD_URI = f"s3://{SOURCE_BUCKET}/photos/a.jpg"
MAX_UPLOAD_BYTES = 4096
MAX_FILES = 3


def assert_client_error(response: httpx.Response, status: int | None = None) -> str:
    where = f"{response.request.method} {response.request.url.path}"
    assert 400 <= response.status_code < 500, f"{where}: {response.status_code} {response.text}"
    if status is not None:
        assert response.status_code == status, f"{where}: {response.text}"
    assert response.headers["content-type"].startswith("application/json"), response.headers
    detail = response.json().get("detail")
    problem = sentence_problem(detail)
    assert problem is None, f"{where}: detail {detail!r} is not a sentence: {problem}"
    return str(detail)


def job(**fields: Any) -> dict[str, Any]:
    return {"model": "phash", "inputs": [{"uri": GOOD_URI}], **fields}


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"",
        b"[]",
        b"null",
        b'"phash"',
        b'{"model": "phash", "inputs": [',
        b"\xff\xfe\x00garbage",
        b'{"model": 5, "inputs": [{"uri": "s3://b/k"}]}',
        b'{"model": "phash", "inputs": "s3://kiln-sources/a.jpg"}',
        b'{"model": "phash", "inputs": [{"uri": null}]}',
        b"[" * 5000 + b"]" * 5000,
    ],
    ids=lambda body: body[:40].decode(errors="replace"),
)
def test_malformed_json_is_422(client: httpx.Client, body: bytes) -> None:
    response = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert_client_error(response, 422)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "text-embed", "inputs": [{"text": "a\\u0000b"}]}',
        b'{"model": "text-embed", "inputs": [{"text": "a"}], "options": {"x": 1e400}}',
        b'{"model": "text-embed", "inputs": [{"text": "a"}], "options": {"x": NaN}}',
        b'{"model": "text-embed", "inputs": [{"text": "a"}], "idempotency_key": "\\u0000"}',
    ],
    ids=["nul-in-text", "infinite-option", "nan-option", "nul-in-idempotency-key"],
)
def test_values_the_database_cannot_store_are_422(client: httpx.Client, body: bytes) -> None:
    response = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert_client_error(response, 422)


@pytest.mark.parametrize(
    "model", ["nope", "nope:3", "detector:0", "bad name!", "a" * 129, "", "phash:latest"]
)
def test_unknown_or_malformed_model_is_4xx(client: httpx.Client, model: str) -> None:
    assert_client_error(client.post("/v1/jobs", json=job(model=model)), 422)
    form = client.post("/v1/jobs", data={"model": model}, files=[("files", ("a.jpg", b"x"))])
    assert_client_error(form, 422)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://",
        "s3:/x",
        "s3:///key",
        "http://example.com/a.jpg",
        "ftp://example.com/a.jpg",
        "file:///etc/passwd",  # only `kiln run` on its own machine reads files
        "s3://Bad_Bucket/k",
        "",
        "s3://kiln-sources/" + "k" * 3000,
        "/etc/passwd",
    ],
)
def test_bad_s3_uri_is_4xx(client: httpx.Client, uri: str) -> None:
    assert_client_error(client.post("/v1/jobs", json=job(inputs=[{"uri": uri}])))


@pytest.mark.parametrize(
    "body",
    [
        job(colour="red"),
        job(inputs=[{"uri": GOOD_URI, "weight": 2}]),
        {"model": "phash", "source": {"s3": f"s3://{SOURCE_BUCKET}/", "recursive": True}},
        job(priority="high", callback_url="http://example.com/"),
    ],
)
def test_unknown_fields_are_422(client: httpx.Client, body: dict[str, Any]) -> None:
    assert_client_error(client.post("/v1/jobs", json=body), 422)


@pytest.mark.parametrize(
    ("fields", "files"),
    [
        ({"model": "phash", "options": "{not json"}, [("files", ("a.jpg", b"x"))]),
        ({"model": "phash", "options": "[1, 2]"}, [("files", ("a.jpg", b"x"))]),
        ({"model": "phash", "options": '{"max_distance": 99}'}, [("files", ("a.jpg", b"x"))]),
        ({"model": "phash", "options": '{"a": 1e400}'}, [("files", ("a.jpg", b"x"))]),
        ({"model": "phash", "options": '{"a": NaN}'}, [("files", ("a.jpg", b"x"))]),
        ({"model": "text-embed"}, [("files", ("a.jpg", b"x"))]),
        ({"model": "phash"}, [("files", ("", b"x"))]),
        ({"model": "phash"}, [("files", ("a.jpg", b"x")), ("files", ("a.jpg", b"y"))]),
        ({"model": "phash", "files": "not a file"}, [("other", ("a.jpg", b"x"))]),
        ({f"field{i}": "x" for i in range(30)}, [("files", ("a.jpg", b"x"))]),
    ],
    ids=[
        "options-not-json",
        "options-not-object",
        "options-out-of-range",
        "options-infinity",
        "options-nan",
        "text-model-with-files",
        "no-filename",
        "same-filename-twice",
        "files-as-text",
        "too-many-fields",
    ],
)
def test_bad_multipart_is_4xx(
    client: httpx.Client, fields: dict[str, str], files: list[Any]
) -> None:
    assert_client_error(client.post("/v1/jobs", data=fields, files=files))


@pytest.mark.parametrize(
    ("method", "path", "params"),
    [
        ("GET", "/v1/jobs", {"limit": 0}),
        ("GET", "/v1/jobs", {"limit": "many"}),
        ("GET", "/v1/jobs", {"after": "not-a-cursor"}),
        ("GET", "/v1/jobs/no-such-job", {}),
        ("GET", "/v1/jobs/no-such-job", {"wait": -1}),
        ("GET", "/v1/jobs/no-such-job", {"wait": 10_000}),
        ("GET", "/v1/jobs/no-such-job/items", {"after": -1}),
        ("GET", "/v1/jobs/no-such-job/results", {}),
        ("POST", "/v1/jobs/no-such-job/cancel", {}),
        ("GET", "/v1/models/bad name!", {}),
        ("GET", "/v1/models/nope:7", {}),
        ("GET", "/v1/schedules/nope", {}),
        ("DELETE", "/v1/schedules/nope", {}),
        ("GET", "/v1/no-such-route", {}),
        ("DELETE", "/v1/jobs", {}),
    ],
)
def test_bad_paths_and_parameters_are_4xx(
    client: httpx.Client, method: str, path: str, params: dict[str, Any]
) -> None:
    assert_client_error(client.request(method, path, params=params))


def test_overlong_idempotency_key_header_is_422(client: httpx.Client) -> None:
    response = client.post("/v1/jobs", json=job(), headers={"Idempotency-Key": "k" * 300})
    assert_client_error(response, 422)


@pytest.mark.parametrize(
    "body",
    [
        {"name": "bad name!", "kind": "classify", "source": "s3://m/x.onnx", "spec": {}},
        {"name": "m", "kind": "detect", "source": "s3://m/x.onnx", "spec": {"input_size": 224}},
        {"name": "m", "kind": "classify", "source": "http://x/y.onnx", "spec": {"input_size": 9}},
        {"name": "m", "kind": "classify", "source": "s3://m/x.onnx", "spec": {"input_size": 1}},
    ],
)
def test_bad_model_registrations_are_4xx(client: httpx.Client, body: dict[str, Any]) -> None:
    assert_client_error(client.post("/v1/models", json=body))


@pytest.mark.parametrize(
    "body",
    [
        {"name": "s", "cron": "not a cron", "model": "phash", "source": {"s3": GOOD_URI}},
        {"name": "s", "cron": "99 99 * * *", "model": "phash", "source": {"s3": GOOD_URI}},
        {"name": "s", "cron": "0 2 * * *", "model": "nope", "source": {"s3": GOOD_URI}},
        {"name": "s", "cron": "0 2 * * *", "model": "phash", "source": {"s3": "http://x/"}},
    ],
)
def test_bad_schedules_are_4xx(client: httpx.Client, body: dict[str, Any]) -> None:
    assert_client_error(client.post("/v1/schedules", json=body))


# ---------------------------------------------------------------- size limits


@pytest.fixture(scope="module")
def small_api(
    api_url: str, service_env: dict[str, str], log_dir: Path, client: httpx.Client
) -> Iterator[httpx.Client]:
    """A second `kiln api` on the same database, with tiny upload limits."""
    env = {
        **service_env,
        "KILN_MAX_UPLOAD_BYTES": str(MAX_UPLOAD_BYTES),
        "KILN_MAX_FILES_PER_JOB": str(MAX_FILES),
    }
    api, url = start_api(process_env(env), log_dir, name="api-small-limits")
    try:
        with httpx.Client(base_url=url, headers=client.headers, timeout=60) as http:
            yield http
    finally:
        api.stop()


def test_oversize_file_is_413(small_api: httpx.Client) -> None:
    big = b"\xff" * (MAX_UPLOAD_BYTES + 1)
    response = small_api.post("/v1/jobs", data={"model": "phash"}, files=[("files", ("a", big))])
    assert "4,096-byte limit" in assert_client_error(response, 413)


def test_file_at_the_limit_is_accepted(small_api: httpx.Client) -> None:
    exact = b"\xff" * MAX_UPLOAD_BYTES
    response = small_api.post("/v1/jobs", data={"model": "phash"}, files=[("files", ("a", exact))])
    assert response.status_code == 202, response.text


def test_oversize_request_is_413_before_it_is_read(small_api: httpx.Client) -> None:
    body = b"{" + b" " * (MAX_UPLOAD_BYTES * MAX_FILES) + b"}"
    response = small_api.post(
        "/v1/jobs", content=body, headers={"Content-Type": "application/json"}
    )
    assert_client_error(response, 413)


def test_too_many_files_is_4xx(small_api: httpx.Client) -> None:
    files = [("files", (f"{i}.jpg", b"x")) for i in range(MAX_FILES + 1)]
    response = small_api.post("/v1/jobs", data={"model": "phash"}, files=files)
    assert "files" in assert_client_error(response)


def test_too_many_inputs_is_422(small_api: httpx.Client) -> None:
    inputs = [{"uri": f"s3://{SOURCE_BUCKET}/{i}.jpg"} for i in range(MAX_FILES + 1)]
    response = small_api.post("/v1/jobs", json=job(inputs=inputs))
    assert f"at most {MAX_FILES} inputs" in assert_client_error(response, 422)

"""`bench.gpu`'s service path (part f, issue 32): end to end on the CPU at tiny sizes on real
Postgres and Redis (integration: a missing service skips on a laptop and fails in CI), and its
results check against answers that lose or repeat an item (pure)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench import gpu_service
from devstack.services import (
    ServiceUnavailableError,
    claim_redis_db,
    create_database,
    drop_database,
    release_redis_db,
)
from tests.stack import unavailable

ROOT = Path(__file__).resolve().parents[2]
SERVICE_ROWS = ("kiln worker, ResNet-50", "kiln worker, detector")


@pytest.fixture
def urls() -> Iterator[dict[str, str]]:
    """A database and a Redis index of this test's own (the bench registers a model for every
    tenant: it must not show in another test's catalogue)."""
    try:
        database = create_database(prefix="kiln_test_gpu")
    except ServiceUnavailableError as error:
        unavailable(str(error))
    try:
        try:
            broker = claim_redis_db()
        except ServiceUnavailableError as error:
            unavailable(str(error))
        try:
            yield {"KILN_DATABASE_URL": database, "KILN_BROKER_URL": broker}
        finally:
            release_redis_db(broker)
    finally:
        drop_database(database)


@pytest.mark.integration
@pytest.mark.timeout(420)  # ~1 minute on two idle cores
def test_the_service_path_runs_end_to_end_on_the_cpu(tmp_path: Path, urls: dict[str, str]) -> None:
    out, md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    command = [
        sys.executable, "-m", "bench.gpu", "--device", "cpu", "--workdir", str(tmp_path / "w"),
        "--out", str(out), "--markdown", str(md), "--images", "6", "--seconds", "0.2",
        "--max-batch", "1", "--skip", "native,engine,peer", "--budget", "400",
        "--database-url", urls["KILN_DATABASE_URL"],
    ]  # fmt: skip
    # The broker from the environment, the database from the flag: both ways are read.
    env = {k: v for k, v in os.environ.items() if k not in gpu_service.URL_VARS}
    env["KILN_BROKER_URL"] = urls["KILN_BROKER_URL"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["parts"]["service"]["status"] == "ok", report["parts"]["service"]
    assert report["settings"]["service"]["KILN_BROKER_URL"] == urls["KILN_BROKER_URL"]
    rows = {r["subject"]: r for r in report["rows"] if r["part"] == "service"}
    assert set(rows) == set(SERVICE_ROWS)
    assert rows["kiln worker, ResNet-50"]["versus"] == "kiln run, CPU decode"
    assert rows["kiln worker, detector"]["versus"] == "detector, kiln run"
    for r in rows.values():
        runs = r["runs"]["small"], r["runs"]["large"]
        assert [x["items"] for x in runs] == [2, 6] and all(x["seconds"] > 0 for x in runs), r
        assert r["images_per_s"] > 0 or r["note"].startswith("noise"), r
        for size, items in (("small", 2), ("large", 6)):
            check = r["results"][size]
            assert check["rows"] == check["distinct_keys"] == check["succeeded"] == items, r
            assert check["missing"] == check["unexpected"] == 0
        assert r["submit_s"]["large"] > 0
        assert r["sm_busy"]["mean"] is None  # no NVML here
        assert r["target"] == "≥ 0.9× kiln run, every item once" and r["met"] is None
        if r["ratio"] is not None:  # at 2 → 6 images either rate may be noise: then none
            assert r["reference"] == r["versus"]
    facts = report["parts"]["service"]["facts"]
    assert facts["store"] == "local folder" and facts["workers"].startswith("kiln worker")
    text = md.read_text()
    assert "Service: store: local folder" in text
    assert all(f"| {name} |" in text for name in SERVICE_ROWS)


def test_without_urls_the_service_path_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_DATABASE_URL", raising=False)
    monkeypatch.setenv("KILN_BROKER_URL", "redis://127.0.0.1:6379/9")
    reason = gpu_service.why_not()
    assert reason is not None and reason.startswith("no KILN_DATABASE_URL:")
    monkeypatch.setenv("KILN_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1/kiln")
    assert gpu_service.why_not() is None


def _results(keys: list[str], statuses: list[str]) -> httpx.Client:
    """A client whose API answers the results Parquet of a job with these rows."""
    table = pa.table(
        {
            "key": keys,
            "status": statuses,
            "error": [None if s == "succeeded" else "broken" for s in statuses],
        }
    )
    sink = io.BytesIO()
    pq.write_table(table, sink)

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/jobs/j1/results"
        return httpx.Response(200, content=sink.getvalue())

    return httpx.Client(transport=httpx.MockTransport(answer), base_url="http://kiln")


def _job(succeeded: int, status: str = "completed") -> dict[str, Any]:
    return {"id": "j1", "status": status, "counts": {"succeeded": succeeded}}


def test_every_item_exactly_once_or_the_run_fails() -> None:
    keys = ["a.jpg", "b.jpg", "c.jpg"]
    ok = gpu_service.exactly_once(_results(keys, ["succeeded"] * 3), _job(3), keys)
    assert ok == {"inputs": 3, "rows": 3, "distinct_keys": 3, "missing": 0, "unexpected": 0,
                  "succeeded": 3, "counts_succeeded": 3}  # fmt: skip
    twice = _results(["a.jpg", "b.jpg", "b.jpg", "c.jpg"], ["succeeded"] * 4)
    with pytest.raises(RuntimeError, match="not every item exactly once"):
        gpu_service.exactly_once(twice, _job(3), keys)
    lost = _results(["a.jpg", "b.jpg"], ["succeeded"] * 2)
    with pytest.raises(RuntimeError, match="'missing': 1"):
        gpu_service.exactly_once(lost, _job(2), keys)
    failed = _results(keys, ["succeeded", "failed", "succeeded"])
    with pytest.raises(RuntimeError, match="first error: broken"):
        gpu_service.exactly_once(failed, _job(2, "completed"), keys)
    counted_wrong = _results(keys, ["succeeded"] * 3)  # the Parquet right, the counts not
    with pytest.raises(RuntimeError, match="'counts_succeeded': 4"):
        gpu_service.exactly_once(counted_wrong, _job(4), keys)


def test_a_process_tree_cpu_time_is_read_from_proc() -> None:
    child = subprocess.Popen([sys.executable, "-c", "sum(range(10**7))"])
    child.wait()
    assert gpu_service.tree_cpu_s(os.getpid()) > 0
    assert gpu_service.tree_cpu_s(2**22 + 12345) == 0.0  # no such process

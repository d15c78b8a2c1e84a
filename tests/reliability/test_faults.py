"""Faults with real processes: workers killed, Redis flushed and restarted, Postgres restarted,
S3 away for 10 s, a cancel mid-job, a model that runs out of memory. Every job must finish with
each item accounted for exactly once, in Postgres and in the Parquet results.

These tests own their services (a private Redis server, a private PostgreSQL cluster, a proxy
in front of the session's S3), so breaking them disturbs nothing else. Leases are short and the
reconciler runs every second, so recovery takes seconds, not the production minute.
"""

from __future__ import annotations

import io
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

from devstack.images import photo
from devstack.jobs import wait_closed
from devstack.services import (
    Process,
    ServiceUnavailableError,
    create_api_key,
    kiln_command,
    kiln_env,
    service_env,
    settings_for,
    start_api,
    start_worker,
    wait_for,
)
from kiln.app.core.config import Settings
from kiln.app.db.migrate import upgrade
from kiln.app.db.models import Item
from kiln.app.db.session import make_engine, make_session_factory
from kiln.workers.prep.slots import PREFIX, shm_dir
from tests import videos
from tests.models import oom_embedder
from tests.reliability.faults import PrivatePostgres, PrivateRedis, TcpProxy
from tests.reliability.jobs import items_by_key, upload
from tests.stack import BUCKET, RUNNING, unavailable

IMAGES = 320  # detector: ~10-20 s of work for two workers on two cores


class FaultStack:
    """API, beat and workers over private, breakable services."""

    def __init__(self, env: dict[str, str], log_dir: Path, settings: Settings) -> None:
        self.env, self.log_dir, self.settings = env, log_dir, settings
        self.workers: list[Process] = []
        self.engine = make_engine(settings.database_url, pool_size=2)
        self.sessions = make_session_factory(self.engine)

    def start_worker(self) -> Process:
        name = f"fault-worker-{len(self.workers)}"
        proc, _node = start_worker(self.env, self.log_dir, name=name, node_prefix=name)
        self.workers.append(proc)
        RUNNING[name] = proc
        return proc

    def live_workers(self) -> list[Process]:
        return [w for w in self.workers if w.alive()]

    def ensure_workers(self, count: int) -> None:
        for _ in range(count - len(self.live_workers())):
            self.start_worker()


@pytest.fixture(scope="module")
def stack(
    s3_endpoint: str, s3: Any, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[FaultStack, httpx.Client, PrivateRedis, PrivatePostgres, TcpProxy]]:
    root = tmp_path_factory.mktemp("faults")
    try:
        pg = PrivatePostgres()
        rds = PrivateRedis(log_dir)
    except ServiceUnavailableError as error:
        unavailable(str(error))
    endpoint = urlparse(s3_endpoint)
    proxy = TcpProxy(endpoint.hostname or "127.0.0.1", endpoint.port or 80)
    kiln = kiln_env(
        data_dir=root / "data",
        database_url=pg.url,
        broker_url=rds.url,
        storage_url=f"s3://{BUCKET}/faults-{secrets.token_hex(3)}",
        s3_endpoint=proxy.url,
        chunk_size="8",
        bulk_chunk_size="8",
        max_batch="8",
        max_delay_ms="20",
        worker_concurrency="4",
        lease_s="4",
        lease_renew_s="0.5",
        redispatch_after_s="3",
        reconcile_interval_s="1",
        db_pool_timeout_s="5",
    )
    settings = settings_for(kiln)
    upgrade(settings)
    env = service_env(kiln)
    faults = FaultStack(env, log_dir, settings)
    key = create_api_key(settings, "faults")
    started: list[Process] = []
    try:
        api, url = start_api(env, log_dir, name="fault-api")
        started.append(api)
        RUNNING["fault-api"] = api
        beat = Process("fault-beat", kiln_command("beat"), env, log_dir)
        started.append(beat)
        RUNNING["fault-beat"] = beat
        faults.ensure_workers(2)
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            yield faults, client, rds, pg, proxy
    finally:
        for proc in [*faults.workers, *started]:
            proc.stop()
        for name in [n for n in RUNNING if n.startswith("fault-")]:
            RUNNING.pop(name)
        faults.engine.dispose()
        proxy.down()
        rds.stop()
        pg.stop()


Stack = tuple[FaultStack, httpx.Client, PrivateRedis, PrivatePostgres, TcpProxy]


def _images(count: int, tag: str) -> dict[str, bytes]:
    return {f"{tag}-{i:04d}.jpg": photo(i, size=(96, 72)) for i in range(count)}


def _done(client: httpx.Client, job_id: str) -> int:
    response = client.get(f"/v1/jobs/{job_id}")
    if response.status_code != 200:
        return 0  # mid-fault: the API may answer 503 for a moment
    counts = response.json()["counts"]
    return int(counts["succeeded"] + counts["failed"] + counts["cancelled"])


def _wait_done(client: httpx.Client, job_id: str, at_least: int, timeout: float = 120) -> None:
    wait_for(lambda: _done(client, job_id) >= at_least, timeout, f"{at_least} items done")


def _submit(client: httpx.Client, files: dict[str, bytes], model: str = "detector") -> str:
    response = upload(client, files, model)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _assert_exactly_once(stack: Stack, job_id: str, keys: set[str]) -> dict[str, Any]:
    """Completed; every key one item row, succeeded; the Parquet results hold each key once."""
    faults, client = stack[0], stack[1]
    job = wait_closed(client, job_id, timeout=240)
    assert job["status"] == "completed", job
    items = items_by_key(client, job_id)
    assert set(items) == keys
    assert {i["status"] for i in items.values()} == {"succeeded"}, {
        k: i["error"] for k, i in items.items() if i["status"] != "succeeded"
    }
    with faults.sessions() as session:
        rows = session.scalar(select(func.count()).where(Item.job_id == job_id))
    assert rows == len(keys)
    response = client.get(f"/v1/jobs/{job_id}/results")
    assert response.status_code == 200, response.text
    table = pq.read_table(io.BytesIO(response.content))
    result_keys = table.column("key").to_pylist()
    assert len(result_keys) == len(set(result_keys)) == len(keys), "duplicate or missing rows"
    assert set(result_keys) == keys
    return items


def _assert_workers_lived(workers: list[Process]) -> None:
    for worker in workers:
        assert worker.alive(), f"{worker.name} died:\n{worker.log_tail()}"


def test_three_workers_killed_mid_job(stack: Stack) -> None:
    """Each kill -9 leaves the victim's shared memory behind (it cannot unlink it) and its
    prep processes orphaned: they exit by themselves, and the next worker reclaims the
    segments when it starts its prep processes."""
    faults, client = stack[0], stack[1]
    faults.ensure_workers(2)
    files = _images(IMAGES, "kill")
    job_id = _submit(client, files)
    orphans: list[psutil.Process] = []
    for kill, fraction in enumerate((0.15, 0.35, 0.55)):
        _wait_done(client, job_id, int(IMAGES * fraction))
        victim = faults.live_workers()[0]
        orphans += _prep_processes(victim)
        victim.kill()  # SIGKILL: no acks, no lease release, chunks held mid-batch
        faults.start_worker()
        print(f"kill {kill + 1}: {victim.name} at {_done(client, job_id)}/{IMAGES}")
    items = _assert_exactly_once(stack, job_id, set(files))
    rerun = sum(1 for i in items.values() if i["attempts"] > 1)
    print(f"{rerun} items ran more than once (their run was killed); none duplicated")
    assert rerun > 0, "no kill landed on a running chunk; the test proved nothing"
    assert orphans, "the killed workers had no prep processes; the test proved nothing"
    _gone, alive = psutil.wait_procs(orphans, timeout=10)
    assert not alive, f"prep processes outlived their killed worker: {alive}"
    assert _dead_segments() == [], "a killed worker's shared memory was never reclaimed"


def test_a_worker_killed_mid_video_loses_no_frame(stack: Stack, tmp_path: Path) -> None:
    """A video's frames are items like any other: a worker killed while it decodes and runs
    them leaves leases that run out, and every sampled moment still ends exactly once."""
    faults, client = stack[0], stack[1]
    faults.ensure_workers(2)
    clip = videos.numbered(tmp_path / "dashcam.mp4", 96, fps=10, size=(320, 240))
    parts = [("files", ("dashcam.mp4", clip.read_bytes(), "video/mp4"))]
    response = client.post("/v1/jobs", data={"model": "detector", "video_fps": "5"}, files=parts)
    assert response.status_code == 202, response.text
    job_id = str(response.json()["id"])
    _wait_done(client, job_id, 30)
    victim = faults.live_workers()[0]
    victim.kill()
    faults.start_worker()
    print(f"killed {victim.name} at {_done(client, job_id)}/480 frames")
    keys = {f"dashcam.mp4#t={k / 5:.3f}" for k in range(480)}
    items = _assert_exactly_once(stack, job_id, keys)
    assert sorted(i["frame_index"] for i in items.values()) == list(range(0, 960, 2))
    rerun = sum(1 for i in items.values() if i["attempts"] > 1)
    print(f"{rerun} frames ran more than once (their run was killed); none duplicated")


def test_a_prep_process_killed_mid_job(stack: Stack) -> None:
    """SIGKILL to one prep process of a running worker: the pool replaces it, the units it
    held run again, every item ends once, and the worker never notices beyond a log line."""
    faults = stack[0]

    def kill_a_prep_process() -> None:
        worker = faults.live_workers()[0]
        preps = _prep_processes(worker)
        assert preps, f"{worker.name} has no prep processes"
        preps[0].kill()

    _survives(stack, "prep-kill", kill_a_prep_process)


def _prep_processes(worker: Process) -> list[psutil.Process]:
    """A worker's prep processes: its children started by multiprocessing's spawn."""
    children = psutil.Process(worker.pid).children(recursive=True)
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def _dead_segments() -> list[str]:
    """Kiln shared-memory segments whose owner process is gone."""
    found = []
    for path in shm_dir().glob(f"{PREFIX}*"):
        owner = path.name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            found.append(path.name)
    return found


def _survives(stack: Stack, name: str, fault: Callable[[], None]) -> None:
    """Run a job on two workers, apply `fault` at ~20 %, and require the job to complete with
    every item once and the same worker processes alive (they recovered by themselves)."""
    faults, client = stack[0], stack[1]
    faults.ensure_workers(2)
    workers = faults.live_workers()
    files = _images(IMAGES, name)
    job_id = _submit(client, files)
    _wait_done(client, job_id, IMAGES // 5)
    at = _done(client, job_id)
    fault()
    print(f"{name} at {at}/{IMAGES}")
    _assert_exactly_once(stack, job_id, set(files))
    _assert_workers_lived(workers)


@pytest.mark.parametrize("fault", ["flushall", "restart"])
def test_redis_flushed_or_restarted_mid_job(stack: Stack, fault: str) -> None:
    rds = stack[2]
    # flushall: every queued and unacked message is gone; restart: connections drop too
    _survives(stack, f"redis-{fault}", rds.flushall if fault == "flushall" else rds.restart)


def test_postgres_restarted_mid_job(stack: Stack) -> None:
    _survives(stack, "postgres-restart", stack[3].restart)
    assert stack[1].get("/readyz").status_code == 200


def test_s3_down_for_ten_seconds(stack: Stack) -> None:
    proxy = stack[4]

    def away_for_ten_seconds() -> None:
        proxy.down()
        time.sleep(10)
        proxy.up()

    _survives(stack, "s3-down", away_for_ten_seconds)


def test_cancel_mid_job(stack: Stack) -> None:
    faults, client = stack[0], stack[1]
    faults.ensure_workers(2)
    files = _images(IMAGES, "cancel")
    job_id = _submit(client, files)
    _wait_done(client, job_id, IMAGES // 5)
    response = client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 200, response.text
    assert response.json()["status"] in ("cancelling", "cancelled")
    started = time.monotonic()
    job = wait_closed(client, job_id, timeout=30)
    took = time.monotonic() - started
    print(f"cancelled {took:.1f} s after the request")
    assert job["status"] == "cancelled" and took < 10
    items = items_by_key(client, job_id)
    succeeded = {k for k, i in items.items() if i["status"] == "succeeded"}
    cancelled = {k for k, i in items.items() if i["status"] == "cancelled"}
    assert succeeded and cancelled and succeeded | cancelled == set(files)
    assert all(items[k]["outputs"] is None for k in cancelled)
    table = pq.read_table(io.BytesIO(client.get(f"/v1/jobs/{job_id}/results").content))
    rows = {r["key"]: r["status"] for r in table.select(["key", "status"]).to_pylist()}
    assert {k for k, s in rows.items() if s == "succeeded"} == succeeded  # results kept
    time.sleep(3)  # nothing cancelled runs later
    assert {k for k, i in items_by_key(client, job_id).items() if i["status"] == "succeeded"} == (
        succeeded
    )


def test_a_model_that_runs_out_of_memory_is_split_and_the_worker_lives(
    stack: Stack, tmp_path: Path
) -> None:
    """The model's engine fails to allocate for batches over 2 (a real ONNX Runtime
    allocation failure): batches are split, every item succeeds, the cap drops to 2."""
    faults, client = stack[0], stack[1]
    faults.ensure_workers(1)
    workers = faults.live_workers()
    path = tmp_path / "oom.onnx"
    oom_embedder(path)
    spec = '{"input_size": 32, "mean": [0, 0, 0], "std": [1, 1, 1]}'
    response = client.post(
        "/v1/models",
        data={"name": "oom-embedder", "kind": "embed", "spec": spec},
        files=[("file", ("oom.onnx", path.read_bytes()))],
    )
    assert response.status_code == 201, response.text
    files = _images(24, "oom")
    job_id = _submit(client, files, model=str(response.json()["ref"]))
    _assert_exactly_once(stack, job_id, set(files))
    _assert_workers_lived(workers)
    logs = "".join(w.log_path.read_text(errors="replace") for w in workers)
    assert "ran out of memory" in logs

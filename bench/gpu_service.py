"""`bench.gpu`'s service path (part f, issue 32): Kiln as a service on the host's own Postgres and
Redis, fed as a user feeds it, beside `kiln run` on the same JPEGs.

Where `KILN_DATABASE_URL` and `KILN_BROKER_URL` are set (or `bench.gpu --database-url
--broker-url`, which set them), the part does what the README's "As a service" does: `kiln db
upgrade`, `kiln storage check --create`, `kiln keys create`, `kiln models add` (ResNet-50), then
`kiln api` and `kiln worker` (`--devices all` on a GPU host: one process per device, each pinned
to it), and waits until `/readyz` answers 200 and every worker answers a ping. Kiln's store is
`KILN_STORAGE_URL` if set, else a local folder under the workdir. Without the two URLs its rows
say why not.

For ResNet-50 and the built-in detector: the small folder's JPEGs once untimed (the worker loads
the model), then the small and the large folder, each uploaded as one job over HTTP (`POST
/v1/jobs` with the files, as `kiln submit` sends them; over 256 items Kiln makes it a bulk job,
512-item chunks on the bulk queue), and followed with `GET /v1/jobs/{id}?wait=` until it closes.
A run's seconds are from the submit's answer (the bytes are in Kiln's store by then) to the
close; the upload before it is kept apart (`submit_s`). The rate is marginal over the two sizes,
as the `kiln run` rows', so start-up and per-job costs cancel; NVML's busy share is sampled over
the same window. Each job's results are then checked as a user would: the job's Parquet
(`GET /v1/jobs/{id}/results`) holds every input's key exactly once, all succeeded, and the job's
counts agree; a run that fails the check fails its row.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.gpu_feed import SIDE, Busy, Run, Subject
from bench.models import labels
from devstack.jobs import wait_closed

URL_VARS = ("KILN_DATABASE_URL", "KILN_BROKER_URL")
TENANT = "gpu-bench"
READY_S = 180  # a GPU worker imports torch and probes the device before it answers
JOB_S = 1800


def why_not() -> str | None:
    """Why the service path cannot run here (no database or broker named), or None."""
    missing = [name for name in URL_VARS if not os.environ.get(name)]
    if not missing:
        return None
    return (
        f"no {' or '.join(missing)}: Kiln's service needs Postgres and Redis "
        "(set them, or bench.gpu --database-url/--broker-url)"
    )


@dataclass
class Service:
    """A running `kiln api` and its workers, and an HTTP client holding the tenant's key."""

    http: httpx.Client
    env: dict[str, str]
    workers: list[subprocess.Popen[bytes]]
    facts: dict[str, Any]


@contextmanager
def service(workdir: Path, device: str, engine: str, onnx: Path, images: int) -> Iterator[Service]:
    """Kiln's service on the named database and broker, ResNet-50 registered; all stopped on
    exit."""
    logs = workdir / "service-logs"
    logs.mkdir(parents=True, exist_ok=True)
    store = workdir / "service-store"
    env = {
        **os.environ,
        "KILN_DATA_DIR": str(workdir / "service-data"),
        "KILN_STORAGE_URL": os.environ.get("KILN_STORAGE_URL") or store.as_uri(),
        "KILN_ENGINE": engine,
        "KILN_CONTENT_CACHE": "false",  # the same JPEGs again must run, not be looked up
        "KILN_MAX_FILES_PER_JOB": str(max(1000, images)),
    }
    kiln(env, logs, "db", "upgrade")
    kiln(env, logs, "storage", "check", "--create")
    key = kiln(env, logs, "keys", "create", "--tenant", TENANT).split()[-1]
    names = workdir / "service-labels.txt"
    names.write_text("\n".join(labels(1000)) + "\n")
    add = ("models", "add", "resnet50", "--onnx", str(onnx), "--input-size", str(SIDE))
    kiln(env, logs, *add, "--labels", str(names))
    with ExitStack() as stack:
        port = _free_port()
        api = _start(stack, env, logs / "api.log", "api", "--port", str(port))
        nodes, worker_args = _worker_plan(device)
        worker = _start(stack, env, logs / "worker.log", "worker", *worker_args)
        url = f"http://127.0.0.1:{port}"
        ready = lambda: httpx.get(url + "/readyz").status_code == 200  # noqa: E731
        _wait(ready, READY_S, "kiln api /readyz", api)
        _wait_for_workers(env, nodes, worker)
        headers = {"Authorization": f"Bearer {key}"}
        http = stack.enter_context(httpx.Client(base_url=url, headers=headers, timeout=600))
        facts = {
            "store": "local folder" if env["KILN_STORAGE_URL"].startswith("file:") else "S3",
            "workers": f"kiln worker {' '.join(worker_args)}: {', '.join(sorted(nodes))}",
            "submit": "uploads over HTTP, one job per size",
        }
        yield Service(http, env, [worker], facts)


def kiln(env: dict[str, str], logs: Path, *args: str) -> str:
    """One Kiln command to its end; its standard output. A failure says what it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "kiln.app.cli", *args], env=env, capture_output=True, text=True
    )
    with (logs / "commands.log").open("a") as log:
        log.write(f"$ kiln {args[0]} {args[1] if len(args) > 1 else ''}\n{done.stderr}\n")
    if done.returncode != 0:
        raise RuntimeError(f"kiln {' '.join(args[:2])} failed: {done.stderr.strip()[-300:]}")
    return done.stdout


def _start(stack: ExitStack, env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    sink = stack.enter_context(log.open("wb"))
    command = [sys.executable, "-m", "kiln.app.cli", *args]
    proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    stack.callback(_stop, proc)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """TERM (a fleet passes it on to its workers), then KILL after 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _worker_plan(device: str) -> tuple[set[str], list[str]]:
    """The workers' Celery node names and `kiln worker`'s arguments: on a GPU host one process
    per visible device (`--devices all`, named gpu<N>@host), on a CPU one process."""
    host = socket.gethostname()
    if device == "cuda":
        from kiln.workers.ops.device import list_gpus

        gpus = list_gpus()
        nodes = {f"gpu{g.index}@{host}" for g in gpus} or {f"cpu@{host}"}
        return nodes, ["--devices", "all"]
    node = f"gpu-bench-{secrets.token_hex(3)}@{host}"
    return {node}, ["--hostname", node]


def _wait_for_workers(env: dict[str, str], nodes: set[str], proc: subprocess.Popen[bytes]) -> None:
    from kiln.app.core.config import get_settings
    from kiln.app.dispatch.producer import make_producer

    producer = make_producer(get_settings(broker_url=env["KILN_BROKER_URL"]))
    try:

        def answered() -> bool:
            replies = producer.control.ping(list(nodes), timeout=1.0)
            return {name for reply in replies for name in reply} >= nodes

        _wait(answered, READY_S, f"kiln worker ({', '.join(sorted(nodes))})", proc)
    finally:
        producer.close()


def _wait(check: Any, timeout: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the process ended ({proc.returncode}); see its log")
        with contextlib.suppress(Exception):  # not up yet
            if check():
                return
        time.sleep(0.25)
    raise TimeoutError(f"{what} not ready within {timeout:.0f} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Measured:
    """A subject's two timed runs, with what a user would see besides the rate."""

    subject: Subject
    submit_s: dict[str, float]
    results: dict[str, dict[str, int]]


def measure(svc: Service, name: str, model: str, folders: tuple[Path, Path]) -> Measured:
    """The small folder once untimed (the model loads), then the small and the large one."""
    small, large = (sorted(folder.iterdir()) for folder in folders)
    run_job(svc, model, small)
    runs = [run_job(svc, model, paths) for paths in (small, large)]
    subject = Subject(name, runs[0][0], runs[1][0])
    sizes = ("small", "large")
    return Measured(
        subject,
        {size: r[1] for size, r in zip(sizes, runs, strict=True)},
        {size: r[2] for size, r in zip(sizes, runs, strict=True)},
    )


def run_job(svc: Service, model: str, paths: Sequence[Path]) -> tuple[Run, float, dict[str, int]]:
    """One job of `paths` uploaded over HTTP and followed to its close: the run (from the
    submit's answer), the upload's seconds, and the results' check."""
    files = [("files", (p.name, p.read_bytes(), "image/jpeg")) for p in paths]
    started = time.perf_counter()
    response = svc.http.post("/v1/jobs", data={"model": model}, files=files)
    if response.status_code != 202:
        raise RuntimeError(f"submit answered {response.status_code}: {response.text[:200]}")
    answered = time.perf_counter()
    job_id = str(response.json()["id"])
    cpu0 = sum(tree_cpu_s(w.pid) for w in svc.workers)
    with Busy() as busy:
        job = wait_closed(svc.http, job_id, timeout=JOB_S, poll_s=30)
        seconds = time.perf_counter() - answered
    cpu = sum(tree_cpu_s(w.pid) for w in svc.workers) - cpu0
    check = exactly_once(svc.http, job, [p.name for p in paths])
    run = Run(len(paths), round(seconds, 3), round(cpu, 2), busy.samples)
    return run, round(answered - started, 3), check


def exactly_once(http: httpx.Client, job: dict[str, Any], keys: Sequence[str]) -> dict[str, int]:
    """The job's results hold every key in `keys` exactly once, each succeeded, and its counts
    say so too; the figures, or a RuntimeError saying what is wrong."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    response = http.get(f"/v1/jobs/{job['id']}/results")
    response.raise_for_status()
    table = pq.read_table(io.BytesIO(response.content), columns=["key", "status", "error"])
    got = table["key"].to_pylist()
    succeeded = int(pc.sum(pc.equal(table["status"], "succeeded")).as_py() or 0)
    figures = {
        "inputs": len(keys),
        "rows": table.num_rows,
        "distinct_keys": len(set(got)),
        "missing": len(set(keys) - set(got)),
        "unexpected": len(set(got) - set(keys)),
        "succeeded": succeeded,
        "counts_succeeded": int(job["counts"]["succeeded"]),
    }
    n = len(keys)
    good = figures["rows"] == figures["distinct_keys"] == figures["succeeded"] == n
    good = good and not (figures["missing"] or figures["unexpected"])
    if not good or job["status"] != "completed" or figures["counts_succeeded"] != n:
        errors = pc.filter(table["error"], pc.is_valid(table["error"]))
        first = errors[0].as_py() if len(errors) else None
        raise RuntimeError(
            f"job {job['id']} {job['status']}: not every item exactly once ({figures}; "
            f"first error: {first})"
        )
    return figures


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and its live descendants, from /proc; what ended
    and was reaped counts in its parent's. 0 where /proc does not answer."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11:15]) / tick  # utime stime cutime cstime
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return total

"""`kiln run` as a user runs it, in a subprocess: beside a service whose variables are exported
it still processes its files itself, and says so; Ctrl-C cancels its job and exits 130."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from devstack.images import photo
from devstack.services import Process, kiln_command, service_env, wait_for
from kiln.app.db.models import Job
from tests.stack import run_kiln


def one_line(text: str) -> str:
    return " ".join(text.split())  # Rich wraps long sentences at the console width


def photos(folder: Path, count: int, size: tuple[int, int] = (320, 240)) -> Path:
    folder.mkdir()
    for n in range(count):
        (folder / f"p{n:04d}.jpg").write_bytes(photo(n, size))
    return folder


def test_kiln_run_beside_a_service_processes_its_files_itself(
    tmp_path: Path, service_env: dict[str, str], worker: Process, sessions: object
) -> None:
    """README's "As a service" variables exported (Postgres, Redis, moto S3) and a `kiln
    worker` on that broker, which cannot read local files and once failed every item: the run
    is the embedded one under KILN_DATA_DIR, and the service sees nothing of it."""
    here = tmp_path / "here"
    out = tmp_path / "out.parquet"
    env = {**service_env, "KILN_DATA_DIR": str(here)}
    done = run_kiln(env, "run", str(photos(tmp_path / "photos", 6)), "--model", "phash",
                    "-o", str(out), timeout=120)  # fmt: skip

    assert done.returncode == 0, done.stderr
    service = (env["KILN_DATABASE_URL"], env["KILN_BROKER_URL"], env["KILN_STORAGE_URL"])
    assert (
        f"Running here, embedded (SQLite and files under {here}); the service at "
        f"{service[0]}, {service[1]} and {service[2]} is not used — `kiln submit` sends to it."
    ) in one_line(done.stderr)
    assert "completed" in done.stdout
    assert Counter(pq.read_table(out).column("status").to_pylist()) == {"succeeded": 6}
    with sqlite3.connect(here / "kiln.db") as local:
        (job_id,) = local.execute("SELECT id FROM jobs").fetchone()
    with sessions() as session:  # type: ignore[operator]
        assert session.get(Job, job_id) is None  # nothing reached the service's database


def start_run(tmp_path: Path, count: int) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """`kiln run` over `count` photos, small chunks two at a time (most of the job still
    queued for a while), in a session of its own as a terminal's foreground job is."""
    data, out = tmp_path / "data", tmp_path / "out.parquet"
    folder = photos(tmp_path / "photos", count)
    env = service_env({
        "KILN_DATA_DIR": str(data), "KILN_CHUNK_SIZE": "8", "KILN_BULK_CHUNK_SIZE": "8",
        "KILN_WORKER_CONCURRENCY": "2", "KILN_MAX_BATCH": "8", "KILN_CONTENT_CACHE": "false",
    })  # fmt: skip
    command = kiln_command("run", str(folder), "--model", "phash", "-o", str(out))
    with (tmp_path / "stdout").open("wb") as stdout, (tmp_path / "stderr").open("wb") as stderr:
        proc = subprocess.Popen(
            command, env=env, stdout=stdout, stderr=stderr, start_new_session=True
        )
    return proc, data / "kiln.db", out


def succeeded(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        (count,) = conn.execute("SELECT count(*) FROM items WHERE status = 'succeeded'").fetchone()
    return int(count)


def ctrl_c(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the run's whole process group, as Ctrl-C in a terminal sends it."""
    os.killpg(proc.pid, signal.SIGINT)


def test_ctrl_c_cancels_the_job_keeps_what_finished_and_exits_130(tmp_path: Path) -> None:
    proc, db, out = start_run(tmp_path, 1200)
    try:
        wait_for(lambda: proc.poll() is None and succeeded(db) >= 16, 45, "a run under way")
        ctrl_c(proc)
        signalled = time.monotonic()
        code = proc.wait(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
    waited = time.monotonic() - signalled
    stdout = one_line((tmp_path / "stdout").read_text())
    stderr = one_line((tmp_path / "stderr").read_text())

    assert code == 130, stderr
    assert waited < 35, waited
    assert "Cancelling job" in stderr
    with sqlite3.connect(db) as conn:
        (status,) = conn.execute("SELECT status FROM jobs").fetchone()
        counts = dict(conn.execute("SELECT status, count(*) FROM items GROUP BY status"))
    assert status == "cancelled"
    assert set(counts) <= {"succeeded", "cancelled"} and counts["cancelled"] > 600, counts
    assert counts["succeeded"] >= 16 and sum(counts.values()) == 1200
    assert (
        f"Cancelled (Ctrl-C): {counts['succeeded']} succeeded, 0 failed, "
        f"{counts['cancelled']} cancelled; the finished items are in {out}."
    ) in stderr
    assert f"cancelled: {counts['cancelled']} items" in stdout  # the summary says so too
    rows = pq.read_table(out).select(["status", "phash"]).to_pylist()
    done = [r for r in rows if r["status"] == "succeeded"]
    assert len(done) == counts["succeeded"] and all(r["phash"] for r in done)


def test_a_second_ctrl_c_quits_at_once(tmp_path: Path) -> None:
    proc, db, _out = start_run(tmp_path, 1200)
    try:
        wait_for(lambda: proc.poll() is None and succeeded(db) >= 16, 45, "a run under way")
        ctrl_c(proc)
        time.sleep(0.1)
        ctrl_c(proc)
        signalled = time.monotonic()
        code = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130
    assert time.monotonic() - signalled < 3
    assert "Quit at once" in (tmp_path / "stderr").read_text()

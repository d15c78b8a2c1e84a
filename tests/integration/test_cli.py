"""The CLI: `kiln run` on the embedded defaults, registration, and the HTTP client commands."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq

from devstack.images import solid
from devstack.services import kiln_command
from tests.models import colour_classifier
from tests.stack import run_kiln

ROOT = Path(__file__).resolve().parents[2]


def test_kiln_run_on_the_examples_reads_their_text(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["KILN_DATA_DIR"] = str(tmp_path / "data")
    out = tmp_path / "results.parquet"
    done = subprocess.run(
        kiln_command("run", str(ROOT / "examples"), "--model", "ocr", "-o", str(out)),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "completed" in done.stdout
    rows = {r["key"]: r for r in pq.read_table(out).to_pylist()}
    assert len(rows) == len(list((ROOT / "examples").glob("*.[jp][pn]g")))
    assert all(r["status"] == "succeeded" for r in rows.values())
    assert "KILN" in rows["poster.png"]["text"]
    assert "Room 42" in rows["note.png"]["text"]
    assert all(len(line["box"]) == 4 for line in rows["poster.png"]["lines"])


def test_registered_classifier_runs_through_the_api(
    tmp_path: Path, service_env: dict, client, migrated
) -> None:
    model_path, labels = tmp_path / "colours.onnx", tmp_path / "labels.txt"
    colour_classifier(model_path)
    labels.write_text("red\ngreen\nblue\ndark\n")
    added = run_kiln(
        service_env,
        "models",
        "add",
        "colours",
        "--onnx",
        str(model_path),
        "--kind",
        "classify",
        "--input-size",
        "32",
        "--labels",
        str(labels),
        "--mean",
        "0,0,0",
        "--std",
        "1,1,1",
        "--top-k",
        "2",
    )
    assert added.returncode == 0, added.stderr
    assert "model colours:1 (classify) registered" in added.stdout
    no_labels = run_kiln(service_env, "models", "add", "colours", "--onnx", str(model_path))
    assert no_labels.returncode == 1 and "needs labels" in no_labels.stderr
    builtin = run_kiln(service_env, "models", "add", "ocr", "--onnx", str(model_path))
    assert builtin.returncode == 1 and "is a built-in model" in builtin.stderr
    listed = run_kiln(service_env, "models", "list")
    assert "colours:1" in listed.stdout and "text-embed" in listed.stdout

    files = [
        ("files", (f"{name}.png", solid(rgb), "image/png"))
        for name, rgb in (("r", (250, 5, 5)), ("g", (5, 250, 5)), ("b", (5, 5, 250)))
    ]
    job = client.post("/v1/jobs", data={"model": "colours"}, files=files).json()
    from tests.integration.test_http_jobs import wait_done

    assert wait_done(client, job["id"])["counts"]["succeeded"] == 3
    items = client.get(f"/v1/jobs/{job['id']}/items").json()["items"]
    best = {i["key"]: i["outputs"]["labels"][0]["label"] for i in items}
    assert best == {"r.png": "red", "g.png": "green", "b.png": "blue"}
    assert all(len(i["outputs"]["labels"]) == 2 for i in items)


def test_cli_client_commands(
    tmp_path: Path, service_env: dict, api_url: str, client, sessions
) -> None:
    from tests.stack import _key

    env = {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": _key(sessions, "cli")}
    image = tmp_path / "one.png"
    image.write_bytes(solid((10, 200, 30)))
    submitted = run_kiln(env, "submit", str(image), "--model", "detector", "--wait")
    assert submitted.returncode == 0, submitted.stderr
    assert "completed: 1 succeeded" in submitted.stdout
    job_id = submitted.stdout.split()[1]
    out = tmp_path / "r.parquet"
    assert run_kiln(env, "results", job_id, "-o", str(out)).returncode == 0
    assert pq.read_table(out).num_rows == 1
    groups = tmp_path / "g.parquet"
    assert run_kiln(env, "results", job_id, "--groups", "-o", str(groups)).returncode == 0
    assert pq.read_table(groups).column_names == ["group", "key", "similarity", "sha256"]
    status = run_kiln(env, "status", "not-a-job")
    assert status.returncode == 1 and "There is no job not-a-job." in status.stderr
    followed = run_kiln(env, "status", "not-a-job", "--watch")  # the sentence, and no bar
    assert followed.returncode == 1 and "There is no job not-a-job." in followed.stderr
    assert "0/?" not in followed.stderr
    # waited for, a job none of whose items succeeded exits 1 and says why, as `kiln run`
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not really a JPEG")
    failed = run_kiln(env, "submit", str(broken), "--model", "phash", "--wait")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    said = " ".join(failed.stderr.split())
    assert "no item succeeded (1 failed). The first error: " in said, said
    assert "(1 item)" in failed.stdout
    again = run_kiln(env, "status", failed.stdout.split()[1], "--watch")
    assert again.returncode == 1 and "no item succeeded" in again.stderr
    nokey = run_kiln({**env, "KILN_API_KEY": "kiln_wrong"}, "status", job_id)
    assert nokey.returncode == 1 and "unknown or revoked" in nokey.stderr


def test_flower_requires_auth_and_sees_the_worker(service_env: dict, worker, log_dir: Path) -> None:
    import httpx

    from devstack.services import Process, free_port, wait_for
    from tests.stack import _env

    refused = run_kiln({**service_env, "KILN_FLOWER_BASIC_AUTH": ""}, "flower")
    assert refused.returncode == 1 and "KILN_FLOWER_BASIC_AUTH" in refused.stderr
    port = free_port()
    env = _env({**service_env, "KILN_FLOWER_BASIC_AUTH": "ops:s3cret"})
    flower = Process("flower", kiln_command("flower", "--port", str(port)), env, log_dir)
    url = f"http://127.0.0.1:{port}/api/workers"
    try:
        wait_for(lambda: httpx.get(url).status_code == 401, 30, "flower")

        def lists_worker() -> bool:
            workers = httpx.get(url, auth=("ops", "s3cret"), params={"refresh": "1"}).json()
            return any(name.startswith("test-") for name in workers)

        wait_for(lists_worker, 30, "the worker in flower", interval=1)
    finally:
        flower.stop()

"""The README's "From Python" examples run as written, against the real stack (`kiln api`, a
worker, Postgres, Redis, moto S3), each block on its own as a user would paste it: from the
repository's root (they name examples/ files), with KILN_API_URL and KILN_API_KEY set. The
stack is the one that sends webhooks (`webhook_stack`: a signing secret, and 127.0.0.1 allowed
as the README's webhook example says), which the other examples do not mind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.app.tenants.tenants import allow_bucket
from tests.stack import WebhookStack

ROOT = Path(__file__).resolve().parents[2]
SECTION = re.compile(r"^#### From Python\n(.*?)^#{1,4} ", re.M | re.S)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
BUCKET, PREFIX = "photos", "2026/"  # the bulk example's s3://photos/2026/


def python_examples() -> list[str]:
    section = SECTION.search((ROOT / "README.md").read_text())
    assert section, "README.md has no '#### From Python' section"
    return BLOCK.findall(section.group(1))


@pytest.fixture(scope="module")
def readme_env(webhook_stack: WebhookStack, s3: object) -> dict[str, str]:
    """A tenant whose key may read s3://photos, which holds the examples' images under 2026/
    (and a text file the bulk example's globs leave out)."""
    tenant = "readme"
    key = webhook_stack.key(tenant)
    with webhook_stack.sessions() as session:
        allow_bucket(session, tenant, BUCKET)
        session.commit()
    s3.create_bucket(Bucket=BUCKET)  # type: ignore[attr-defined]
    for image in sorted((ROOT / "examples").glob("*.[jp][pn]g")):
        s3.put_object(Bucket=BUCKET, Key=PREFIX + image.name, Body=image.read_bytes())  # type: ignore[attr-defined]
    s3.put_object(Bucket=BUCKET, Key=PREFIX + "notes.txt", Body=b"not an image")  # type: ignore[attr-defined]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return {**env, "KILN_API_URL": webhook_stack.url, "KILN_API_KEY": key}


def run_example(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done.stdout


def test_the_readme_shows_seven_python_examples() -> None:
    assert len(python_examples()) == 7


def test_the_readme_python_examples_run_as_written(readme_env: dict[str, str]) -> None:
    submit, estimate, bulk, retry, webhook, errors, concurrent = (
        run_example(c, readme_env) for c in python_examples()
    )

    lines = submit.splitlines()
    assert lines[0].split()[:1] in (["queued"], ["running"]), submit  # progress, as it goes
    assert any(line.endswith(" completed 2 succeeded") for line in lines), submit
    assert "'key': 'poster.png', 'status': 'succeeded', 'phash': '" in submit

    images = len(list((ROOT / "examples").glob("*.[jp][pn]g")))
    sizes = sum(p.stat().st_size for p in (ROOT / "examples").glob("*.[jp][pn]g"))
    counted, took, note = estimate.splitlines()
    assert counted == f"{images} objects, {sizes} bytes, {images} images", estimate
    # the submit example's job is the rate's measure: a time, and the note saying how
    assert re.fullmatch(r"about \d+ s", took), estimate
    assert note.startswith("Time: ") and "1 worker alive" in note, estimate

    said = bulk.splitlines()
    assert said[0] == f"{images} items, 0 failed", bulk  # notes.txt left out by the globs
    assert said[1] == f"{images} result rows", bulk
    assert re.fullmatch(r"\['[0-9a-f-]{36}'(, '[0-9a-f-]{36}')*\]", said[2]), bulk

    failed, again = retry.splitlines()
    assert failed == "[('pyproject.toml', 'failed')]", retry
    assert re.fullmatch(r"1 item again; True \['[0-9a-f-]{36}'\]", again), retry

    assert webhook.strip() == "job.completed 1 succeeded", webhook  # verified, then printed

    first, second = errors.splitlines()
    assert first == "404 There is no job no-such-job.", errors
    assert second in ("cancelling", "cancelled") or " is already completed;" in second, errors

    assert concurrent.strip() == "['completed', 'completed']"

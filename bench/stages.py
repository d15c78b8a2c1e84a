"""Per-stage CPU budget of the null-model ceiling on local storage (bench/README.md).

`python -m bench.stages [--items 1000]` starts a Kiln on local storage beside the bench stack,
uploads 4 multipart jobs of `items` small PNGs, and meanwhile samples the API and the worker
with py-spy (`--gil`: only threads running Python or holding the GIL), while psutil counts each
process's CPU. Each stage's share of a process's samples times that process's CPU per item is
the stage's budget; time spent outside the GIL (the engine's kernels, socket waits) is spread
pro rata over the sampled stages, so the table is an attribution, not a stopwatch. Postgres and
Redis are counted apart from their processes. Needs py-spy (`pip install py-spy`).
"""

from __future__ import annotations

import io
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from PIL import Image

from bench.measure import Meter, service_groups
from bench.models import labels, null_model
from bench.stack import Layout, Registered, Stack, kiln_stack, local_deployment

# Stage → the functions whose samples belong to it (first match from the top of a stack).
WORKER_STAGES = {
    "lease": ("take_chunk", "lease_chunk", "Leases"),  # `lease_chunk`: its name before issue 31
    "fetch": ("_fetch",),
    "decode": ("prepare",),
    # `Batcher._gather`: the cut's name before issue 31
    "batch hand-off": ("Announcement.submit", "Intake.cut", "Batcher._gather", "_worth_waking"),
    "engine": ("Batcher._execute",),
    "outputs": ("_collect",),
    "shard": ("write_shard",),
    "result write": ("upsert_results",),
    # `close_if_done`, `ensure_manifest`: the close's stages before issue 39 (one `close_job` now)
    "close + manifest": ("close_after_chunk", "close_job", "close_if_done", "ensure_manifest"),
    "finish (other)": ("write_chunk", "finish_chunk"),  # `finish_chunk`: before issue 31
}
API_STAGES = {
    "upload (multipart)": ("_read_multipart",),
    "store uploads": ("_store_uploads", "_store_inputs"),  # `_store_inputs`: before issue 15
    "insert job + items": (
        "_insert_job",
        "check_open_jobs",
        "_check_request",
        "Session.flush",
        "Session.commit",
    ),
    "enqueue": ("dispatch_job",),
    "auth + rate limit": ("get_tenant",),
    "polls (GET job)": ("get_job",),
}


def attribute(raw: Path, stages: dict[str, tuple[str, ...]]) -> Counter[str]:
    """Samples per stage from py-spy's raw (collapsed) output."""
    shares: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";")]
        shares[_stage(frames, stages)] += int(count)
    return shares


def _stage(frames: list[str], stages: dict[str, tuple[str, ...]]) -> str:
    for frame in reversed(frames):  # innermost first: `upsert_results` inside `write_chunk`
        for stage, names in stages.items():
            if any(frame == n or frame.endswith("." + n) for n in names):
                return stage
    return "other (framework, broker, threads)"


def _pngs(count: int, side: int) -> list[bytes]:
    out = []
    for i in range(count):
        buffer = io.BytesIO()
        Image.new("RGB", (side, side), (i % 256, i * 7 % 256, i * 13 % 256)).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


def _post(stack: Stack, tag: str, pngs: list[bytes]) -> str:
    files = [("files", (f"{tag}-{i}.png", data, "image/png")) for i, data in enumerate(pngs)]
    response = stack.http.post("/v1/jobs", data={"model": "null"}, files=files, timeout=600)
    if response.status_code != 202:
        raise RuntimeError(f"submit failed: {response.status_code} {response.text}")
    return str(response.json()["id"])


def _spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    args = [exe, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--gil"]
    return subprocess.Popen(
        [*args, "--nonblocking", "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main(items: Annotated[int, typer.Option(help="PNGs per job (4 jobs).")] = 1000) -> None:
    work = Path(tempfile.mkdtemp(prefix="kiln-stages-"))
    (work / "logs").mkdir()
    pngs = _pngs(items, 32)
    model = Registered("null", null_model(work / "null.onnx", 32), 32, labels(3))
    env = {"KILN_CONTENT_CACHE": "false"}
    with kiln_stack(work / "logs", env) as parent:
        layout = Layout(name="stages", storage="local")
        with local_deployment(parent, work / "logs", env, layout) as stack:
            stack.register(model, work)
            stack.wait(_post(stack, "warm", pngs[:64]))
            spies = [_spy(stack.api.pid, work / "api.txt"), _spy(stack.worker.pid, work / "w.txt")]
            time.sleep(1)
            groups: dict[str, Sequence[int]] = {
                "api": [stack.api.pid],
                "worker": [stack.worker.pid],
                **service_groups(),
            }
            with Meter(groups).window() as usage:
                for job_id in [_post(stack, f"j{j}", pngs) for j in range(4)]:
                    stack.wait(job_id, interval=0.1)
            for spy in spies:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
    total = 4 * items
    print(f"{total} items in {usage.seconds:.2f} s: {total / usage.seconds:.0f} items/s\n")
    print("| process | stage | ms per item |\n|---|---|---|")
    processes = (("api", "api.txt", API_STAGES), ("worker", "w.txt", WORKER_STAGES))
    for process, raw, stages in processes:
        ms = 1000 * usage.cpu_seconds[process] / total
        shares = attribute(work / raw, stages)
        sampled = sum(shares.values()) or 1
        for stage, samples in shares.most_common():
            print(f"| {process} | {stage} | {ms * samples / sampled:.3f} |")
        print(f"| {process} | **all** | **{ms:.3f}** |")
    for service in ("postgres", "redis"):
        print(f"| {service} | all | {1000 * usage.cpu_seconds[service] / total:.3f} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    typer.run(main)

"""How close an estimate before running comes to the run (issue 40: within ±30% for 5,000
images and for a mixed prefix with videos).

    python -m bench.estimate                         # 5,000 images; 1,000 images + 12 videos
    python -m bench.estimate --images 1000 --measure 300 --mixed-images 300 --videos 4

A fresh `kiln api` and `kiln worker` with Kiln's shipped chunking and concurrency on real
Postgres, Redis and moto's S3 server (bench/stack.py), the content cache off (a run must run,
not look up). First two small bulk jobs measure the fleet's rate for phash (images; videos,
for a frame's cost); then each prefix is estimated (`POST /v1/jobs/estimate`), run as a bulk
job, and the estimate's seconds compared with the job's own (submission to close). One JSON
line per case: the estimate, the run, and the error in % of the run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import av
import numpy as np
import typer

from bench.stack import SOURCE_BUCKET, Stack, kiln_stack
from devstack.images import photo

MODEL = "phash"


def main(
    images: Annotated[int, typer.Option(help="Images of the images-only prefix.")] = 5000,
    measure: Annotated[int, typer.Option(help="Images of the job that measures the rate.")] = 2000,
    mixed_images: Annotated[int, typer.Option(help="Images of the mixed prefix.")] = 1000,
    videos: Annotated[int, typer.Option(help="Videos of the mixed prefix (20–60 s).")] = 12,
    video_fps: Annotated[float, typer.Option(help="The mixed job's video_fps.")] = 2.0,
) -> None:
    """Print one JSON line per case."""
    logs = Path(tempfile.mkdtemp(prefix="kiln-bench-estimate-"))
    with kiln_stack(logs, {"KILN_CONTENT_CACHE": "false"}) as stack:
        put_images(stack, "measure/", measure, seed=1)
        measured, _ = run(stack, body("measure/"))
        print(json.dumps({"case": "measure", "images": measure, "run_s": measured}), flush=True)

        put_images(stack, "images/", images, seed=2)
        print(json.dumps({"case": "images", **compare(stack, body("images/"))}), flush=True)

        put_videos(stack, "measure-v/", 3, logs, first=100)
        measured, frames = run(stack, body("measure-v/", video_fps=video_fps))
        print(
            json.dumps({"case": "measure-videos", "frames": frames, "run_s": measured}), flush=True
        )

        put_images(stack, "mixed/", mixed_images, seed=3)
        put_videos(stack, "mixed/v/", videos, logs)
        mixed = compare(stack, body("mixed/", video_fps=video_fps))
        print(json.dumps({"case": "mixed", "video_fps": video_fps, **mixed}), flush=True)


def body(prefix: str, **more: Any) -> dict[str, Any]:
    return {"model": MODEL, "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}"}, **more}


def compare(stack: Stack, job: dict[str, Any]) -> dict[str, Any]:
    """The estimate (and how long it took to make), the run, and the error."""
    started = time.monotonic()
    response = stack.http.post("/v1/jobs/estimate", json=job)
    response.raise_for_status()
    found = response.json()
    asked_s = time.monotonic() - started
    ran, total = run(stack, job)
    error = None if found["seconds"] is None else 100 * (found["seconds"] - ran) / ran
    return {
        "objects": found["objects"],
        "items_estimated": found["items"],
        "items_run": total,
        "estimate_s": found["seconds"],
        "run_s": round(ran, 2),
        "error_pct": None if error is None else round(error, 1),
        "estimate_took_s": round(asked_s, 2),
        "rate_per_s": found["rate_per_s"],
        "note": found["note"],
    }


def run(stack: Stack, job: dict[str, Any]) -> tuple[float, int]:
    """Seconds from submission to close of a completed bulk job, and its items."""
    response = stack.http.post("/v1/jobs", json=job)
    if response.status_code != 202:
        raise RuntimeError(f"submit failed: {response.status_code} {response.text}")
    closed = stack.wait(response.json()["id"])
    if closed["status"] != "completed":
        raise RuntimeError(f"the job ended {closed['status']}: {closed.get('error')}")
    took = datetime.fromisoformat(closed["finished_at"]) - datetime.fromisoformat(
        closed["created_at"]
    )
    return took.total_seconds(), int(closed["counts"]["total"])


def put_images(stack: Stack, prefix: str, count: int, seed: int) -> None:
    def put(i: int) -> None:
        data = photo(seed * 1_000_000 + i, (96, 72))
        stack.s3.put_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}d{i % 10}/{i:06d}.jpg", Body=data)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(count)))


def put_videos(stack: Stack, prefix: str, count: int, workdir: Path, first: int = 0) -> None:
    """`count` H.264 MP4s of 20–60 s at 10 fps, 160×120 grey levels (quick to make)."""
    for i in range(first, first + count):
        path = workdir / f"clip-{i}.mp4"
        seconds = 20 + (i * 37) % 41
        _encode(path, seconds * 10, i)
        stack.s3.put_object(
            Bucket=SOURCE_BUCKET, Key=f"{prefix}{path.name}", Body=path.read_bytes()
        )


def _encode(path: Path, frames: int, seed: int) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        for n in range(frames):
            level = (seed * 31 + 7 * n) % 256
            pixels = np.full((120, 160, 3), level, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


if __name__ == "__main__":
    os.environ.setdefault("KILN_LOG_LEVEL", "WARNING")
    typer.run(main)

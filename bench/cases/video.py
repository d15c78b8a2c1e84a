"""The `video` case (bench/video.py): its rows for the runner, and the peer's entry point in a
fresh interpreter (`python -m bench.child video ARGS OUT`)."""

from __future__ import annotations

from typing import Any

from bench.results import CaseResult
from bench.video import Row, make_clips, peer, rows, run_kiln, run_peer

__all__ = ["Row", "make_clips", "measure", "rows", "run_kiln", "run_peer"]


def measure(args: dict[str, Any]) -> CaseResult:
    return peer(args)

"""`bench.stages`: py-spy samples attributed to stages, innermost matching frame first."""

from __future__ import annotations

from pathlib import Path

from bench.stages import WORKER_STAGES, attribute


def test_samples_go_to_the_innermost_stage(tmp_path: Path) -> None:
    raw = tmp_path / "worker.txt"
    raw.write_text(
        "process_chunk (run.py:1);write_chunk (write.py:2);upsert_results (queries.py:3) 5\n"
        "process_chunk (run.py:1);write_chunk (write.py:2) 2\n"
        "process_chunk (run.py:1);_feed (run.py:4);ImageModelPredictor.prepare (m.py:5) 3\n"
        "Thread.run (threading.py:9) 1\n"
    )
    shares = attribute(raw, WORKER_STAGES)
    assert shares == {
        "result write": 5,
        "finish (other)": 2,
        "decode": 3,
        "other (framework, broker, threads)": 1,
    }

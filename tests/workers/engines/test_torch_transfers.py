"""Each runner thread's staging buffers and transfers (`torch_transfers`), on the CPU: buffers
are reused and grown, a feed gathered into one is read in place, outputs come back as copies
of their first rows, `prepare` runs before the upload, and every thread has its own buffers.

torch runs in a child process (as in test_torch_engine): this process stays torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import run_torch_child

CHILD = """
import sys
from tests.workers.engines.test_torch_transfers import run_torch
run_torch(sys.argv[1])
"""


def run_torch(where: str) -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch

    from kiln.workers.engines.torch_transfers import Transfers

    transfers = Transfers(torch, torch.device("cpu"))
    report: dict[str, Any] = {}

    staging = transfers.staging()
    first = staging.take("x", (4, 3), torch.float32)
    smaller = staging.take("x", (2, 3), torch.uint8)
    grown = staging.take("x", (8, 3), torch.float32)
    report["staging"] = {
        "same_thread": transfers.staging() is staging,
        "reused": smaller.data_ptr() == first.data_ptr(),
        "grown": list(grown.shape),
        "dtype": str(smaller.dtype),
        "scalar": list(staging.take("s", (), torch.int64).shape),
    }

    feed = np.arange(12, dtype=np.uint8).reshape(4, 3)
    buffer = staging.take("in", feed.shape, torch.uint8).numpy()
    buffer[:] = feed
    read_only = feed.copy()
    read_only.flags.writeable = False
    copied = transfers.held("in", read_only)
    report["held"] = {
        "in_place": transfers.held("in", buffer).data_ptr() == buffer.ctypes.data,
        "copied": copied.numpy().tolist() == feed.tolist(),
    }

    values = [torch.arange(10, dtype=torch.float32).reshape(5, 2)]
    out = transfers.to_host(["y"], values, 3)
    again = transfers.to_host(["y"], [values[0] * 0], 3)
    report["to_host"] = {
        "first": out["y"].tolist(),
        "kept": out["y"].tolist() != again["y"].tolist(),
    }

    pixels = np.full((2, 2, 2, 3), 10, dtype=np.uint8)
    ready = transfers.uploaded(
        ["images", "mask"],
        {"mask": np.ones((2, 4), np.int64), "images": pixels},
        {"images": lambda xp, x: x.astype(xp.float32) / 10},
    )
    report["uploaded"] = [[str(t.dtype), float(t.float().mean())] for t in ready]

    with transfers.on_stream(), transfers.on_device():
        report["cpu_default"] = str(torch.empty(1).device)

    both = threading.Barrier(2)  # two threads at once, not one thread twice

    def own(_: int) -> Any:
        both.wait(timeout=10)
        return transfers.staging()

    with ThreadPoolExecutor(2) as pool:
        seen = list(pool.map(own, range(2)))
    report["threads"] = seen[0] is not seen[1] and staging not in seen
    (Path(where) / "report.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("torch-transfers")
    run_torch_child(CHILD, folder)
    found: dict[str, Any] = json.loads((folder / "report.json").read_text())
    return found


def test_a_threads_buffers_are_reused_and_grown(report: dict[str, Any]) -> None:
    assert report["staging"] == {
        "same_thread": True,
        "reused": True,
        "grown": [8, 3],
        "dtype": "torch.uint8",
        "scalar": [],
    }


def test_a_feed_gathered_into_the_buffer_is_read_in_place(report: dict[str, Any]) -> None:
    assert report["held"] == {"in_place": True, "copied": True}


def test_outputs_come_back_as_copies_of_their_first_rows(report: dict[str, Any]) -> None:
    assert report["to_host"] == {"first": [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], "kept": True}


def test_prepare_runs_before_the_upload_in_the_names_order(report: dict[str, Any]) -> None:
    assert report["uploaded"] == [["torch.float32", 1.0], ["torch.int64", 1.0]]


def test_on_the_cpu_streams_change_nothing(report: dict[str, Any]) -> None:
    assert report["cpu_default"] == "cpu"


def test_each_runner_thread_has_its_own_buffers(report: dict[str, Any]) -> None:
    assert report["threads"]

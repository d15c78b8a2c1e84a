"""A loaded model's batch under `max_batch=auto` (`runners/sizing.py`): its GPU engine's sweep
is read by the rule for what feeds it — the knee for Batcher runners, `for_device_stages` for
the device stages (`engines/batch_size.py`, tested on tables there)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kiln.workers.runners import sizing


class Predictor:
    max_batch = 256

    def __init__(self, in_flight: int | None) -> None:
        if in_flight is not None:
            self.in_flight = in_flight  # a predictor without it is not staged at all


@pytest.mark.parametrize(("in_flight", "staged"), [(13, True), (0, False), (None, False)])
def test_the_sweep_is_read_for_what_feeds_the_engine(
    monkeypatch: pytest.MonkeyPatch, in_flight: int | None, staged: bool
) -> None:
    asked: list[dict[str, Any]] = []

    def choose(engine: Any, cap: int, name: str = "", **options: Any) -> int:
        asked.append({"cap": cap, **options})
        return 64

    monkeypatch.setattr(sizing, "choose_batch", choose)
    settings = SimpleNamespace(max_batch="auto", model_cache_dir=None)  # nothing kept
    engine = SimpleNamespace(backend="torch:cuda")
    engines = SimpleNamespace(built=[SimpleNamespace(engine=engine)], host=SimpleNamespace(gpus=()))
    info = SimpleNamespace(ref="resnet@1", cache_key="abc")
    chosen = sizing.batch_size(settings, info, Predictor(in_flight), engines)  # type: ignore[arg-type]
    assert chosen == 64
    assert asked == [{"cap": 256, "staged": staged}]

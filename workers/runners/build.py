"""The one place a model's Batcher is built: the shared `queued_policy` (batching/policy.py)
plus the worker's deadline (per model, `KILN_BATCH_DEADLINES`) and out-of-memory recovery; a
predictor's inner Batchers (OCR's lines) take the shared policy as it is."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kiln.app.core.config import Settings
from kiln.app.observability.tracing import traced_infer
from kiln.workers.batching.batcher import Batcher
from kiln.workers.batching.blocks import Part
from kiln.workers.batching.policy import queued_policy
from kiln.workers.batching.watchdog import Wedged
from kiln.workers.models.base import Answers, AnswersShape, Predictor, Rows, StagedPixels
from kiln.workers.prep.slots import SlotPool
from kiln.workers.runners.gather import gather


def model_batcher(
    settings: Settings,
    ref: str,
    name: str,
    predictor: Predictor,
    max_batch: int,
    runners: int,
    slots: SlotPool | None,
    on_wedged: Wedged,
) -> Batcher[Rows, Answers]:
    """The Batcher of the model `ref` (catalog `name`): each batch gathered from the blocks
    it was cut from (pixels out of `slots`, into the engine's staging where the predictor has
    one) and run through `predictor.infer` in a traced span; `on_wedged` hears of a batch
    stuck past the model's deadline and of its recovery."""
    deadlines = settings.batch_deadlines
    policy = replace(
        queued_policy(settings, max_batch, runners),
        deadline_s=deadlines.get(ref, deadlines.get(name, settings.batch_deadline_s)),
        oom_recovery_s=settings.oom_recovery_s,
    )
    infer = traced_infer(predictor.infer, model=ref, backend=predictor.backend)
    into = predictor.pixel_buffer if isinstance(predictor, StagedPixels) else None

    def run(parts: Sequence[Part[Rows]]) -> Answers:
        return infer(gather(parts, slots, into))

    return Batcher(run, AnswersShape(), policy, name=f"batcher-{ref}", on_wedged=on_wedged)

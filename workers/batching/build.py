"""The one place a model's Batcher is built, and the batching every model's Batchers share.

Every model's Batcher is greedy (chunks announce their rows, see `workers/chunk`) and lets
rows queue at most QUEUED_BATCHES batches per runner ahead of the engine: object rows (OCR
pages) are big, and rows queued further ahead only hold memory and slots. A model's own
Batcher also has the worker's deadline (per model, `KILN_BATCH_DEADLINES`) and out-of-memory
recovery; a pipeline's inner Batchers (OCR's lines) take the shared policy as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kiln.app.core.config import Settings
from kiln.app.observability.tracing import traced_infer
from kiln.workers.batching.batcher import Batcher
from kiln.workers.batching.blocks import Part
from kiln.workers.batching.gather import gather
from kiln.workers.batching.policy import BatchPolicy
from kiln.workers.batching.watchdog import Wedged
from kiln.workers.models.base import Answers, AnswersShape, Pipeline, Rows, StagedPixels
from kiln.workers.prep.slots import SlotPool

QUEUED_BATCHES = 4  # rows may run this many batches ahead of the engine (per runner)


def queued_policy(settings: Settings, max_batch: int, runners: int) -> BatchPolicy:
    """Batches of `max_batch` rows, or fewer after the worker's `max_delay_s`, run by
    `runners` threads; greedy, and bounded at QUEUED_BATCHES batches per runner."""
    return BatchPolicy(
        max_batch=max_batch,
        max_delay_s=settings.max_delay_s,
        runners=runners,
        greedy=True,
        max_queued=QUEUED_BATCHES * max_batch * runners,
    )


def model_batcher(
    settings: Settings,
    ref: str,
    name: str,
    pipeline: Pipeline,
    max_batch: int,
    runners: int,
    slots: SlotPool | None,
    on_wedged: Wedged,
) -> Batcher[Rows, Answers]:
    """The Batcher of the model `ref` (catalog `name`): each batch gathered from the blocks
    it was cut from (pixels out of `slots`, into the engine's staging where the pipeline has
    one) and run through `pipeline.infer` in a traced span; `on_wedged` hears of a batch
    stuck past the model's deadline and of its recovery."""
    deadlines = settings.batch_deadlines
    policy = replace(
        queued_policy(settings, max_batch, runners),
        deadline_s=deadlines.get(ref, deadlines.get(name, settings.batch_deadline_s)),
        oom_recovery_s=settings.oom_recovery_s,
    )
    infer = traced_infer(pipeline.infer, model=ref, backend=pipeline.backend)
    into = pipeline.pixel_buffer if isinstance(pipeline, StagedPixels) else None

    def run(parts: Sequence[Part[Rows]]) -> Answers:
        return infer(gather(parts, slots, into))

    return Batcher(run, AnswersShape(), policy, name=f"batcher-{ref}", on_wedged=on_wedged)

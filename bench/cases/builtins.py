"""One line per built-in model: items/s of each through the services stack (HTTP API + worker).

Inputs fit the model: photos for the detector, the embedder and phash, rendered words for OCR,
sentences for text-embed. The classifier's line is the `services` case (ResNet-18). A short
warm-up job on other inputs loads each model first, so the line is steady-state throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.cases.services import mean_batch, meter
from bench.context import Context
from bench.inputs import make_word_images, sentences
from bench.results import CaseResult
from bench.stack import Registered, Stack

WARM_UP = 4


def run(ctx: Context) -> list[CaseResult]:
    stack = ctx.require_stack()
    count = ctx.plan.builtin_items
    photos = ctx.uris["images"][: count + WARM_UP]
    words = stack.upload("words", make_word_images(ctx.workdir / "words", count + WARM_UP))
    texts = [{"text": s} for s in sentences(count + WARM_UP)]
    embedder = _register_embedder(ctx, stack)
    inputs: dict[str, list[dict[str, Any]]] = {
        "detector": [{"uri": u} for u in photos],
        "ocr": [{"uri": u} for u in words],
        "text-embed": texts,
        "phash": [{"uri": u} for u in photos],
        embedder: [{"uri": u} for u in photos],
    }
    return [_measure(stack, model, batch) for model, batch in inputs.items()]


def _register_embedder(ctx: Context, stack: Stack) -> str:
    """ResNet-18's 1000 logits stand in for an image embedder (the `embed` kind's code path)."""
    resnet = ctx.models.get("resnet18") or next(iter(ctx.models.values()))
    name = f"{resnet.name}-embed"
    stack.register(Registered(name, resnet.onnx, resnet.input_size, []), ctx.workdir, kind="embed")
    return name


def _measure(stack: Stack, model: str, inputs: Sequence[dict[str, Any]]) -> CaseResult:
    warm, timed = list(inputs[:WARM_UP]), list(inputs[WARM_UP:])
    _check(stack.wait(stack.submit_inputs(model, warm)), model, len(warm))
    before = stack.batch_stats()
    with meter(stack).window() as usage:
        job = stack.wait(stack.submit_inputs(model, timed))
    _check(job, model, len(timed))
    extra = {"mean_batch": mean_batch(before, stack.batch_stats(), model)}
    return CaseResult.from_usage("builtin", model, len(timed), usage, extra=extra)


def _check(job: dict[str, Any], model: str, expected: int) -> None:
    if job["status"] != "completed" or job["counts"]["succeeded"] != expected:
        raise RuntimeError(f"{model}: job ended {job['status']} with {job['counts']}")

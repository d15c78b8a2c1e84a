"""How big a loaded model's batches are, and how many of its rows may be in flight.

Pure decisions over what the load found (the predictor, the engines built, the prep processes):
the batch a model runs at, and the lender that bounds its rows between prep and the engine —
shared-memory slots for pixel families, tickets for rows that travel as objects.
"""

from __future__ import annotations

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.config import Settings
from kiln.workers.batching import QUEUED_BATCHES
from kiln.workers.engines import batch_size as rule
from kiln.workers.engines.base import Engine
from kiln.workers.engines.batch_size import choose_batch
from kiln.workers.engines.learned import Learned, LearnedKey, device_key, source_digest
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.base import Predictor, Staged
from kiln.workers.prep.slots import BYTE_SLOT, ByteSlots, Lender, SlotPool, shm_free
from kiln.workers.prep.units import UNIT_ROWS

# Engine backend names (Engine.backend) that run on the GPU.
GPU_BACKENDS = ("tensorrt", "onnxruntime:CUDA", "torch:cuda", "standin:")  # stand-in: benches
SLOT_BYTES = 512 * 2**20  # shared memory for one model's slots, at most (if a batch fits)


def batch_size(
    settings: Settings, info: ModelInfo, predictor: Predictor, engines: EngineFactory
) -> int:
    """The model's batch: as configured, or under `auto` from a short sweep of its GPU engine
    (16 on a CPU): the knee, or for the device stages the largest batch that costs
    the GPU nothing in rows per second (`batch_size.for_device_stages`) — swept once per model,
    backend, device and cap, then kept (`learned_batch`); never above what the engine was
    built for."""
    cap = predictor.max_batch
    if settings.max_batch != "auto":
        return min(settings.max_batch, cap)
    gpu = [b.engine for b in engines.built if b.engine.backend.startswith(GPU_BACKENDS)]
    if len(engines.built) != 1 or not gpu:  # a CPU engine, or several (OCR's own sizes)
        return min(settings.batch_cap(on_gpu=bool(gpu)), cap)
    staged = isinstance(predictor, Staged) and bool(predictor.in_flight)
    return learned_batch(settings, info, gpu[0], cap, engines, staged=staged)


def learned_batch(
    settings: Settings,
    info: ModelInfo,
    engine: Engine,
    cap: int,
    engines: EngineFactory,
    **options: bool,
) -> int:
    """`choose_batch`'s answer as a previous load on this model version, backend, device and
    cap measured it (the rule's source and `options` are in the key too); swept and kept on
    a miss."""
    key = LearnedKey(
        "max_batch",
        f"{info.ref}@{info.cache_key}",
        engine.backend,
        device_key(engines.host.gpus[0] if engines.host.gpus else None),
        {"cap": cap, "rule": source_digest(rule.__file__), **options},
    )
    learned = Learned(settings.model_cache_dir)
    chosen = learned.remember(
        key,
        lambda: choose_batch(engine, cap, name=info.ref, **options),
        valid=lambda kept: type(kept) is int and 1 <= kept <= cap,
    )
    assert isinstance(chosen, int)
    return chosen


def batch_runners(engine_runners: int, predictor: Predictor) -> int:
    """The model's Batcher threads: one per engine runner, or for the device stages
    (`workers/device/`) as many batches as its stages and queues hold, so every stage has
    work while the others do theirs (each thread waits on its batch's trip)."""
    runners = min(engine_runners, predictor.max_runners)
    if isinstance(predictor, Staged) and predictor.in_flight:
        return max(runners, predictor.in_flight)
    return runners


def lender(
    info: ModelInfo, predictor: Predictor, max_batch: int, runners: int, prep_processes: int
) -> Lender:
    """What bounds the model's rows in prep and queued: enough for the batches queued and
    running and a unit or two per prep process. Slot families get shared-memory slots, and
    families whose rows are encoded files byte slots (`ByteSlots`), within SLOT_BYTES and what
    /dev/shm has free (never fewer than a batch and a unit); other object families get as many
    tickets, with one unit per prep process (their rows — OCR pages — can be large)."""
    prep = max(1, prep_processes)
    least = max_batch + UNIT_ROWS
    queued = QUEUED_BATCHES * max_batch * runners
    layout = predictor.prep.layout
    if layout is None and not predictor.prep.byte_slots:
        return Lender(max(least, queued + UNIT_ROWS * prep))
    room = min(SLOT_BYTES, shm_free() // 2) // max(1, layout.nbytes if layout else BYTE_SLOT)
    count = max(least, min(queued + 2 * UNIT_ROWS * prep, room))
    if layout is None:  # encoded files (the GPU decodes them): byte slots, read in place
        return ByteSlots(count, label=info.name)
    return SlotPool(layout, count, label=info.name)


def on_gpu(backend: str) -> bool:
    """Whether a predictor's backend (one name, or several joined by commas) runs on a GPU."""
    return any(part.strip().startswith(GPU_BACKENDS) for part in backend.split(","))

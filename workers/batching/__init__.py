"""Batching: blocks of rows from many callers gathered into micro-batches for one engine.

Generic at its core: it knows nothing of Celery, images or ONNX. Callers `submit` a *block*
(a unit's rows: slots of decoded images, token ids, strips) and get one `Future` per block;
runner threads cut a batch at the cap — from as many blocks as it takes, splitting a block
across batches — or `max_delay_s` after its first row, and run the batch function over the
`Part`s (rows [start, stop) of a block) it took. No row ever needs a future of its own.

The room, one module per thing:
- `policy`: `BatchPolicy`, a Batcher's knobs (batch, delay, runners, greedy, queue bound,
  deadline, out-of-memory recovery);
- `blocks`: `Part`, the `Shape` that cuts and joins results, a queued block and its answer;
- `intake`: the queue callers submit to and runners cut from, on one condition (no polling);
  `Announcement`s of rows to come (`greedy`), and withdrawing them on a cancel;
- `batcher`: `Batcher`, the runner threads, bisecting a failed batch down to its bad row;
- `oom`: telling an out-of-memory failure apart, and the batch cap it lowers and regrows;
- `watchdog`: failing a batch stuck past its deadline and replacing its runner;
- `stats`: the running totals metrics read;
- `errors`: what a block's future fails with besides the batch function's errors.

A model's Batcher — its batch gathered out of the slots, the one place it is built — is model
glue, so it lives with the runners (`workers/runners/gather.py`, `build.py`); the policy its
Batchers share (`queued_policy`, QUEUED_BATCHES) is here, in `policy`.
"""

from kiln.workers.batching.batcher import Batcher
from kiln.workers.batching.blocks import BatchFn, ListShape, Part, Shape
from kiln.workers.batching.errors import BatchDeadlineError, BatcherClosedError, WithdrawnError
from kiln.workers.batching.intake import Announcement
from kiln.workers.batching.oom import is_out_of_memory
from kiln.workers.batching.policy import QUEUED_BATCHES, BatchPolicy, queued_policy
from kiln.workers.batching.stats import SECONDS_BOUNDS, BatchStats, seconds_bound

__all__ = [
    "QUEUED_BATCHES",
    "SECONDS_BOUNDS",
    "Announcement",
    "BatchDeadlineError",
    "BatchFn",
    "BatchPolicy",
    "BatchStats",
    "Batcher",
    "BatcherClosedError",
    "ListShape",
    "Part",
    "Shape",
    "WithdrawnError",
    "is_out_of_memory",
    "queued_policy",
    "seconds_bound",
]

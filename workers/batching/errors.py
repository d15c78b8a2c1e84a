"""What a block's future may fail with beyond its batch function's own errors."""

from __future__ import annotations

from kiln.app.core.errors import TransientError


class BatcherClosedError(TransientError):
    """Raised by `submit` after `close()`: the worker is shutting down or unloaded the model;
    the chunk runs again (here, once the model is loaded again, or on another worker)."""


class BatchDeadlineError(TransientError):
    """The block's batch ran past its deadline: the engine is stuck; another run may succeed."""


class WithdrawnError(Exception):
    """The answer of rows their caller took back before any batch took them (a cancel)."""

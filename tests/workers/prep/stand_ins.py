"""Preps for the pool's tests, run by real prep processes (named by `module:callable`)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from kiln.app.core.errors import InputError


class TextPrep:
    """Texts as objects; `CRASH…` aborts the process (a decoder that dies on a hostile
    file), `HANG…` never returns, `BAD…` is an input error."""

    def __init__(self, **_options: Any) -> None:
        pass

    def prepare(self, data: bytes | str, slot: np.ndarray | None, meta: np.ndarray) -> Any:
        text = data.decode() if isinstance(data, bytes) else data
        if text.startswith("CRASH"):
            os.abort()
        if text.startswith("HANG"):
            time.sleep(3600)
        if text.startswith("BAD"):
            raise InputError("That input is bad.")
        if slot is not None:
            slot[...] = len(text)
            meta[0] = len(text)
            return None
        return text.upper()

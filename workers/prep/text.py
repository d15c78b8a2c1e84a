"""The prep half of the built-in text embedder: tokens, by the export's own tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.app.core.errors import InputError


class TextPrep:
    def __init__(self, tokenizer: str, max_length: int) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer)
        # tokenizer.json pads and cuts at 128; sentence-transformers cuts at max_seq_length.
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=max_length)

    def prepare(self, data: bytes | str, slot: np.ndarray | None, meta: np.ndarray) -> Any:
        if not isinstance(data, str):
            raise InputError("This model takes text, not bytes; send the text itself.")
        if not data.strip():
            raise InputError("The text is empty.")
        encoding = self.tokenizer.encode(data)
        if all(encoding.special_tokens_mask):
            raise InputError("The text has no characters the model can read.")
        return (
            np.asarray(encoding.ids, dtype=np.int64),
            np.asarray(encoding.type_ids, dtype=np.int64),
        )

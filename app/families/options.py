"""The base of every family's options: strict (no coercion), closed (unknown keys refused)."""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # Per option, what it must be, in place of pydantic's message (which names no unit).
    hints: ClassVar[dict[str, str]] = {}

    @classmethod
    def stored(cls, raw: dict[str, Any]) -> Self:
        """A job's stored options (checked at submission); keys jobs stored before a family
        declared its options are ignored rather than failing the job's close."""
        return cls.model_validate({k: v for k, v in raw.items() if k in cls.model_fields})

    @classmethod
    def describe(cls) -> str:
        names = ", ".join(repr(name) for name in cls.model_fields)
        return f"its options are {names}" if names else "it takes no options"

    @classmethod
    def explain(cls, key: str, message: str) -> str:
        return cls.hints.get(key) or message.replace("Input should be", "must be", 1)


class NoOptions(Options):
    """A family with no job options yet."""

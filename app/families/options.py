"""The base of every family's options: strict (no coercion), closed (unknown keys refused).

Every family takes `fallback` (`fallback.FallbackOptions`) besides its own options.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict

from kiln.app.families.fallback import HINTS as FALLBACK_HINTS
from kiln.app.families.fallback import FallbackOptions


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    fallback: FallbackOptions | None = None  # every family's; absent: no fallback

    # Per option, what it must be, in place of pydantic's message (which names no unit).
    hints: ClassVar[dict[str, str]] = {}

    @classmethod
    def stored(cls, raw: dict[str, Any]) -> Self:
        """A job's stored options (checked at submission); keys jobs stored before a family
        declared its options are ignored rather than failing the job's close."""
        return cls.model_validate({k: v for k, v in raw.items() if k in cls.model_fields})

    @classmethod
    def describe(cls) -> str:
        """The family's own options first, then the one every family takes."""
        names = [name for name in cls.model_fields if name != "fallback"] + ["fallback"]
        if len(names) == 1:
            return "its only option is 'fallback'"
        return "its options are " + ", ".join(repr(name) for name in names)

    @classmethod
    def explain(cls, key: str, message: str) -> str:
        hint = {**FALLBACK_HINTS, **cls.hints}.get(key)
        return hint or message.replace("Input should be", "must be", 1)


class NoOptions(Options):
    """A family with no options of its own."""

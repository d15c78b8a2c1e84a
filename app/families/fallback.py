"""The `fallback` job option every family takes: a second model for the inputs the job's model
failed or refused, so no input is left without an answer.

Only its shape is checked here; which models may pair up (the tenant can use it, it is not the
job's model, it takes the same inputs) is checked against the catalog by
`kiln.app.catalog.fallback`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

# What sends an input to the fallback: the model failed it (for a reason other than a transient
# fault: those retry the whole chunk), or answered "no answer" (a refusal a model declares, e.g.
# a classifier below its confidence floor).
Trigger = Literal["failed", "refused"]
FAILED: Trigger = "failed"
REFUSED: Trigger = "refused"

# An error type whose message is already the whole sentence (`kiln.app.families._sentence`).
SENTENCE = "kiln_sentence"

HINTS: dict[str, str] = {
    "fallback": 'must be an object such as {"model": "ocr", "on": ["failed"]}',
    "fallback.model": "must be a model name, NAME or NAME:VERSION",
    "fallback.on": (
        'must be a list of "failed" (the model failed the input) and "refused" (the model '
        'declined to answer it); the default is ["failed"]'
    ),
}


class FallbackOptions(BaseModel):
    # Strict and closed, as every family's options are (`options.Options`).
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str = Field(min_length=1, max_length=128)
    on: list[Trigger] = Field(default_factory=lambda: [FAILED], min_length=1)

    hints: ClassVar[dict[str, str]] = HINTS

    @model_validator(mode="before")
    @classmethod
    def _no_chain(cls, data: Any) -> Any:
        if isinstance(data, dict) and "fallback" in data:
            raise PydanticCustomError(
                SENTENCE,
                "A fallback model cannot have a fallback of its own; name one fallback, "
                "without a nested 'fallback'.",
            )
        return data

"""Model families: what each kind of model takes, and the job options it declares.

A family's options are a pydantic model beside the family (`phash.PhashOptions`); a job's
`options` are checked against it when the job is submitted, so a typo or a wrong type is a 422
with a sentence, not a job that silently runs with defaults. Adding an option to a family is a
change to its options model alone: the API, the CLI and schedules pass options through. Every
family also takes `fallback` (`fallback.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from kiln.app.core.errors import InputError
from kiln.app.families.embed import EmbedOptions
from kiln.app.families.fallback import SENTENCE
from kiln.app.families.options import NoOptions, Options
from kiln.app.families.phash import PhashOptions

Input = Literal["image", "text"]


@dataclass(frozen=True)
class Family:
    kind: str
    input: Input
    options: type[Options] = NoOptions
    registrable: bool = False  # may a user register an ONNX model of this kind?
    # Its answers are vectors, comparable only with the same model's: another embedder cannot
    # be its fallback (their vectors would share a column and mean nothing side by side).
    vectors: bool = False


FAMILIES: dict[str, Family] = {
    family.kind: family
    for family in (
        Family("detect", "image", registrable=True),
        Family("ocr", "image"),
        Family("classify", "image", registrable=True),
        Family("embed", "image", EmbedOptions, registrable=True, vectors=True),
        Family("text-embed", "text", EmbedOptions, vectors=True),
        Family("phash", "image", PhashOptions),
    )
}


def check_options(kind: str, model: str, raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` checked against the family's options: the values a job stores (defaults left out,
    so a later default applies to the jobs that did not choose)."""
    declared = FAMILIES[kind].options
    try:
        return declared.model_validate(raw).model_dump(exclude_unset=True)
    except ValidationError as error:
        raise InputError(_sentence(error, declared, model)) from None


def _sentence(error: ValidationError, declared: type[Options], model: str) -> str:
    first = error.errors()[0]
    if first["type"] == SENTENCE:  # a check that words its own sentence
        return str(first["msg"])
    # A list's item is named by its list: the hint says what the list must hold.
    key = ".".join(str(part) for part in first["loc"] if not isinstance(part, int)) or "options"
    if first["type"] == "extra_forbidden":
        return f"Model {model!r} has no option {key!r}; {declared.describe()}."
    return f"Option {key!r} of model {model!r} {declared.explain(key, first['msg'])}."

"""The `fallback` option's shape, which every family takes: checked before any model is looked
up (kiln.app.catalog.fallback checks the model itself against the catalog)."""

from __future__ import annotations

import pytest

from kiln.app.core.errors import InputError
from kiln.app.families import FAMILIES, check_options
from kiln.app.families.fallback import FallbackOptions
from kiln.app.families.phash import PhashOptions


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_every_family_takes_a_fallback(kind: str) -> None:
    options = {"fallback": {"model": "ocr", "on": ["failed", "refused"]}}
    assert check_options(kind, "m", options) == options


def test_on_defaults_to_failed_and_is_not_stored() -> None:
    assert check_options("detect", "m", {"fallback": {"model": "ocr"}}) == {
        "fallback": {"model": "ocr"}
    }
    assert FallbackOptions.model_validate({"model": "ocr"}).on == ["failed"]


def test_a_familys_own_options_sit_beside_the_fallback() -> None:
    options = {"max_distance": 4, "fallback": {"model": "detector"}}
    stored = PhashOptions.stored(options)
    assert stored.max_distance == 4
    assert stored.fallback == FallbackOptions(model="detector")


@pytest.mark.parametrize("on", [["timeout"], ["failed", "never"], [], "failed", [1]])
def test_unknown_triggers_are_refused_with_the_choices(on: object) -> None:
    with pytest.raises(InputError) as error:
        check_options("classify", "c", {"fallback": {"model": "ocr", "on": on}})
    assert str(error.value) == (
        "Option 'fallback.on' of model 'c' must be a list of \"failed\" (the model failed the "
        'input) and "refused" (the model declined to answer it); the default is ["failed"].'
    )


def test_a_chain_is_refused_with_its_own_sentence() -> None:
    nested = {"model": "ocr", "fallback": {"model": "phash"}}
    with pytest.raises(InputError) as error:
        check_options("detect", "detector", {"fallback": nested})
    assert str(error.value) == (
        "A fallback model cannot have a fallback of its own; name one fallback, without a "
        "nested 'fallback'."
    )


@pytest.mark.parametrize(
    ("fallback", "sentence"),
    [
        ("ocr", "Option 'fallback' of model 'd' must be an object such as"),
        ({"on": ["failed"]}, "Option 'fallback.model' of model 'd' must be a model name"),
        ({"model": 3}, "Option 'fallback.model' of model 'd' must be a model name"),
        ({"model": "ocr", "when": "x"}, "Model 'd' has no option 'fallback.when'"),
    ],
)
def test_a_malformed_fallback_is_a_sentence(fallback: object, sentence: str) -> None:
    with pytest.raises(InputError, match=sentence):
        check_options("detect", "d", {"fallback": fallback})

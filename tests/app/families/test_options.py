"""Each family declares its job options; anything else is an InputError with a sentence."""

from __future__ import annotations

import pytest

from kiln.app.catalog.catalog import BUILTINS, REGISTRABLE_KINDS
from kiln.app.core.errors import InputError
from kiln.app.families import FAMILIES, check_options
from kiln.app.families.phash import DEFAULT_MAX_DISTANCE, MAX_DISTANCE_LIMIT, PhashOptions


def test_every_kind_is_a_family() -> None:
    assert {builtin.kind for builtin in BUILTINS.values()} | {"classify", "embed"} == set(FAMILIES)
    assert REGISTRABLE_KINDS == ("detect", "classify", "embed")
    assert {kind: f.input for kind, f in FAMILIES.items()}["text-embed"] == "text"


@pytest.mark.parametrize("value", [0, 7, MAX_DISTANCE_LIMIT])
def test_phash_takes_a_distance_in_bounds(value: int) -> None:
    assert check_options("phash", "phash", {"max_distance": value}) == {"max_distance": value}


def test_no_options_stores_none_so_the_default_applies_later() -> None:
    assert check_options("phash", "phash", {}) == {}
    assert PhashOptions.stored({}).max_distance == DEFAULT_MAX_DISTANCE


@pytest.mark.parametrize("value", [-1, MAX_DISTANCE_LIMIT + 1, "8", 8.0, True, None, [8]])
def test_phash_refuses_a_bad_distance_with_the_bounds(value: object) -> None:
    with pytest.raises(InputError) as error:
        check_options("phash", "phash", {"max_distance": value})
    assert str(error.value) == (
        "Option 'max_distance' of model 'phash' must be a whole number of bits from 0 to 16; "
        "beyond that almost every image is a near-duplicate of every other."
    )


def test_a_typo_names_the_key_and_the_options() -> None:
    with pytest.raises(InputError) as error:
        check_options("phash", "phash", {"max_distnace": 8})
    assert str(error.value) == (
        "Model 'phash' has no option 'max_distnace'; its options are 'max_distance', 'fallback'."
    )


@pytest.mark.parametrize("kind", ["detect", "ocr", "classify"])
def test_families_without_options_refuse_any(kind: str) -> None:
    assert check_options(kind, "m", {}) == {}
    with pytest.raises(InputError, match="Model 'm' has no option 'max_distance'; its only option"):
        check_options(kind, "m", {"max_distance": 4})


def test_stored_options_ignore_keys_of_older_jobs() -> None:
    assert PhashOptions.stored({"max_distance": 3, "old": 1}).max_distance == 3

"""Durations as people write them: seconds (`3600`), or a number and a unit (`30m`, `12h`,
`7d`, `2w`). Retention's settings, `expires_after` and `kiln admin tenant set --retention` read
them the same way."""

from __future__ import annotations

import re

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
_DURATION = re.compile(r"\s*(\d+)\s*([smhdw]?)\s*", re.IGNORECASE)
NONE_WORDS = {"", "none", "never", "off", "keep"}  # a setting that keeps for ever
LONGEST_S = 3650 * 86_400  # ten years: past it, "keep" says it (and a column's int32 holds it)


def parse_duration(value: int | str) -> int:
    """Seconds from `value`, or ValueError with a sentence saying what is expected."""
    if isinstance(value, bool):  # a JSON `true` is no duration
        raise ValueError(f"{value!r} is not a duration.")
    if isinstance(value, int):
        return value
    match = _DURATION.fullmatch(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not a duration: give seconds, or a number and a unit "
            '(s, m, h, d or w: "30m", "12h", "7d").'
        )
    return int(match.group(1)) * UNITS[(match.group(2) or "s").lower()]


def optional_duration(value: object) -> int | None:
    """A setting's duration: None for unset or a word that means "keep" (`none`, `never`)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in NONE_WORDS:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int | str):
        raise ValueError(f"{value!r} is not a duration.")
    return parse_duration(value)


def describe(seconds: int) -> str:
    """`604800` as `7d`, `5400` as `90m`: the largest unit up to days that divides it."""
    for unit, size in sorted(UNITS.items(), key=lambda pair: -pair[1]):
        if unit == "w":
            continue  # "7d" reads as people wrote it
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"

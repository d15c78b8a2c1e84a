"""What an estimate lists of a source: the whole prefix when it is small enough, else a sample
that says how it was drawn.

S3 lists in key order and counts nothing, so a prefix too large to list within a bound has no
known total, and its first pages are not a random sample of it (a bucket by date lists its
oldest folders first). So:

1. list the prefix flat, as the ingest does, until `max_objects` or `budget_s`: done → exact;
2. else list its sub-folders (S3's `Delimiter`), keep those the flat pages covered whole as
   counted, and list whole a random sample of the rest within the same bounds again;
   each total is then the counted part plus the sample's scaled by folders ÷ folders sampled
   (an unbiased estimate of the rest, the Horvitz–Thompson way);
3. a prefix with no sub-folders to sample (one flat folder), or whose sampled folders are each
   over the bound: its listed objects are a lower bound, and the note says so.

The S3 calls go through `Lister`, a function of (prefix, delimiter, token) to one page, so the
sampling is tested without S3.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kiln.app.core.errors import KilnError
from kiln.app.jobs.ingest import Source
from kiln.app.sources import IMAGE_SUFFIXES, VIDEO_SUFFIXES
from kiln.app.storage.s3 import translate

MAX_FOLDER_PAGES = 10  # sub-folders read before sampling: 10,000 (more are sampled from these)

# (prefix, delimiter or "", continuation token or None) → a ListObjectsV2 answer.
Lister = Callable[[str, str, str | None], dict[str, Any]]


@dataclass(frozen=True)
class Listed:
    """One object the filters let through: its key and size."""

    key: str
    size: int

    @property
    def kind(self) -> str:
        """'image' or 'video' by its name; 'unknown' where the name says neither (a worker
        judges every object by its bytes: such an object is looked into, `estimate_videos`)."""
        dot = self.key.rfind(".")
        suffix = self.key[dot:].lower() if dot > self.key.rfind("/") else ""
        if suffix in VIDEO_SUFFIXES:
            return "video"
        if suffix in IMAGE_SUFFIXES:
            return "image"
        return "unknown"


@dataclass
class Listing:
    """What was listed, and by what factor its objects stand for the prefix's: `counted` are
    known whole (weight 1), `sampled` stand for `scale` times as many (weight `scale`)."""

    counted: list[Listed] = field(default_factory=list)
    sampled: list[Listed] = field(default_factory=list)
    scale: float = 1.0
    complete: bool = True  # every object under the prefix is in `counted`
    lower_bound: bool = False  # only part listed, nothing to extrapolate from: totals are minima
    note: str = ""

    @property
    def listed(self) -> int:
        return len(self.counted) + len(self.sampled)

    def weighted(self) -> Iterator[tuple[Listed, float]]:
        """Each object listed with how many objects of the prefix it stands for."""
        for obj in self.counted:
            yield obj, 1.0
        for obj in self.sampled:
            yield obj, self.scale


@dataclass
class _Budget:
    objects: int
    deadline: float

    def spent(self, listed: int) -> bool:
        return listed >= self.objects or time.monotonic() >= self.deadline


def s3_lister(client: Any, bucket: str, uri: str) -> Lister:
    """Pages of `bucket` from a boto3 client; S3's refusals as Kiln's errors (a missing bucket
    or a denied listing is the caller's: a 4xx with a sentence naming `uri`)."""

    def page(prefix: str, delimiter: str, token: str | None) -> dict[str, Any]:
        params: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        if delimiter:
            params["Delimiter"] = delimiter
        if token:
            params["ContinuationToken"] = token
        try:
            answer: dict[str, Any] = client.list_objects_v2(**params)
        except Exception as error:  # boto's, mapped to a sentence
            translated = translate(error, uri)
            if isinstance(translated, KilnError):
                raise translated from None
            raise
        return answer

    return page


def _objects(answer: dict[str, Any], source: Source) -> list[Listed]:
    """A page's objects that the filters let through (folder markers are not objects)."""
    return [
        Listed(o["Key"], int(o.get("Size", 0)))
        for o in answer.get("Contents", [])
        if not o["Key"].endswith("/") and source.matches(o["Key"])
    ]


def _pages(lister: Lister, prefix: str, delimiter: str = "") -> Iterator[dict[str, Any]]:
    token: str | None = None
    while True:
        answer = lister(prefix, delimiter, token)
        yield answer
        token = answer.get("NextContinuationToken")
        if not answer.get("IsTruncated") or not token:
            return


def list_source(
    lister: Lister,
    source: Source,
    max_objects: int,
    budget_s: float,
    rng: random.Random | None = None,
) -> Listing:
    """The source's objects, or a sample of them that says how it was drawn (the module's
    docstring)."""
    budget = _Budget(max_objects, time.monotonic() + budget_s)
    flat: list[Listed] = []
    last_key = ""
    for answer in _pages(lister, source.prefix):
        flat.extend(_objects(answer, source))
        contents = answer.get("Contents", [])
        last_key = contents[-1]["Key"] if contents else last_key
        if not answer.get("IsTruncated"):
            return Listing(counted=flat)
        if budget.spent(len(flat)):
            break
    sampling = _Budget(max_objects, time.monotonic() + budget_s)  # the sample's own bounds
    return _sample(lister, source, flat, last_key, sampling, rng or random.Random())  # noqa: S311


def _sample(
    lister: Lister,
    source: Source,
    flat: list[Listed],
    last_key: str,
    budget: _Budget,
    rng: random.Random,
) -> Listing:
    """The flat listing stopped at `last_key`: count the folders it covered whole, sample the
    rest within `budget` (as many objects and seconds again as the flat listing had)."""
    base = source.prefix
    folders, loose, more = _folders(lister, source, base)
    while len(folders) == 1 and not loose:  # one folder ("photos/2026" → "photos/2026/"): in
        base = folders[0]
        folders, loose, more = _folders(lister, source, base)
    stopped_in = _folder_of(base, last_key)
    covered = [f for f in folders if f < stopped_in]  # key order: wholly listed before it
    counted = [o for o in flat if _folder_of(base, o.key) in covered] + loose
    rest = [f for f in folders if f >= stopped_in]
    if not rest or len(folders) < 2:
        return _lower_bound(flat, budget)
    rng.shuffle(rest)
    sampled: list[Listed] = []
    taken = 0
    for folder in rest:
        whole = _whole_folder(lister, source, folder, budget, len(sampled))
        if whole is None:
            break
        sampled.extend(whole)
        taken += 1
    if taken == 0:
        return _lower_bound(flat, budget)
    scale = len(rest) / taken
    share = f"{taken:,} of {len(rest):,}" if taken < len(rest) else f"all {taken:,}"
    note = (
        f"The prefix was too large to list whole within {budget.objects:,} objects: "
        f"{len(covered):,} sub-folders were counted whole and {share} others, chosen at "
        f"random, were listed whole; their totals are scaled by {scale:.3g}."
    )
    if more:
        note += (
            f" The prefix has over {len(folders):,} sub-folders and only those were read: the "
            "totals are for them, a lower bound."
        )
    every = taken == len(rest) and not more
    return Listing(counted, sampled, scale, complete=every, lower_bound=more, note=note)


def _folders(lister: Lister, source: Source, base: str) -> tuple[list[str], list[Listed], bool]:
    """`base`'s sub-folders (at most MAX_FOLDER_PAGES pages of them), its loose objects, and
    whether there were more folders than read."""
    folders: list[str] = []
    loose: list[Listed] = []
    for number, answer in enumerate(_pages(lister, base, "/")):
        folders.extend(p["Prefix"] for p in answer.get("CommonPrefixes", []))
        loose.extend(_objects(answer, source))
        if number + 1 >= MAX_FOLDER_PAGES:
            return folders, loose, bool(answer.get("IsTruncated"))
    return folders, loose, False


def _folder_of(prefix: str, key: str) -> str:
    """The sub-folder of `prefix` that holds `key` (itself with its slash), or the key."""
    rest = key[len(prefix) :]
    slash = rest.find("/")
    return prefix + rest[: slash + 1] if slash >= 0 else key


def _whole_folder(
    lister: Lister, source: Source, folder: str, budget: _Budget, already: int
) -> list[Listed] | None:
    """Every object of `folder` the filters let through, or None if the bound came first (a
    folder listed in part would bias the sample towards small folders)."""
    found: list[Listed] = []
    for answer in _pages(lister, folder):
        found.extend(_objects(answer, source))
        if not answer.get("IsTruncated"):
            return found
        if budget.spent(already + len(found)):
            return None
    return found


def _lower_bound(flat: list[Listed], budget: _Budget) -> Listing:
    note = (
        f"The listing stopped after {len(flat):,} objects (the bound: {budget.objects:,} "
        "objects or the time budget) and the prefix has no sub-folders small enough to sample: "
        "the figures are for the first objects in key order, a lower bound of the prefix's."
    )
    return Listing(counted=flat, complete=False, lower_bound=True, note=note)

"""Byte-identical inputs, grouped for every model when a job closes.

A worker hashes every input it reads (sha256: the results' column and the content cache's key),
so items whose digests match are duplicates for the cost of one query at close. They join the
near-duplicate groups the family found (phash, embeddings), or form groups of their own, in
the same groups.parquet: one mechanism, whatever the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from kiln.app import results
from kiln.app.results import Place
from kiln.workers.models.grouping import components


@dataclass(frozen=True)
class Groups:
    """Groups as groups.parquet holds them: members in order, each with its similarity to
    the group's first member (None where the grouping has no such measure)."""

    members: list[list[str]]
    similarities: list[list[float | None]]


def close_job(
    place: Place, identical: Sequence[tuple[str, str]], summary: dict[str, Any]
) -> dict[str, Any]:
    """Merge `identical` ((sha256, key) of items sharing their bytes) into the job's groups;
    returns the manifest's part (`summary`, from the family's step, with its group counts
    made true again, and an `identical` summary)."""
    if not identical:
        return summary
    digest_of = {key: digest for digest, key in identical}
    merged = merge(read(place), identical)
    key = results.write_groups(place, merged.members, merged.similarities, digest_of)
    groups = {
        **summary.get("groups", {}),
        "key": key,
        "groups": len(merged.members),
        "items_in_groups": sum(len(g) for g in merged.members),
    }
    same = {"groups": len(set(digest_of.values())), "items": len(identical)}
    return {**summary, "groups": groups, "identical": same}


def read(place: Place) -> Groups:
    """The groups the family's step wrote (none if it wrote no groups.parquet)."""
    table = results.read_groups(place)
    found = Groups([], [])
    if table is None:
        return found
    rows = table.select(["group", "key", "similarity"]).to_pydict()
    last = None
    for group, key, similarity in zip(rows["group"], rows["key"], rows["similarity"], strict=True):
        if group != last:
            found.members.append([])
            found.similarities.append([])
            last = group
        found.members[-1].append(key)
        found.similarities[-1].append(similarity)
    return found


def merge(found: Groups, identical: Sequence[tuple[str, str]]) -> Groups:
    """`found` with every set of byte-identical items joined (transitively) into one group.

    The family's order is kept (its groups' first members stay first); an item only the digest
    brought in comes after, with its identical twin's similarity — 1.0 in a group of identical
    items alone, as no measure can tell identical bytes apart.
    """
    similarity = {
        k: s for keys, sims in zip(found.members, found.similarities, strict=True)
        for k, s in zip(keys, sims, strict=True)
    }  # fmt: skip
    keys = [k for group in found.members for k in group]
    keys += [k for _, k in identical if k not in similarity]
    position = {k: i for i, k in enumerate(keys)}
    roots = components(len(keys), _pairs(found.members, identical, position))
    members: dict[int, list[str]] = {}
    for key, root in zip(keys, roots, strict=True):
        members.setdefault(root, []).append(key)
    twin = _first_twin(identical)
    grouped = [group for group in members.values() if len(group) > 1]
    sims = [[_similarity(k, group, similarity, twin) for k in group] for group in grouped]
    return Groups(grouped, sims)


def _pairs(
    groups: Sequence[Sequence[str]],
    identical: Sequence[tuple[str, str]],
    position: dict[str, int],
) -> list[tuple[int, int]]:
    """Each member joined to the one before it: within a family group, and within a digest."""
    pairs = [(position[a], position[b]) for group in groups for a, b in pairwise(group)]
    for (digest_a, a), (digest_b, b) in pairwise(identical):
        if digest_a == digest_b:
            pairs.append((position[a], position[b]))
    return pairs


def _first_twin(identical: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Each key → the first key with its digest."""
    first: dict[str, str] = {}
    twin: dict[str, str] = {}
    for digest, key in identical:
        twin[key] = first.setdefault(digest, key)
    return twin


def _similarity(
    key: str, group: list[str], known: dict[str, float | None], twin: dict[str, str]
) -> float | None:
    if key in known:
        return known[key]
    if not any(k in known for k in group):
        return 1.0  # a group of identical items alone
    return known.get(twin.get(key, key))

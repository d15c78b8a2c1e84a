"""Vector index build, grouping and search at scale (issue 17), through Kiln's own code.

    python -m bench.vectors                          # 100,000 and 1,000,000 × 512-d, ~25 min
    python -m bench.vectors --sizes 100000 --queries 500

Not part of `python -m bench`: the 1,000,000 size alone takes most of the run. Each size runs
in a fresh process (so its peak RSS is its own) over `bench.planted_vectors.planted_set`:
`VectorIndex.build` (vectors/s), `workers.grouping.cosine_groups` at the default threshold on
the index's approximate path as `workers.models.vector_groups` calls it (vectors/s, and pair
recall and precision against the planted copies), the exact path (`cosine_pairs` blocks) up
to `--exact-up-to` for its time and for the approximate path's recall against it, k=10
single-vector `VectorIndex.search` latency and recall against brute force, then `save` to a
local store and `load` back, into memory and memory-mapped (as the API's index cache holds a
large index), and search again on the mapped one. Every phase records its wall and CPU seconds
and the process's peak RSS (`bench.measure.Meter`). Prints a table, writes
`bench/results/vectors-*.json`.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from multiprocessing import get_context
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console

from bench import report
from bench.measure import Meter
from bench.pair_metrics import PairScores, group_labels, pair_scores
from bench.planted_vectors import PlantedSet, near, planted_set
from kiln.app.families.embed import DEFAULT_THRESHOLD
from kiln.app.results import vector_index
from kiln.app.results.results import Place
from kiln.app.results.vector_index import VectorIndex
from kiln.app.storage.local import LocalStore
from kiln.workers.models.grouping import cosine_groups

HERE = Path(__file__).parent
SIZES = "100000,1000000"
K = 10
QUERY_SIMILARITY = 0.95  # a query is a fresh near-copy of a random row ("is this a duplicate?")
WARM_UP = 50  # queries before the timed ones

Groups = list[list[str]]


# --- scores -------------------------------------------------------------------------------


def planted_scores(data: PlantedSet, keys: Sequence[str], groups: Groups) -> PairScores:
    """Pair scores of `groups` against the planted truth: a pair is true when both rows are
    one original or its copies."""
    return pair_scores(data.source.tolist(), group_labels(keys, groups))


def agreement(keys: Sequence[str], exact: Groups, approximate: Groups) -> PairScores:
    """The approximate groups scored against the exact ones: recall is the share of pairs the
    exact path puts in one group that the approximate path does too."""
    return pair_scores(group_labels(keys, exact), group_labels(keys, approximate))


def exact_top(vectors: np.ndarray, queries: np.ndarray, k: int, block: int = 64) -> np.ndarray:
    """The rows of the `k` most similar vectors to each query, by brute force ([q, k], any
    order within a row)."""
    tops = []
    for start in range(0, len(queries), block):
        sims = queries[start : start + block] @ vectors.T
        tops.append(np.argpartition(-sims, k - 1, axis=1)[:, :k])
    return np.concatenate(tops)


def recall_at_k(found: Sequence[Sequence[int]], truth: np.ndarray) -> float:
    """The mean share of each query's true k nearest that the search returned."""
    hits = [len(set(rows) & set(true.tolist())) for rows, true in zip(found, truth, strict=True)]
    return float(np.mean(hits) / truth.shape[1])


def _scores(scores: PairScores) -> dict[str, Any]:
    return {
        "true_pairs": scores.true_pairs,
        "predicted_pairs": scores.predicted_pairs,
        "correct_pairs": scores.correct_pairs,
        "precision": _rounded(scores.precision),
        "recall": _rounded(scores.recall),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 5)


# --- one size, in its own process ----------------------------------------------------------


@contextmanager
def phase(out: dict[str, Any], name: str) -> Iterator[None]:
    """Records the block's wall and CPU seconds and the process's peak RSS in it."""
    meter = Meter({"process": [os.getpid()]}, interval=0.1)
    with meter.window() as usage:
        yield
    out.setdefault("phases", {})[name] = {
        "seconds": round(usage.seconds, 4),
        "cpu_seconds": usage.cpu_seconds["process"],
        "peak_rss_mb": usage.peak_rss_mb["process"],
    }


def search_timed(index: VectorIndex, queries: np.ndarray, k: int) -> tuple[list[float], Groups]:
    """Each query alone through `VectorIndex.search`: latencies (ms) and the keys found."""
    for query in queries[:WARM_UP]:
        index.search(query, k)
    times, found = [], []
    for query in queries:
        started = time.perf_counter()
        hits = index.search(query, k)[0]  # one query row: one list of neighbours
        times.append((time.perf_counter() - started) * 1000)
        found.append([hit.key for hit in hits])
    return times, found


def latency(times_ms: Sequence[float]) -> dict[str, float]:
    """Percentiles to the microsecond (`bench.measure.percentiles` rounds to 0.1 ms, and a
    search takes about one)."""
    values = np.asarray(times_ms, dtype=np.float64)
    points = {"p50": 50, "p90": 90, "p99": 99, "max": 100}
    return {name: round(float(np.percentile(values, q)), 3) for name, q in points.items()}


def _search(index: VectorIndex, queries: np.ndarray, truth: np.ndarray) -> dict[str, Any]:
    times, found = search_timed(index, queries, K)
    rows = [[int(key) for key in keys] for keys in found]
    return {**latency(times), "recall_at_k": round(recall_at_k(rows, truth), 4)}


def _group(out: dict[str, Any], name: str, data: PlantedSet, keys: list[str], **how: Any) -> Groups:
    with phase(out, name):
        groups = [
            [k for k, _ in g] for g in cosine_groups(keys, data.vectors, DEFAULT_THRESHOLD, **how)
        ]
    out[name] = {
        "vectors_per_s": round(len(keys) / out["phases"][name]["seconds"], 1),
        "groups": len(groups),
        "items_in_groups": sum(len(g) for g in groups),
        "largest": max((len(g) for g in groups), default=0),
        "vs_planted": _scores(planted_scores(data, keys, groups)),
    }
    return groups


def _reloaded(
    out: dict[str, Any], place: Place, folder: Path, queries: np.ndarray, truth: np.ndarray
) -> None:
    """Load the saved index into memory, then memory-mapped, and search the mapped one."""
    with phase(out, "load"):
        loaded = vector_index.load(place)
    out["loaded_vectors"] = len(loaded)
    del loaded
    with phase(out, "load_mapped"):
        mapped = vector_index.load(place, folder / "mapped" / "index.usearch")
    out["search_mapped"] = _search(mapped, queries, truth)


def measure(n: int, dim: int, queries: int, exact_up_to: int, seed: int) -> dict[str, Any]:
    """Every figure of one size (run in a fresh process: see `run_size`)."""
    out: dict[str, Any] = {"n": n, "dim": dim, "threshold": DEFAULT_THRESHOLD}
    with phase(out, "generate"):
        data = planted_set(n, dim, seed=seed)
    out["planted"] = {"copies": data.copies, "copied_originals": data.copied_originals}
    keys = [str(row) for row in range(n)]
    with phase(out, "build"):
        index = VectorIndex.build(keys, data.vectors)
    out["build_vectors_per_s"] = round(n / out["phases"]["build"]["seconds"], 1)
    out["index_exact"] = index.exact
    labels = np.asarray([index.label_of(k) for k in keys], np.int64)  # as vector_groups does
    approximate = _group(out, "group", data, keys, index=index, labels=labels)
    if n <= exact_up_to:
        exact = _group(out, "group_exact", data, keys)
        out["approx_vs_exact"] = _scores(agreement(keys, exact, approximate))
    rng = np.random.default_rng(seed + 1)
    rows = data.vectors[rng.integers(0, n, queries)]
    asked = near(rows, np.full(queries, QUERY_SIMILARITY), rng)
    truth = exact_top(data.vectors, asked, K)
    del data, approximate
    out["search_built"] = _search(index, asked, truth)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-vectors-") as folder:
        place = Place(LocalStore(Path(folder) / "store"), "index/")
        with phase(out, "save"):
            out["saved"] = index.save(place)
        del index  # the loads below are measured without it
        _reloaded(out, place, Path(folder), asked, truth)
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def run_size(n: int, dim: int, queries: int, exact_up_to: int, seed: int) -> dict[str, Any]:
    """`measure` in a fresh interpreter: the peak RSS is this size's alone."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(measure, n, dim, queries, exact_up_to, seed).result()


# --- output -------------------------------------------------------------------------------

COLUMNS = (
    "n",
    "build vectors/s",
    "grouping vectors/s",
    "groups (planted)",
    "recall / precision vs planted pairs",
    "exact path s; approx recall vs exact",
    "search p50/p99 ms (built; mapped)",
    "search recall@10",
    "index MB; save / load / mapped s",
    "peak RSS MB",
)


def _pair(figures: dict[str, Any]) -> str:
    return f"{figures['recall']:.4f} / {figures['precision']:.4f}"


def _cells(r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return [f"{r['n']:,}", f"failed: {r['error']}", *["–"] * (len(COLUMNS) - 2)]
    times, group = r["phases"], r["group"]
    exact = "–"
    if "approx_vs_exact" in r:
        exact = f"{times['group_exact']['seconds']:.0f}; {r['approx_vs_exact']['recall']:.4f}"
    built, mapped = r["search_built"], r["search_mapped"]
    return [
        f"{r['n']:,}",
        f"{r['build_vectors_per_s']:,.0f}",
        f"{group['vectors_per_s']:,.0f}",
        f"{group['groups']:,} ({r['planted']['copied_originals']:,})",
        _pair(group["vs_planted"]),
        exact,
        f"{built['p50']:.2f}/{built['p99']:.2f}; {mapped['p50']:.2f}/{mapped['p99']:.2f}",
        f"{built['recall_at_k']:.4f}",
        f"{r['saved']['bytes'] / 2**20:,.0f}; {times['save']['seconds']:.1f} / "
        f"{times['load']['seconds']:.1f} / {times['load_mapped']['seconds']:.1f}",
        f"{r['peak_rss_mb']:,.0f}",
    ]


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def phases_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Each phase's seconds, cores used (CPU ÷ wall) and peak RSS, per size."""
    lines = ["| n | phase | s | cores used | peak RSS MB |", "|---|---|---|---|---|"]
    for r in rows:
        for name, p in r.get("phases", {}).items():
            cores = p["cpu_seconds"] / p["seconds"] if p["seconds"] else 0.0
            lines.append(
                f"| {r['n']:,} | {name} | {p['seconds']:.1f} | {cores:.2f} "
                f"| {p['peak_rss_mb']:,.0f} |"
            )
    return "\n".join(lines)


def write_json(results_dir: Path, payload: dict[str, Any]) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"vectors-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


# --- the run ------------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def main(
    sizes: Annotated[str, typer.Option(help="Vector counts, comma-separated.")] = SIZES,
    dim: Annotated[int, typer.Option(help="Dimensions.")] = 512,
    queries: Annotated[int, typer.Option(help="Timed single-vector searches per size.")] = 1000,
    exact_up_to: Annotated[
        int, typer.Option(help="Largest size also grouped exactly (n² work).")
    ] = 100_000,
    seed: Annotated[int, typer.Option(help="Seed of the planted set.")] = 0,
    results_dir: Annotated[Path, typer.Option(help="Where the JSON goes.")] = HERE / "results",
) -> None:
    """Build, group, search, save and load an index per size; print and save the figures."""
    console = Console()
    rows: list[dict[str, Any]] = []
    for n in _sizes(sizes):
        started = time.perf_counter()
        with console.status(f"{n:,} vectors of {dim} dimensions…"):
            try:
                rows.append(run_size(n, dim, queries, exact_up_to, seed))
            except Exception as error:  # a size that does not fit is a figure too
                rows.append({"n": n, "error": f"{type(error).__name__}: {error}"})
        console.print(f"{n:,}: {time.perf_counter() - started:.0f} s")
    print(f"{markdown(rows)}\n\n{phases_markdown(rows)}")  # Markdown, ready for the README
    payload = {
        "machine": report.machine(),
        "command": "python -m bench.vectors " + " ".join(sys.argv[1:]),
        "k": K,
        "query_similarity": QUERY_SIMILARITY,
        "sizes": rows,
    }
    console.print(f"results: {write_json(results_dir, payload)}")


if __name__ == "__main__":
    typer.run(main)

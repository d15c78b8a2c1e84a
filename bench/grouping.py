"""Near-duplicate grouping quality (issue 17): cosine groups of the bench's ResNet-18 embedder
beside phash groups, on one generated, labelled set.

    python -m bench.grouping                      # 200 originals × 6 copies + 200 distractors
    python -m bench.grouping --originals 50 --distractors 50

The set is `bench.near_duplicates.labelled_set`. Every image goes through Kiln's own code: the
embedder is the ONNX file the bench exports (`bench.models.export_resnet`, random weights,
seed 0), registered as `embed` would store it (`check_onnx`) and run by `EmbedPredictor`
(Kiln's decode, centre crop, normalisation, unit-length vectors); hashes come from
`PhashPredictor`. Groups are `workers.grouping.cosine_groups` (exact) at each threshold and
`workers.models.phash.near_duplicate_groups` at each distance, the default ones marked. Scores
are pair precision and recall (`bench.pair_metrics`) and, per transformation, the share of
copies grouped with their original. Prints the tables, writes `bench/results/grouping-*.json`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console

from bench import report
from bench.models import MAX_PIXELS, export_resnet
from bench.near_duplicates import TRANSFORMS, Item, labelled_set
from bench.pair_metrics import (
    PairScores,
    direct_precision,
    found_with_original,
    group_labels,
    pair_scores,
)
from kiln.app.catalog.model_spec import ImageModelSpec, check_onnx
from kiln.app.families.embed import DEFAULT_THRESHOLD
from kiln.app.families.phash import DEFAULT_MAX_DISTANCE
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.models.base import Predictor
from kiln.workers.models.direct import answers_of
from kiln.workers.models.embed import EmbedPredictor
from kiln.workers.models.grouping import cosine_groups, cosine_pairs
from kiln.workers.models.phash import PhashPredictor, near_duplicate_groups, parse_hashes

HERE = Path(__file__).parent
BATCH = 16  # the embedder's batch, as a worker fills it
RESNET_INPUT = 224  # the side bench.run registers the ResNets with
THRESHOLDS = (0.85, 0.90, DEFAULT_THRESHOLD, 0.95, 0.98, 0.99, 0.995, 0.998, 0.999, 0.9995)
DISTANCES = (4, 8, 10, DEFAULT_MAX_DISTANCE, 14, 16)


@dataclass(frozen=True)
class Line:
    """One method at one setting: its pair scores and what it found per transformation."""

    method: str
    setting: float
    default: bool
    scores: PairScores
    direct: float | None  # precision of the pairs admitted, before joining (no chains)
    found: dict[str, float]
    groups: int
    largest: int

    def as_dict(self) -> dict[str, Any]:
        scores = {"precision": self.scores.precision, "recall": self.scores.recall}
        return {**asdict(self), **scores}


# --- Kiln's predictors -------------------------------------------------------------------------


def embedder(onnx: Path, input_size: int = RESNET_INPUT) -> EmbedPredictor:
    """An ONNX image embedder as Kiln runs a registered `embed` model: with the spec that
    registration stores for it (defaults but the input side), on ONNX Runtime's CPU engine.
    The bench's ResNet-18 is one: its 1000 logits are the vector."""
    spec = check_onnx(onnx.read_bytes(), "embed", ImageModelSpec(input_size=input_size))
    engine = OnnxRuntimeEngine(onnx, max_batch=BATCH)
    return EmbedPredictor(onnx.stem, engine, spec, max_pixels=MAX_PIXELS)


def _outputs(predictor: Predictor, images: Sequence[bytes], batch: int) -> list[dict[str, Any]]:
    """Each image's outputs, both halves of the pipeline run here; an image Kiln cannot read
    stops the bench (its sets are generated: every image must have its answer)."""
    return answers_of(predictor, images, batch)


def embed_all(predictor: EmbedPredictor, images: Sequence[bytes]) -> np.ndarray:
    found = _outputs(predictor, images, BATCH)
    return np.asarray([out["embedding"] for out in found], dtype=np.float32)


def hash_all(images: Sequence[bytes]) -> list[str]:
    predictor = PhashPredictor(max_pixels=MAX_PIXELS)
    return [out["phash"] for out in _outputs(predictor, images, predictor.max_batch)]


# --- scores -----------------------------------------------------------------------------------


def score(
    items: Sequence[Item],
    groups: list[list[str]],
    pairs: np.ndarray,
    method: str,
    setting: float,
    default: bool,
) -> Line:
    predicted = group_labels([i.key for i in items], groups)
    sources = [i.source for i in items]
    transforms = [i.transform for i in items]
    return Line(
        method=method,
        setting=setting,
        default=default,
        scores=pair_scores(sources, predicted),
        direct=direct_precision(sources, pairs),
        found=found_with_original(sources, transforms, predicted),
        groups=len(groups),
        largest=max((len(g) for g in groups), default=0),
    )


def cosine_lines(
    items: Sequence[Item], vectors: np.ndarray, thresholds: Sequence[float], name: str = ""
) -> list[Line]:
    method = f"cosine ({name})" if name else "cosine"
    keys = [i.key for i in items]
    lines = []
    for threshold in thresholds:
        groups = [[k for k, _ in g] for g in cosine_groups(keys, vectors, threshold)]
        pairs = cosine_pairs(vectors, threshold)
        default = threshold == DEFAULT_THRESHOLD
        lines.append(score(items, groups, pairs, method, threshold, default))
    return lines


def phash_lines(items: Sequence[Item], hashes: list[str], distances: Sequence[int]) -> list[Line]:
    keys, bits = [i.key for i in items], parse_hashes(hashes)
    lines = []
    for distance in distances:
        groups = near_duplicate_groups(keys, hashes, distance)
        pairs = hamming_pairs(bits, distance)
        default = distance == DEFAULT_MAX_DISTANCE
        lines.append(score(items, groups, pairs, "phash", distance, default))
    return lines


def hamming_pairs(bits: np.ndarray, distance: int, block: int = 1024) -> np.ndarray:
    """Every pair (i < j) of hashes within `distance` bits, compared block by block: the
    pairs phash grouping joins (its own search skips most comparisons; this one is plain)."""
    found = [np.empty((0, 2), np.int64)]
    for start in range(0, len(bits), block):
        i, j = np.nonzero(np.bitwise_count(bits[start : start + block, None] ^ bits) <= distance)
        i += start
        found.append(np.stack([i[i < j], j[i < j]], axis=1))
    return np.concatenate(found)


# --- how close copies and strangers are -------------------------------------------------------


def _summary(values: np.ndarray) -> dict[str, float]:
    points = {"min": 0, "p1": 1, "p10": 10, "p50": 50, "p90": 90, "p99": 99, "max": 100}
    return {name: round(float(np.percentile(values, q)), 4) for name, q in points.items()}


def closeness(items: Sequence[Item], vectors: np.ndarray, hashes: list[str]) -> dict[str, Any]:
    """Cosine similarity and Hamming distance of each copy to its original, by
    transformation, and of every pair of distinct pictures (originals and distractors)."""
    bits = parse_hashes(hashes)
    original = {i.source: n for n, i in enumerate(items) if i.transform == "original"}
    out: dict[str, Any] = {}
    for transform in TRANSFORMS:
        at = np.array([n for n, i in enumerate(items) if i.transform == transform])
        of = np.array([original[items[n].source] for n in at])
        out[transform] = {
            "cosine": _summary(np.einsum("ij,ij->i", vectors[at], vectors[of])),
            "hamming": _summary(np.bitwise_count(bits[at] ^ bits[of])),
        }
    distinct = _distinct(items)
    upper = np.triu_indices(len(distinct), 1)
    cosines = (vectors[distinct] @ vectors[distinct].T)[upper]
    hamming = np.bitwise_count(bits[distinct][:, None] ^ bits[distinct])[upper]
    out["distinct pictures"] = {
        "cosine": _summary(cosines),
        "hamming": _summary(hamming),
        "pairs": len(cosines),
        "at default threshold": int((cosines >= DEFAULT_THRESHOLD - 1e-6).sum()),
        "within default distance": int((hamming <= DEFAULT_MAX_DISTANCE).sum()),
    }
    return out


def _distinct(items: Sequence[Item]) -> np.ndarray:
    return np.array([n for n, i in enumerate(items) if not i.is_copy])


def common_direction(items: Sequence[Item], vectors: np.ndarray) -> float:
    """Length of the mean of the distinct pictures' unit vectors: near 1 when they all lean
    the same way, and then every cosine is high whatever the pictures."""
    return round(float(np.linalg.norm(vectors[_distinct(items)].mean(axis=0))), 4)


# --- output -----------------------------------------------------------------------------------


def _figure(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _setting(line: Line) -> str:
    text = f"≤ {line.setting:g} bits" if line.method == "phash" else f"≥ {line.setting:g}"
    return f"**{text}** (default)" if line.default else text


def markdown(lines: Sequence[Line]) -> str:
    head = ["method", "setting", "precision", "recall", "direct precision", "groups", "largest"]
    head += list(TRANSFORMS)
    rows = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for line in lines:
        cells = [
            line.method,
            _setting(line),
            _figure(line.scores.precision),
            _figure(line.scores.recall),
            _figure(line.direct),
            str(line.groups),
            str(line.largest),
            *(_figure(line.found.get(t)) for t in TRANSFORMS),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def closeness_markdown(found: dict[str, Any]) -> str:
    rows = [
        "| pairs | cosine min / p10 / p50 / max | Hamming p50 / p90 / max |",
        "|---|---|---|",
    ]
    for name, both in found.items():
        c, h = both["cosine"], both["hamming"]
        rows.append(
            f"| {name} | {c['min']:.4f} / {c['p10']:.4f} / {c['p50']:.4f} / {c['max']:.4f} "
            f"| {h['p50']:g} / {h['p90']:g} / {h['max']:g} |"
        )
    return "\n".join(rows)


def report_text(lines: Sequence[Line], near: dict[str, Any], leaning: float) -> str:
    strangers = near["distinct pictures"]
    return (
        f"{markdown(lines)}\n\n{closeness_markdown(near)}\n\n"
        f"Length of the mean unit vector of the distinct pictures: {leaning}. "
        f"Pairs of distinct pictures: {strangers['pairs']}; at cosine ≥ {DEFAULT_THRESHOLD}: "
        f"{strangers['at default threshold']}; within {DEFAULT_MAX_DISTANCE} bits: "
        f"{strangers['within default distance']}."
    )


def write_json(results_dir: Path, payload: dict[str, Any]) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"grouping-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


# --- the run ----------------------------------------------------------------------------------


def _text(values: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in values)


def _csv(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(
    originals: Annotated[int, typer.Option(help="Pictures with six copies each.")] = 200,
    distractors: Annotated[int, typer.Option(help="Pictures with no copy.")] = 200,
    thresholds: Annotated[str, typer.Option(help="Cosine thresholds.")] = _text(THRESHOLDS),
    distances: Annotated[str, typer.Option(help="phash distances (bits).")] = _text(DISTANCES),
    onnx: Annotated[
        Path | None, typer.Option(help="Another ONNX image embedder (default: ResNet-18).")
    ] = None,
    input_size: Annotated[int, typer.Option(help="Its input side.")] = RESNET_INPUT,
    workdir: Annotated[Path, typer.Option(help="Where the exported model is kept.")] = Path(
        ".kiln/bench"
    ),
    results_dir: Annotated[Path, typer.Option(help="Where the JSON goes.")] = HERE / "results",
) -> None:
    """Group a labelled set of near-duplicates by cosine and by phash; print and save scores."""
    console = Console()
    with _timed("generate") as seconds, console.status("generating the labelled set…"):
        items = labelled_set(originals, distractors)
    onnx = onnx or export_resnet(18, workdir.resolve() / "models" / "resnet18.onnx")
    images = [i.data for i in items]
    with _timed("embed", seconds), console.status(f"embedding {len(items)} images…"):
        vectors = embed_all(embedder(onnx, input_size), images)
    with _timed("hash", seconds), console.status(f"hashing {len(items)} images…"):
        hashes = hash_all(images)
    lines = cosine_lines(items, vectors, _csv(thresholds), onnx.stem)
    lines += phash_lines(items, hashes, [int(d) for d in _csv(distances)])
    near, leaning = closeness(items, vectors, hashes), common_direction(items, vectors)
    print(report_text(lines, near, leaning))  # Markdown, ready for the README
    payload = {
        "machine": report.machine(),
        "command": "python -m bench.grouping " + " ".join(sys.argv[1:]),
        "embedder": str(onnx),
        "set": {"originals": originals, "distractors": distractors, "items": len(items)},
        "transforms": list(TRANSFORMS),
        "seconds": seconds,
        "lines": [line.as_dict() for line in lines],
        "closeness": near,
        "common_direction": leaning,
    }
    console.print(f"results: {write_json(results_dir, payload)}")


@contextmanager
def _timed(name: str, seconds: dict[str, float] | None = None) -> Iterator[dict[str, float]]:
    """Adds the block's wall time, as `name`, to `seconds` (a new dict when None)."""
    seconds = {} if seconds is None else seconds
    started = time.perf_counter()
    yield seconds
    seconds[name] = round(time.perf_counter() - started, 2)


if __name__ == "__main__":
    typer.run(main)

"""Perceptual hashes, and near-duplicate groups over generated originals and their copies."""

from __future__ import annotations

import io
import random
import time
from dataclasses import dataclass
from pathlib import Path

import imagehash
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw, ImageFont

from devstack.images import photo, truncated_jpeg
from kiln.app.catalog.catalog import builtin_model
from kiln.app.core.errors import InputError
from kiln.app.db.models import Job
from kiln.app.results.results import Place
from kiln.app.storage.local import LocalStore
from kiln.workers.models.base import ClosedJob
from kiln.workers.models.hamming import close_pairs
from kiln.workers.models.loader import job_closed
from kiln.workers.models.phash import (
    DEFAULT_MAX_DISTANCE,
    PhashPredictor,
    close_job,
    near_duplicate_groups,
)
from tests.workers.models.halves import outputs, prepare

ORIGINALS = 64
SIZE = (480, 360)
WORDS = ("kiln", "batch", "image", "hash", "queue", "worker", "tensor", "model", "shard", "label")


def _colour(rng: random.Random) -> tuple[int, int, int]:
    return (rng.randint(0, 255), rng.randint(0, 255), rng.randint(0, 255))


def _blend(rng: random.Random, t: np.ndarray) -> Image.Image:
    """Two random colours mixed by `t` (0…1 per pixel)."""
    c0, c1 = np.array(_colour(rng)), np.array(_colour(rng))
    return Image.fromarray((c0 + (c1 - c0) * t[..., None]).astype(np.uint8))


def _gradient(rng: random.Random) -> Image.Image:
    y, x = np.mgrid[0 : SIZE[1], 0 : SIZE[0]]
    angle = rng.uniform(0, 2 * np.pi)
    t = np.cos(angle) * x / SIZE[0] + np.sin(angle) * y / SIZE[1]
    return _blend(rng, (t - t.min()) / np.ptp(t))


def _waves(rng: random.Random) -> Image.Image:
    y, x = np.mgrid[0 : SIZE[1], 0 : SIZE[0]]
    angle, cycles = rng.uniform(0, np.pi), rng.uniform(2, 12)
    phase = (np.cos(angle) * x + np.sin(angle) * y) / SIZE[0] * 2 * np.pi * cycles
    return _blend(rng, (np.sin(phase + rng.uniform(0, 6)) + 1) / 2)


def _shapes(draw: ImageDraw.ImageDraw, rng: random.Random, count: int) -> None:
    width, height = SIZE
    for _ in range(count):
        x0, y0 = rng.randint(0, width - 20), rng.randint(0, height - 20)
        x1 = rng.randint(x0 + 10, min(width, x0 + width // 2))
        y1 = rng.randint(y0 + 10, min(height, y0 + height // 2))
        kind = rng.random()
        if kind < 0.4:
            draw.ellipse([x0, y0, x1, y1], fill=_colour(rng))
        elif kind < 0.8:
            draw.rectangle([x0, y0, x1, y1], fill=_colour(rng))
        else:
            corners = [(rng.randint(0, width), rng.randint(0, height)) for _ in range(3)]
            draw.polygon(corners, fill=_colour(rng))


def _text(draw: ImageDraw.ImageDraw, rng: random.Random, lines: int) -> None:
    for _ in range(lines):
        font = ImageFont.load_default(size=rng.randint(18, 48))
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        xy = (rng.randint(0, SIZE[0] // 2), rng.randint(0, SIZE[1] - 50))
        draw.text(xy, words, fill=_colour(rng), font=font)


def original(seed: int) -> Image.Image:
    """Four kinds in turn: shapes, a gradient with shapes, text, waves with a shape and text."""
    rng = random.Random(seed)
    kind = seed % 4
    if kind == 1:
        image = _gradient(rng)
    elif kind == 3:
        image = _waves(rng)
    else:
        image = Image.new("RGB", SIZE, _colour(rng))
    draw = ImageDraw.Draw(image)
    if kind == 0:
        _shapes(draw, rng, rng.randint(6, 14))
    elif kind == 1:
        _shapes(draw, rng, rng.randint(2, 4))
    elif kind == 2:
        _text(draw, rng, rng.randint(4, 8))
    else:
        _shapes(draw, rng, 1)
        _text(draw, rng, 1)
    return image


def encode(image: Image.Image, fmt: str = "PNG", **options: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def copies(image: Image.Image, rng: random.Random) -> dict[str, bytes]:
    """Resized 0.5–1.5×, re-encoded as JPEG q50–95, cropped by 0–5% on each side."""
    scale = rng.uniform(0.5, 1.5)
    resized = image.resize(
        (round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC
    )
    left, top, right, bottom = (rng.uniform(0, 0.05) for _ in range(4))
    box = (
        round(left * image.width),
        round(top * image.height),
        image.width - round(right * image.width),
        image.height - round(bottom * image.height),
    )
    return {
        "resized": encode(resized),
        "jpeg": encode(image, "JPEG", quality=rng.randint(50, 95)),
        "cropped": encode(image.crop(box)),
    }


@dataclass(frozen=True)
class Corpus:
    keys: list[str]
    hashes: list[str]
    source: dict[str, int]  # key → the original it was made from

    def distance(self, a: str, b: str) -> int:
        ha, hb = self.hashes[self.keys.index(a)], self.hashes[self.keys.index(b)]
        return (int(ha, 16) ^ int(hb, 16)).bit_count()


def hash_all(predictor: PhashPredictor, items: list[bytes]) -> list[str]:
    return [found["phash"] for found in outputs(predictor, items)]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    keys, items, source = [], [], {}
    for seed in range(ORIGINALS):
        image = original(seed)
        made = {"original": encode(image), **copies(image, random.Random(1000 + seed))}
        for name, data in made.items():
            key = f"{seed:02d}-{name}"
            keys.append(key)
            items.append(data)
            source[key] = seed
    return Corpus(keys, hash_all(PhashPredictor(max_pixels=10_000_000), items), source)


def test_the_generated_originals_are_distinct(corpus: Corpus) -> None:
    originals = [
        h for k, h in zip(corpus.keys, corpus.hashes, strict=True) if k.endswith("original")
    ]
    assert len(set(originals)) == ORIGINALS


def test_copies_are_grouped_with_their_original_and_originals_stay_apart(
    corpus: Corpus,
) -> None:
    groups = near_duplicate_groups(corpus.keys, corpus.hashes, DEFAULT_MAX_DISTANCE)
    group_of = {key: i for i, group in enumerate(groups) for key in group}
    copies_ = [k for k in corpus.keys if not k.endswith("original")]
    found = [
        k
        for k in copies_
        if k in group_of and group_of[k] == group_of.get(f"{corpus.source[k]:02d}-original")
    ]
    recall = len(found) / len(copies_)
    pairs = [(a, b) for group in groups for i, a in enumerate(group) for b in group[i + 1 :]]
    precision = sum(corpus.source[a] == corpus.source[b] for a, b in pairs) / len(pairs)
    originals = [k for k in corpus.keys if k.endswith("original")]
    merged = sum(
        any(o != p and group_of.get(o, -1) == group_of.get(p, -2) for p in originals)
        for o in originals
    )
    missed = {k: corpus.distance(k, f"{corpus.source[k]:02d}-original") for k in copies_}
    print(
        f"\nphash at {DEFAULT_MAX_DISTANCE} bits: recall {recall:.3f}, pair precision "
        f"{precision:.3f}, originals merged {merged}/{ORIGINALS}; "
        f"missed copies: { {k: d for k, d in missed.items() if k not in found} }"
    )
    assert recall >= 0.95
    assert precision >= 0.95
    assert 1 - merged / ORIGINALS >= 0.95


def test_resized_and_jpeg_copies_are_close(corpus: Corpus) -> None:
    """The easy copies are far inside the threshold; crops are what it is set for."""
    for key in corpus.keys:
        if key.endswith(("resized", "jpeg")):
            assert corpus.distance(key, f"{corpus.source[key]:02d}-original") <= 8, key


def test_the_hash_is_imagehash_phash_of_the_image() -> None:
    """prep does phash's own greyscale + 32×32 resize, so a PNG hashes exactly the same, alone
    or in a batch."""
    datas = [encode(original(seed)) for seed in (7, 8, 9)]
    expected = [str(imagehash.phash(Image.open(io.BytesIO(data)))) for data in datas]
    predictor = PhashPredictor(max_pixels=10_000_000)
    (ours,) = hash_all(predictor, datas[:1])
    assert ours == expected[0]
    assert len(ours) == 16 and int(ours, 16) >= 0
    assert hash_all(predictor, datas) == expected


def test_a_large_jpeg_decoded_at_reduced_scale_hashes_like_a_full_decode() -> None:
    predictor = PhashPredictor(max_pixels=50_000_000)
    distances = []
    for seed in range(8):
        data = photo(seed, size=(3000, 2000))
        (ours,) = hash_all(predictor, [data])
        full = str(imagehash.phash(Image.open(io.BytesIO(data))))
        distances.append((int(ours, 16) ^ int(full, 16)).bit_count())
    assert max(distances) <= 2, distances


def test_bad_inputs_are_input_errors() -> None:
    predictor = PhashPredictor(max_pixels=1_000_000)
    with pytest.raises(InputError, match="images, not text"):
        prepare(predictor, "a caption")
    with pytest.raises(InputError):
        prepare(predictor, truncated_jpeg())
    with pytest.raises(InputError, match="over the limit"):
        prepare(predictor, photo(0, size=(2000, 1000)))


def h(value: int) -> str:
    return f"{value:016x}"


def test_groups_are_transitive_ordered_and_leave_out_singletons() -> None:
    a = 0
    b = a ^ 0b111  # 3 bits from a
    c = b ^ (0b111 << 10)  # 3 bits from b, 6 from a
    far = (1 << 64) - 1
    keys = ["far", "c", "a", "b", "a-again"]
    hashes = [h(far), h(c), h(a), h(b), h(a)]
    assert near_duplicate_groups(keys, hashes, 3) == [["c", "a", "b", "a-again"]]
    assert near_duplicate_groups(keys, hashes, 2) == [["a", "a-again"]]
    assert near_duplicate_groups(keys, hashes, 0) == [["a", "a-again"]]
    assert near_duplicate_groups([], [], 10) == []


def test_hex_digits_may_be_upper_case() -> None:
    assert near_duplicate_groups(["x", "y"], ["ABCDEF0123456789", "abcdef0123456789"], 0) == [
        ["x", "y"]
    ]


@pytest.mark.parametrize(
    ("keys", "hashes", "distance", "message"),
    [
        (["a"], [], 4, "must pair up"),
        (["a"], ["123"], 4, "16 hex digits"),
        (["a"], ["0123 4567890abcd"], 4, "16 hex digits"),
        (["a"], ["0x23456789abcdef"], 4, "16 hex digits"),
        (["a"], ["0123456789abcdef"], -1, "between 0 and"),
        (["a"], ["0123456789abcdef"], 17, "between 0 and"),
    ],
)
def test_bad_arguments(keys: list[str], hashes: list[str], distance: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        near_duplicate_groups(keys, hashes, distance)


@pytest.mark.parametrize("distance", [0, 1, 2, 5, 8, 10, 12, 16, 24])
def test_close_pairs_match_all_pairs_compared(distance: int) -> None:
    """Clusters of nearby hashes, checked against the brute-force answer."""
    rng = np.random.default_rng(distance)
    centres = rng.integers(0, 2**64, size=150, dtype=np.uint64)
    bits = np.uint64(1) << rng.integers(0, 64, size=(1500, 14), dtype=np.uint64)
    keep = rng.random((1500, 14)) < rng.random((1500, 1))  # 0 to 14 bits flipped
    noise = np.bitwise_xor.reduce(np.where(keep, bits, np.uint64(0)), axis=1)
    values = np.unique(np.repeat(centres, 10) ^ noise)
    close = np.bitwise_count(values[:, None] ^ values[None, :]) <= distance
    expected = np.argwhere(np.triu(close, 1))
    np.testing.assert_array_equal(close_pairs(values, distance), expected)


def test_grouping_100k_hashes_takes_seconds_not_all_pairs() -> None:
    """100,000 random hashes with 1,000 planted near copies: every copy found, in seconds."""
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**64, size=99_000, dtype=np.uint64)
    flips = rng.integers(0, 64, size=(1000, DEFAULT_MAX_DISTANCE), dtype=np.uint64)
    noise = np.bitwise_xor.reduce(np.uint64(1) << flips, axis=1)
    planted = values[:1000] ^ noise  # within DEFAULT_MAX_DISTANCE (repeated bits cancel)
    hashes = [h(int(v)) for v in np.concatenate([values, planted])]
    keys = [f"k{i}" for i in range(len(hashes))]
    started = time.perf_counter()
    groups = near_duplicate_groups(keys, hashes)
    elapsed = time.perf_counter() - started
    group_of = {key: i for i, group in enumerate(groups) for key in group}
    found = sum(group_of.get(f"k{i}", -1) == group_of.get(f"k{99_000 + i}") for i in range(1000))
    # Random 64-bit hashes also meet by chance: about 2 in 10⁷ pairs are within 12 bits.
    chance = sum(len(g) for g in groups) - 2000
    print(
        f"\n100,000 hashes grouped at {DEFAULT_MAX_DISTANCE} bits in {elapsed:.2f} s; "
        f"{chance} unplanted hashes grouped by chance"
    )
    assert found == 1000
    assert elapsed < 15  # a few seconds on a 2-core runner; all pairs would be 5·10⁹ checks


# --- the job-closed step ---------------------------------------------------------------------


def _closed(tmp_path: Path, options: dict[str, object]) -> tuple[ClosedJob, Place]:
    outputs = [("a", {"phash": "ffffffffffffffff"}), ("b", {"phash": "fffffffffffffff0"}),
               ("c", {"phash": "0000000000000000"}), ("d", {})]  # fmt: skip
    place = Place(LocalStore(tmp_path), "results/j/")
    job = Job(id="j", options=options)
    return ClosedJob(job, lambda: outputs, place), place


@pytest.mark.parametrize(("options", "groups"), [({}, [["a", "b"]]), ({"max_distance": 3}, [])])
def test_closing_a_job_writes_its_groups_at_its_distance(
    tmp_path: Path, options: dict[str, object], groups: list[list[str]]
) -> None:
    closed, place = _closed(tmp_path, options)
    entry = close_job(closed)["groups"]
    assert entry == {
        "key": "results/j/groups.parquet",
        "max_distance": options.get("max_distance", DEFAULT_MAX_DISTANCE),
        "groups": len(groups),
        "items_in_groups": sum(len(g) for g in groups),
    }
    rows = pq.read_table(io.BytesIO(place.store.get(entry["key"]))).to_pylist()
    assert [[r["key"] for r in rows if r["group"] == n] for n in range(len(groups))] == groups


def test_only_phash_has_a_job_closed_step() -> None:
    assert job_closed(builtin_model("phash")) is close_job
    assert job_closed(builtin_model("detector")) is None

"""OCR on Kiln's engines (CPU, the real PP-OCR models): accuracy on rendered words, batching
invariance across images, the repository's examples, bad input, and the small helpers."""

from __future__ import annotations

import io
import random
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from devstack.images import solid
from kiln.app.core.errors import InputError
from kiln.app.storage.local import LocalStore
from kiln.workers.batching import Batcher, BatchPolicy, Part
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.base import Answers, AnswersShape, Rows
from kiln.workers.models.direct import outcomes_of
from kiln.workers.models.ocr import OcrPredictor
from kiln.workers.models.ocr_config import load_config
from kiln.workers.models.ocr_det import MAX_DET_SIDE, Page, padding, to_original
from kiln.workers.models.ocr_lines import (
    REC_BUCKET,
    REC_MAX_WIDTH,
    group_indices,
    padded_normalizer,
)
from kiln.workers.prep.pixels import Decoded
from kiln.workers.runners.gather import gather
from tests.support import migrated_settings
from tests.workers.models.halves import outputs, prepare

ROOT = Path(__file__).resolve().parents[3]
FONT_DIR = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
FONTS = [
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
]
SIZES = [12, 18, 28, 44]  # px; the smallest is where PP-OCR starts to slip
WORDS = (
    "invoice", "batch", "Thursday", "parking", "Bakery", "espresso", "November", "total",
    "garden", "window", "yellow", "quartz", "jumped", "Market", "street", "coffee", "River",
    "planet", "silver", "orange", "number", "ticket", "Station", "Monday", "Friday", "Summer",
    "winter", "museum", "bridge", "harbour", "2041", "318.50", "kitchen", "Delta", "pocket",
    "example", "Berlin", "paper", "forest", "mountain", "Tuesday", "castle", "Orbit", "secret",
    "42", "letter", "Copper", "velvet", "engine", "garage", "Zebra", "frozen", "meadow", "Sunday",
    "Violet", "pepper", "lantern", "hockey", "jacket",
)  # fmt: skip
WORDS_PER_IMAGE = 4
# What the examples read as (spaces aside: the recogniser's spacing is not stable).
EXAMPLES = {
    "invoice.jpg": ["INVOICE2041", "Totaldue:318.50EUR", "Payby30November"],
    "label.jpg": ["Fragile", "Handlewithcare", "Thissideup"],
    "note.png": ["Meeting", "moved", "toThursday3pm", "Room42"],
    "poster.png": ["KILN", "batchinference", "oneveryGPU"],
    "receipt.jpg": ["Corner", "Bakery", "2croissants", "4.20", "1espresso", "2.10"],
    "sign.jpg": ["NOF", "PARKING", "Mon-Fri8am-6pm"],
}


# --- driving the predictor as a chunk does --------------------------------------------------


@pytest.fixture(scope="module")
def predictor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OcrPredictor]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        # A partial line batch waits this long only while announced rows are still coming.
        settings = migrated_settings(tmp_path_factory.mktemp("ocr"), monkeypatch, max_delay_ms=300)
    engines = EngineFactory(settings, LocalStore.from_url(settings.storage_url))
    ocr = OcrPredictor(engines, max_pixels=settings.max_image_pixels)
    yield ocr
    ocr.close()


def read_alone(ocr: OcrPredictor, data: bytes) -> dict[str, Any]:
    (found,) = outputs(ocr, [data])
    return found


def read_together(ocr: OcrPredictor, images: list[bytes], chunks: int) -> list[dict[str, Any]]:
    """`chunks` threads, each preparing its share into one block submitted through one Batcher
    around `infer` (as a worker's runtime makes it: equal shapes share detector calls), then
    finishing its block, all at once.

    An announced line that never comes keeps the inner runners gathering until their delay,
    so lines of several images always share a batch (on a busy worker the queue does that).
    """

    def run(parts: Sequence[Part[Rows]]) -> Answers:
        return ocr.infer(gather(parts, None))

    batcher: Batcher[Rows, Answers] = Batcher(
        run, AnswersShape(), BatchPolicy(max_batch=4, max_delay_s=0.01, runners=2, greedy=True)
    )
    results: list[dict[str, Any]] = [{} for _ in images]
    barrier = threading.Barrier(chunks)
    errors: list[BaseException] = []

    def chunk(indices: list[int]) -> None:
        try:
            with batcher.expect(len(indices)) as announced:
                prepared = [prepare(ocr, images[i]) for i in indices]
                block = Rows(objects=[row.made for row in prepared])
                future = announced.submit(block)
            barrier.wait(timeout=120)
            answers = ocr.finish(future.result())
            for i, found in zip(indices, outcomes_of(answers), strict=True):
                assert isinstance(found, dict), found
                results[i] = found
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [
        threading.Thread(target=chunk, args=(list(range(k, len(images), chunks)),))
        for k in range(chunks)
    ]
    with ocr.cls_batcher.expect(1), ocr.rec_batcher.expect(1):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    batcher.close()
    assert not errors, errors
    return results


# --- generated pages of words --------------------------------------------------------------


def word_page(words: list[str], font_name: str, size: int, seed: int) -> bytes:
    """One word per line at random offsets, dark ink on a light background."""
    rng = random.Random(seed)
    font = ImageFont.truetype(str(FONT_DIR / font_name), size)
    step, margin, width = round(size * 1.8), size, 640
    background = tuple(rng.randint(215, 255) for _ in range(3))
    image = Image.new("RGB", (width, 2 * margin + step * len(words)), background)
    draw = ImageDraw.Draw(image)
    for k, word in enumerate(words):
        x = rng.randint(16, width - 16 - round(draw.textlength(word, font=font)))
        ink = tuple(rng.randint(0, 80) for _ in range(3))
        draw.text((x, margin + k * step), word, fill=ink, font=font)
    buffer = io.BytesIO()
    if seed % 2:
        image.save(buffer, "JPEG", quality=90)
    else:
        image.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def pages() -> list[tuple[list[str], bytes]]:
    rng = random.Random(7)
    made = []
    for seed, (font_name, size) in enumerate((f, s) for f in FONTS for s in SIZES):
        words = rng.sample(WORDS, WORDS_PER_IMAGE)
        made.append((words, word_page(words, font_name, size, seed)))
    return made


@pytest.fixture(scope="module")
def alone(predictor: OcrPredictor, pages: list[tuple[list[str], bytes]]) -> list[dict[str, Any]]:
    return [read_alone(predictor, data) for _, data in pages]


def words_found(expected: list[str], outputs: dict[str, Any]) -> int:
    read = Counter(line["text"] for line in outputs["lines"])
    return sum(min(count, read[word]) for word, count in Counter(expected).items())


def test_rendered_words_are_read_exactly(
    pages: list[tuple[list[str], bytes]], alone: list[dict[str, Any]]
) -> None:
    found = sum(words_found(words, out) for (words, _), out in zip(pages, alone, strict=True))
    total = sum(len(words) for words, _ in pages)
    accuracy = found / total
    print(f"OCR word accuracy: {found}/{total} = {accuracy:.1%}")
    assert accuracy >= 0.9


def test_outputs_do_not_depend_on_the_other_images_in_flight(
    predictor: OcrPredictor, pages: list[tuple[list[str], bytes]], alone: list[dict[str, Any]]
) -> None:
    before = predictor.rec_batcher.snapshot().size_counts
    together = read_together(predictor, [data for _, data in pages], chunks=6)
    sizes = predictor.rec_batcher.snapshot().size_counts - before
    most_lines = max(len(out["lines"]) for out in alone)
    assert max(sizes) > most_lines  # some recogniser batch held lines of several images
    for one, other in zip(alone, together, strict=True):
        assert_same_reading(one, other)


def assert_same_reading(one: dict[str, Any], other: dict[str, Any]) -> None:
    assert one["text"] == other["text"]
    assert [line["text"] for line in one["lines"]] == [line["text"] for line in other["lines"]]
    for a, b in zip(one["lines"], other["lines"], strict=True):
        assert a["score"] == pytest.approx(b["score"], abs=1e-4)
        np.testing.assert_allclose(a["box"], b["box"], atol=1e-4)


def test_upside_down_lines_are_turned_by_the_classifier(predictor: OcrPredictor) -> None:
    words = ["Thursday", "parking", "November", "example"]
    data = word_page(words, "DejaVuSans-Bold.ttf", 28, seed=2)
    turned = io.BytesIO()
    Image.open(io.BytesIO(data)).rotate(180).save(turned, "PNG")
    out = read_alone(predictor, turned.getvalue())
    assert sorted(line["text"] for line in out["lines"]) == sorted(words)


# --- the repository's examples ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_read_as_before(predictor: OcrPredictor, name: str) -> None:
    data = (ROOT / "examples" / name).read_bytes()
    out = read_alone(predictor, data)
    assert [line["text"].replace(" ", "") for line in out["lines"]] == EXAMPLES[name]
    assert out["text"] == "\n".join(line["text"] for line in out["lines"])
    width, height = Image.open(io.BytesIO(data)).size
    for line in out["lines"]:
        assert 0.5 <= line["score"] <= 1.0
        assert len(line["box"]) == 4
        assert all(0 <= x <= width and 0 <= y <= height for x, y in line["box"])


# 5.5×: over the working image's 2,000 px side, so shrunk before detection.
@pytest.mark.parametrize(("factor", "fmt"), [(2, "PNG"), (5.5, "JPEG")])
def test_boxes_are_in_original_pixels(predictor: OcrPredictor, factor: float, fmt: str) -> None:
    data = (ROOT / "examples" / "poster.png").read_bytes()
    small = read_alone(predictor, data)
    image = Image.open(io.BytesIO(data))
    big = io.BytesIO()
    image.resize((round(image.width * factor), round(image.height * factor))).save(big, fmt)
    large = read_alone(predictor, big.getvalue())
    assert [line["text"] for line in large["lines"]] == [line["text"] for line in small["lines"]]
    for a, b in zip(small["lines"], large["lines"], strict=True):
        np.testing.assert_allclose(np.array(b["box"]) / factor, a["box"], atol=6)


# --- bad input and empty images ----------------------------------------------------------------


def test_non_image_input_fails_with_a_sentence(predictor: OcrPredictor) -> None:
    with pytest.raises(InputError, match=r"neither an image nor a video Kiln can read\.$"):
        prepare(predictor, b"these are not pixels")
    with pytest.raises(InputError, match="takes images, not text"):
        prepare(predictor, "hello")


def test_a_needle_thin_image_fails_with_a_sentence(predictor: OcrPredictor) -> None:
    with pytest.raises(InputError, match="too thin to read text from"):
        prepare(predictor, solid((255, 255, 255), size=(20_000, 1)))


@pytest.mark.parametrize("data", [solid((255, 255, 255), (640, 480)), solid((30, 30, 30))])
def test_an_image_without_text_gives_empty_outputs(predictor: OcrPredictor, data: bytes) -> None:
    assert read_alone(predictor, data) == {"text": "", "lines": []}


# --- helpers ----------------------------------------------------------------------------------


def test_config_is_read_from_rapidocr() -> None:
    config = load_config()
    assert config.det_model.is_file() and config.rec_model.is_file()
    assert (config.text_score, config.cls_thresh, config.limit_side_len) == (0.5, 0.9, 736)
    assert (config.rec_height, config.rec_width, config.cls_width) == (48, 320, 192)


def test_thin_or_short_images_are_padded_like_rapidocr() -> None:
    config = load_config()
    assert padding(390, 800, config) == 0
    assert padding(30, 200, config) == 15  # short: padded to 2 × min_height
    assert padding(60, 800, config) == 70  # wider than 8:1: padded to 2 × width / 8


def test_strips_are_padded_to_their_own_bucket(predictor: OcrPredictor) -> None:
    reader = predictor.reader
    short = reader.rec_strip(np.zeros((20, 60, 3), dtype=np.uint8))
    assert (short.pixels.shape, short.width) == ((48, 144, 3), 320)
    long = reader.rec_strip(np.zeros((20, 200, 3), dtype=np.uint8))
    assert (long.pixels.shape, long.width) == ((48, 480, 3), 480)
    longer = reader.rec_strip(np.zeros((20, 201, 3), dtype=np.uint8))
    assert longer.width == 480 + REC_BUCKET
    assert reader.cls_strip(np.zeros((20, 200, 3), dtype=np.uint8)).pixels.shape == (48, 192, 3)
    endless = reader.rec_strip(np.zeros((20, 3000, 3), dtype=np.uint8))  # squeezed
    assert (endless.pixels.shape, endless.width) == ((48, REC_MAX_WIDTH, 3), REC_MAX_WIDTH)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((800, 390), (736, 1504)),  # as rapidocr: the short side grown to 736 px
        ((2000, 30), (736, 2944)),  # letterboxed to 2000 × 500 first, as rapidocr
        ((30, 2000), (5888, 96)),  # rapidocr would make it 49,056 × 736
        ((9000, 6000), (1344, 1984)),  # shrunk to a 2,000 px side first
        ((12, 5), (736, 1472)),  # grown to a 30 px side first
    ],
)
def test_detector_inputs_stay_in_range(
    predictor: OcrPredictor, size: tuple[int, int], expected: tuple[int, int]
) -> None:
    width, height = size
    page = predictor.detection.page(Decoded(Image.new("RGB", size, "white"), width, height))
    pixels = predictor.detection.input(page)
    assert pixels.shape == (*expected, 3) and pixels.dtype == np.uint8
    assert max(pixels.shape[:2]) <= MAX_DET_SIDE


def test_padded_normalizer_zeroes_the_padding() -> None:
    batch = np.full((2, 2, 4, 3), 255, dtype=np.uint8)
    out = padded_normalizer(np.array([1, 3]))(np, batch)
    assert out.shape == (2, 3, 2, 4) and out.dtype == np.float32
    np.testing.assert_array_equal(out[0, :, :, :1], 1.0)
    np.testing.assert_array_equal(out[0, :, :, 1:], 0.0)
    np.testing.assert_array_equal(out[1, :, :, 3:], 0.0)


def test_group_indices_keeps_first_seen_order() -> None:
    assert group_indices(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4], [3]]
    assert group_indices([]) == []


def test_a_drafted_jpeg_maps_to_its_full_size(predictor: OcrPredictor) -> None:
    # JPEG drafts decode at 1/2, 1/4 or 1/8 scale; `Decoded` keeps the full size.
    decoded = Decoded(Image.new("RGB", (400, 40), "white"), width=1600, height=160)
    page = predictor.detection.page(decoded)
    assert page.image.shape == (100, 400, 3)  # 10:1 is wider than 8:1: padded to 2 × 400 / 8
    assert (page.top, page.scale_x, page.scale_y) == (30, 4.0, 4.0)
    assert (page.width, page.height) == (1600, 160)


def test_to_original_removes_padding_and_scales() -> None:
    image = np.zeros((1, 1, 3), np.uint8)
    page = Page(image, top=10, scale_x=2.0, scale_y=0.5, width=100, height=40)
    boxes = np.array([[[5, 10], [60, 15], [60, 200], [5, 30]]], dtype=np.float32)
    expected = np.array([[[10, 0], [100, 2.5], [100, 40], [10, 10]]])  # x clipped at 100
    np.testing.assert_allclose(to_original(boxes, page), expected)

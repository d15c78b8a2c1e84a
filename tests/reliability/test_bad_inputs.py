"""A corpus of broken, hostile and odd files through the real API and worker, in one job.

Every broken file fails its own item with a sentence; every odd but valid file succeeds; the
worker survives it all and takes the next job.
"""

from __future__ import annotations

import httpx
import imagehash
import pytest

from devstack.images import photo
from devstack.jobs import wait_closed
from devstack.services import Process
from tests.reliability.corpus import BAD, ODD
from tests.reliability.jobs import items_by_key, sentence_problem, upload

NOT_READABLE = "The file is neither an image nor a video Kiln can read."

# The odd files that show `landmark()` upright (see corpus.py): their hashes must agree.
UPRIGHT = ("upright.jpg", "exif-rotated.jpg", "cmyk.jpg", "grey-16-bit.png", "animated.gif")
SAME_PICTURE_BITS = 6  # phash distance of re-encodings of one picture (0 measured, some slack)
OTHER_PICTURE_BITS = 20  # …and of the same picture turned sideways (30 measured)


def run_corpus(client: httpx.Client, model: str) -> dict[str, dict]:
    files = {name: make() for name, make in {**BAD, **ODD}.items()}
    response = upload(client, files, model=model)
    assert response.status_code == 202, response.text
    job = wait_closed(client, response.json()["id"], timeout=240)
    assert job["status"] == "completed", f"the job itself did not complete: {job}"
    assert job["counts"]["total"] == len(files)
    assert job["counts"]["failed"] == len(BAD), job["counts"]
    return items_by_key(client, job["id"])


def check_outcomes(items: dict[str, dict]) -> None:
    assert set(items) == set(BAD) | set(ODD)
    for name in BAD:
        item = items[name]
        assert item["status"] == "failed", f"{name} should fail, but is {item['status']}: {item}"
        problem = sentence_problem(item["error"])
        assert problem is None, f"{name}'s error {item['error']!r} is not a sentence: {problem}"
    for name in ODD:
        item = items[name]
        assert item["status"] == "succeeded", f"{name} is a valid image but {item}"
        assert item["attempts"] == 1, f"{name} took {item['attempts']} attempts"


def check_worker_still_works(client: httpx.Client, worker: Process, model: str) -> None:
    assert worker.alive(), "the worker process died on the corpus"
    response = upload(client, {"after-the-corpus.jpg": photo(99)}, model=model)
    assert response.status_code == 202, response.text
    job = wait_closed(client, response.json()["id"], timeout=120)
    assert (job["status"], job["counts"]["succeeded"]) == ("completed", 1), job


@pytest.fixture(scope="module")
def phash_items(client: httpx.Client) -> dict[str, dict]:
    return run_corpus(client, "phash")


def test_phash_fails_bad_files_with_a_sentence_and_reads_odd_ones(
    client: httpx.Client, worker: Process, phash_items: dict[str, dict]
) -> None:
    check_outcomes(phash_items)
    check_worker_still_works(client, worker, "phash")


def test_bomb_errors_name_the_limit(phash_items: dict[str, dict]) -> None:
    for name in ("bomb.png", "bomb.gif", "huge-header.png", "huge-header.jpg"):
        error = phash_items[name]["error"]
        assert "50,000,000" in error, f"{name}: {error!r} should name the pixel limit"
    assert phash_items["empty.jpg"]["error"] == "The file is empty."
    for name in ("text.jpg", "page.html", "archive.zip"):
        assert phash_items[name]["error"] == NOT_READABLE, name


def test_odd_files_are_read_as_the_picture_they_show(phash_items: dict[str, dict]) -> None:
    """EXIF orientation applied, CMYK and 16-bit levels kept, a GIF's first frame taken: each
    hashes as the upright picture, which the same pixels turned sideways do not."""

    def bits(a: str, b: str) -> int:
        hashes = (imagehash.hex_to_hash(phash_items[k]["outputs"]["phash"]) for k in (a, b))
        return int(next(hashes) - next(hashes))

    for name in UPRIGHT[1:]:
        distance = bits(name, "upright.jpg")
        assert distance <= SAME_PICTURE_BITS, f"{name} hashes {distance} bits from the upright one"
    distance = bits("sideways.jpg", "upright.jpg")
    assert distance >= OTHER_PICTURE_BITS, f"turned sideways, only {distance} bits apart"
    assert phash_items["one-pixel.png"]["outputs"]["phash"]


def test_detector_survives_the_corpus(client: httpx.Client, worker: Process) -> None:
    items = run_corpus(client, "detector")
    check_outcomes(items)
    for name in ODD:
        assert isinstance(items[name]["outputs"]["detections"], list), items[name]
    check_worker_still_works(client, worker, "detector")

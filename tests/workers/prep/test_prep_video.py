"""Videos through a prep process's `PrepWorker` (run here on the test's thread, as `InlinePrep`
does): an item that turns out to be a video comes back planned; the frame items of a video are
decoded by the process's readers into the engine's slots; a bad frame fails alone."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from kiln.app.core.config import Settings
from kiln.app.storage.local import LocalStore
from kiln.app.video import Sampling, VideoLimits
from kiln.workers.models.phash import PhashPredictor
from kiln.workers.prep.fetch import Fetcher
from kiln.workers.prep.process import PrepWorker
from kiln.workers.prep.settings import PrepSettings
from kiln.workers.prep.slots import SlotPool
from kiln.workers.prep.spec import PrepSpec, prep_spec
from kiln.workers.prep.units import Prepped, Unit
from kiln.workers.prep.video import FramePlan, plan
from tests.support import migrated_settings
from tests.videos import cut, numbered, plain

TEXTS = prep_spec("tests.workers.prep.stand_ins:TextPrep", {})
LIMITS = VideoLimits(max_frames=100_000, max_duration_s=24 * 3600.0)
TWO_FPS = Sampling(2.0, LIMITS)


def level(number: int) -> int:
    return (7 * number) % 256


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(tmp_path, monkeypatch, local_inputs=True)


@pytest.fixture
def worker(settings: Settings) -> Iterator[PrepWorker]:
    worker = PrepWorker(PrepSettings.of(settings))
    yield worker
    worker.close()


@pytest.fixture
def phash(settings: Settings) -> PrepSpec:
    """The built-in phash model's prep: a 32×32 greyscale slot per item."""
    return PhashPredictor(max_pixels=settings.max_image_pixels).prep


@pytest.fixture
def slots(phash: PrepSpec) -> Iterator[SlotPool]:
    assert phash.layout is not None
    pool = SlotPool(phash.layout, 16, label="video")
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prep_videos")


@pytest.fixture(scope="module")
def grey_clip(folder: Path) -> Path:
    """3 s at 10 fps: frame i is grey level 7·i mod 256."""
    return plain(folder / "grey.mp4", 30)


@pytest.fixture(scope="module")
def cut_clip(folder: Path) -> Path:
    """A 30 s numbered clip with only its first 40 % of bytes."""
    return cut(numbered(folder / "numbered.mkv", 30), folder / "cut.mkv", 0.4)


def video_unit(spec: PrepSpec, *sources: str, max_bytes: int = 10**8, **kw: object) -> Unit:
    n = len(sources)
    return Unit(0, spec, list(range(n)), list(sources), [None] * n, max_bytes, **kw)  # type: ignore[arg-type]


def frames_unit(
    spec: PrepSpec, source: str, times: list[float], pool: SlotPool | None, **kw: object
) -> tuple[Unit, np.ndarray | None]:
    n = len(times)
    unit = Unit(
        1, spec, list(range(100, 100 + n)), [source] * n, [None] * n, 10**8,
        frames=list(times), sampling=TWO_FPS, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    taken = None
    if pool is not None:
        taken = pool.acquire(n)
        assert taken is not None
        unit.slots, unit.segment, unit.segment_slots = taken, pool.name, pool.count
    return unit, taken


def png(grey: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (grey,) * 3).save(buffer, "PNG")
    return buffer.getvalue()


# --- a video item is planned ------------------------------------------------------------------


def test_a_video_item_comes_back_with_its_plan(
    worker: PrepWorker, phash: PrepSpec, grey_clip: Path
) -> None:
    answer = worker.run(video_unit(phash, grey_clip.as_uri(), sampling=TWO_FPS))
    assert isinstance(answer, Prepped)
    assert answer.errors == [None] and answer.transient is None
    assert answer.videos is not None and isinstance(answer.videos[0], FramePlan)
    made = answer.videos[0]
    assert made == plan(grey_clip, 2.0, LIMITS)
    assert made.times == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert made.indices == [0, 5, 10, 15, 20, 25]


def test_without_a_sampling_a_video_is_sampled_at_one_frame_a_second(
    worker: PrepWorker, phash: PrepSpec, grey_clip: Path
) -> None:
    answer = worker.run(video_unit(phash, grey_clip.as_uri()))
    assert answer.errors == [None] and answer.videos is not None
    assert answer.videos[0].times == [0.0, 1.0, 2.0]


def test_images_and_videos_in_one_unit(
    worker: PrepWorker, phash: PrepSpec, slots: SlotPool, grey_clip: Path, tmp_path: Path
) -> None:
    image = tmp_path / "grey.png"
    image.write_bytes(png(90))
    unit = video_unit(phash, image.as_uri(), grey_clip.as_uri(), sampling=TWO_FPS)
    taken = slots.acquire(2)
    assert taken is not None
    unit.slots, unit.segment, unit.segment_slots = taken, slots.name, slots.count
    answer = worker.run(unit)
    assert answer.errors == [None, None]
    assert answer.videos is not None and answer.videos[0] is None
    assert answer.videos[1] == plan(grey_clip, 2.0, LIMITS)
    assert np.abs(slots.gather(taken)[0].astype(int) - 90).max() <= 1  # the image, prepared


def test_a_video_over_a_limit_fails_with_a_sentence(
    worker: PrepWorker, phash: PrepSpec, grey_clip: Path
) -> None:
    few = Sampling(2.0, VideoLimits(max_frames=5, max_duration_s=3600.0))
    answer = worker.run(video_unit(phash, grey_clip.as_uri(), sampling=few))
    assert answer.errors[0] is not None
    assert "KILN_MAX_VIDEO_FRAMES" in answer.errors[0] and answer.errors[0].endswith(".")
    assert answer.videos is None or answer.videos[0] is None
    short = Sampling(1.0, VideoLimits(max_frames=100, max_duration_s=1.0))
    answer = worker.run(video_unit(phash, grey_clip.as_uri(), sampling=short))
    assert "KILN_MAX_VIDEO_DURATION_S" in (answer.errors[0] or "")


def test_a_text_that_begins_like_a_box_name_is_still_a_text(
    worker: PrepWorker, tmp_path: Path
) -> None:
    """Only a video is planned: a text file whose fifth to eighth bytes spell an MP4 box name
    ("free", "wide", "skip", "mdat", "moov") is prepared as the text it is."""
    path = tmp_path / "note.txt"
    path.write_text("I'm free to go.")
    answer = worker.run(video_unit(TEXTS, path.as_uri()))
    assert answer.errors == [None]
    assert answer.objects == ["I'M FREE TO GO."]


# --- frame items are decoded into slots -------------------------------------------------------


def test_frames_are_decoded_into_their_slots(
    worker: PrepWorker, phash: PrepSpec, slots: SlotPool, grey_clip: Path
) -> None:
    times = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 2.9]
    unit, taken = frames_unit(phash, grey_clip.as_uri(), times, slots)
    answer = worker.run(unit)
    assert answer.errors == [None] * len(times)
    assert answer.transient is None
    assert taken is not None
    pixels = slots.gather(taken).astype(int)
    assert pixels.shape == (len(times), 32, 32)
    for k, t in enumerate(times):  # each slot holds its own frame: a flat grey of its level
        assert abs(pixels[k].mean() - level(round(t * 10))) <= 3, t
    assert len({round(float(p.mean())) for p in pixels}) == len(times)  # all different
    assert answer.seconds is not None and answer.seconds.shape == (len(times), 2)


def test_a_later_unit_of_the_same_video_continues_in_the_same_reader(
    worker: PrepWorker, phash: PrepSpec, slots: SlotPool, grey_clip: Path
) -> None:
    first, _ = frames_unit(phash, grey_clip.as_uri(), [0.0, 0.5, 1.0], slots)
    assert worker.run(first).errors == [None] * 3
    second, taken_second = frames_unit(phash, grey_clip.as_uri(), [1.5, 2.0, 2.5], slots)
    assert worker.run(second).errors == [None] * 3
    assert worker.videos.readers_of(grey_clip.as_uri()) == 1
    reader = worker.videos.reader(grey_clip.as_uri(), 2.6, grey_clip)
    assert reader.seeks == 1  # one seek for both units: the second read on
    assert taken_second is not None
    got = [round(float(p.mean())) for p in slots.gather(taken_second)]
    assert got == pytest.approx([level(15), level(20), level(25)], abs=3)


def cut_sentence(path: Path, fps: float) -> tuple[float, str]:
    """Where the decodable frames of a cut file end (by PyAV alone), and what the frames after
    that fail with."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        pts: list[int] = []
        try:
            for frame in container.decode(stream):
                if frame.pts is not None:
                    pts.append(frame.pts)
        except av.error.FFmpegError:  # the cut: what decoded so far
            pass
        end = (max(pts) - min(pts)) * float(stream.time_base or 0) + 0.1
    lost = 60 - math.ceil(end * fps - 1e-9)  # the header says 30 s: 60 moments at 2 fps
    return end, f"The video ends at {end:.1f} s; {lost} sampled frames after it were not decodable."


def test_frames_past_a_cut_fail_and_the_others_succeed(
    worker: PrepWorker, phash: PrepSpec, slots: SlotPool, cut_clip: Path
) -> None:
    end, sentence = cut_sentence(cut_clip, 2.0)
    assert 3.0 < end < 27.0
    times = [0.0, 1.0, math.floor(end) - 1.0, math.ceil(end) + 1.0, 29.5]
    unit, _taken = frames_unit(phash, cut_clip.as_uri(), times, slots)
    answer = worker.run(unit)
    assert answer.errors[:3] == [None, None, None]
    assert answer.errors[3:] == [sentence, sentence]
    assert re.fullmatch(r"The video ends at \d+\.\d s; \d+ sampled frames after it were not "
                        r"decodable\.", sentence)  # fmt: skip


def test_a_text_model_fails_frames_with_a_sentence(worker: PrepWorker, grey_clip: Path) -> None:
    unit, _ = frames_unit(TEXTS, grey_clip.as_uri(), [0.0, 1.0], None)
    answer = worker.run(unit)
    assert answer.errors == ["This model takes text, not video frames."] * 2
    assert answer.transient is None


def test_a_frame_of_a_missing_video_fails_with_a_sentence(
    worker: PrepWorker, phash: PrepSpec, slots: SlotPool, tmp_path: Path
) -> None:
    unit, _ = frames_unit(phash, (tmp_path / "gone.mp4").as_uri(), [0.0], slots)
    answer = worker.run(unit)
    assert answer.errors[0] == f"There is no file at {tmp_path / 'gone.mp4'}."
    assert answer.transient is None


# --- videos in Kiln's store -------------------------------------------------------------------


@pytest.fixture
def store(settings: Settings) -> LocalStore:
    return LocalStore.from_url(settings.storage_url)


def store_worker(settings: Settings, store: LocalStore) -> PrepWorker:
    return PrepWorker(PrepSettings.of(settings), Fetcher(PrepSettings.of(settings), store))


def test_a_stored_video_over_the_upload_limit_fails_with_a_sentence(
    settings: Settings, store: LocalStore, phash: PrepSpec, slots: SlotPool, grey_clip: Path
) -> None:
    data = grey_clip.read_bytes()
    limit = len(data) - 1
    settings = settings.model_copy(update={"max_upload_bytes": limit})
    store.put("jobs/j/inputs/000000", data)
    worker = store_worker(settings, store)
    try:
        source = "store:jobs/j/inputs/000000"
        answer = worker.run(video_unit(phash, source, max_bytes=settings.max_upload_bytes))
        assert answer.errors == [f"The object is {len(data):,} bytes, over the {limit:,} limit."]
        assert answer.videos is None or answer.videos[0] is None
        unit, _ = frames_unit(phash, source, [0.0, 0.5], slots)
        unit.max_bytes = settings.max_upload_bytes
        answer = worker.run(unit)
        assert (
            answer.errors == [f"The object is {len(data):,} bytes, over the {limit:,} limit."] * 2
        )
    finally:
        worker.close()


def test_a_stored_video_is_fetched_once_for_its_plan_and_frames(
    settings: Settings, store: LocalStore, phash: PrepSpec, slots: SlotPool, grey_clip: Path
) -> None:
    store.put("jobs/j/inputs/000001", grey_clip.read_bytes())
    worker = store_worker(settings, store)
    try:
        source = "store:jobs/j/inputs/000001"
        answer = worker.run(video_unit(phash, source, sampling=TWO_FPS))
        assert answer.errors == [None] and answer.videos is not None
        assert answer.videos[0] == plan(grey_clip, 2.0, LIMITS)
        assert answer.sha256[0] is not None  # fetched bytes are hashed
        store.delete("jobs/j/inputs/000001")  # the process kept the bytes for the frames
        unit, taken = frames_unit(phash, source, [1.0, 2.0], slots)
        answer = worker.run(unit)
        assert answer.errors == [None, None]
        assert taken is not None
        got = [round(float(p.mean())) for p in slots.gather(taken)]
        assert got == pytest.approx([level(10), level(20)], abs=3)
    finally:
        worker.close()

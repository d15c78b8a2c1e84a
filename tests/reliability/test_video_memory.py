"""Memory stays flat over an hour of video: a prep process keeps one reader open on a video and
decodes on through it, unit after unit. Nothing per frame may be kept: after the first few
minutes of video (in which the decoder, its frame pool and the allocators reach their size),
reading the rest of the hour grows the process by no more than a few MB.

The hour is made here (160×120, 2 fps: 7,200 frames, a few seconds with x264's ultrafast);
reading it all takes a few seconds more."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from kiln.app.core.config import Settings
from kiln.app.video import Sampling, VideoLimits
from kiln.app.video.reader import VideoReader
from kiln.workers.models.phash import PhashPredictor
from kiln.workers.prep.process import PrepWorker
from kiln.workers.prep.settings import PrepSettings
from kiln.workers.prep.slots import SlotPool
from kiln.workers.prep.units import UNIT_ROWS, Unit
from kiln.workers.prep.video import decoded_frame, plan
from tests.support import migrated_settings
from tests.videos import plain

HOUR_S = 3600
FPS = 2
WARM_S = 300  # the first five minutes of video: what the decoder and allocators settle in
GROWTH_MIB = 30.0  # allowed growth over the other 55 minutes (a leaked 160×120 frame: 56 KiB)
LIMITS = VideoLimits(max_frames=100_000, max_duration_s=24 * 3600.0)


def rss_mib() -> float:
    return float(psutil.Process().memory_info().rss) / 2**20


@pytest.fixture(scope="module")
def hour(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hour")
    return plain(folder / "hour.mp4", HOUR_S * FPS, fps=FPS, size=(160, 120))


@pytest.mark.timeout(600)
def test_the_plan_of_an_hour(hour: Path) -> None:
    made = plan(hour, 1.0, LIMITS)
    assert len(made.times) == 3600
    assert made.times[0] == 0.0 and made.times[-1] == 3599.0
    assert made.indices[:3] == [0, 2, 4] and made.indices[-1] == 7198
    assert made.duration_s == pytest.approx(3600.0, abs=0.6)
    assert len(plan(hour, 0.0, LIMITS).times) == 7200


@pytest.mark.timeout(600)
def test_one_reader_over_an_hour_stays_flat(hour: Path) -> None:
    reader = VideoReader(hour)
    try:
        times = reader.index.times
        assert len(times) == HOUR_S * FPS
        warm = None
        for i, t in enumerate(times):
            frame = reader.frame(t, 0.0)
            image = decoded_frame(frame, (64, 48)).image  # as a frame is handed to a prep
            assert image.size == (80, 60)
            if i % 600 == 0:  # every five minutes of video: the frame is the one shown then
                assert abs(float(np.asarray(image.convert("L")).mean()) - (7 * i) % 256) <= 3
            if t == WARM_S:
                warm = rss_mib()
        end = rss_mib()
        assert reader.seeks == 1  # decoded on, front to back
    finally:
        reader.close()
    assert warm is not None
    assert end - warm < GROWTH_MIB, f"RSS grew {end - warm:.1f} MiB over 55 min of video"


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(tmp_path, monkeypatch, local_inputs=True)


@pytest.fixture
def worker(settings: Settings) -> Iterator[PrepWorker]:
    worker = PrepWorker(PrepSettings.of(settings))
    yield worker
    worker.close()


@pytest.mark.timeout(600)
def test_a_prep_process_over_an_hour_of_frames_stays_flat(
    worker: PrepWorker, settings: Settings, hour: Path
) -> None:
    """Every frame of the hour as frame items, `UNIT_ROWS` a unit, into phash's slots: what a
    prep process does for a job that samples the video at its own rate."""
    spec = PhashPredictor(max_pixels=settings.max_image_pixels).prep
    assert spec.layout is not None
    pool = SlotPool(spec.layout, UNIT_ROWS, label="hour")
    source = hour.as_uri()
    times = plan(hour, float(FPS), LIMITS).times
    assert len(times) == HOUR_S * FPS
    warm = None
    try:
        for unit_id, first in enumerate(range(0, len(times), UNIT_ROWS)):
            chunk = times[first : first + UNIT_ROWS]
            n = len(chunk)
            taken = pool.acquire(n)
            assert taken is not None
            unit = Unit(
                unit_id, spec, list(range(first, first + n)), [source] * n, [None] * n,
                settings.max_upload_bytes, taken, pool.name, pool.count,
                frames=list(chunk), sampling=Sampling(float(FPS), LIMITS),
            )  # fmt: skip
            answer = worker.run(unit)
            assert answer.errors == [None] * n, answer.errors
            pixels = pool.gather(taken)
            k = first + n - 1  # the unit's last frame is the one shown at its time
            assert abs(float(pixels[n - 1].mean()) - (7 * k) % 256) <= 3
            pool.release(taken)
            if warm is None and chunk[-1] >= WARM_S:
                warm = rss_mib()
        end = rss_mib()
    finally:
        pool.close()
    assert warm is not None
    assert worker.videos.readers_of(source) == 1
    [(_, reader)] = worker.videos._open
    assert reader.seeks == 1  # one reader read on throughout
    assert end - warm < GROWTH_MIB, f"RSS grew {end - warm:.1f} MiB over 55 min of video"

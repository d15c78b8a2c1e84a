"""A video's frames through the API and the console on the embedded defaults: the thumbnail of a
frame item is its video's frame at that moment (a frame that cannot be decoded is a 404 with a
sentence), and the job page shows each video as a strip of its frames in time order, a page at
a time. The frames are made here as the worker's expansion makes them (workers/chunk/expand.py):
the video item taken out, one item per sampled moment with the video's source."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
from PIL import Image
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from kiln.app import video
from kiln.app.console import views
from kiln.app.db.items import NewItem, insert_items
from kiln.app.db.models import Item, ItemStatus
from kiln.app.db.session import unit_of_work
from tests.app.api.conftest import bearer
from tests.app.api.test_console import png, sign_in
from tests.videos import numbered

if TYPE_CHECKING:
    from fastapi.testclient import TestClient  # imported by the conftest, warnings quieted

SECONDS, FPS = 3, 10  # the clip: frame i shows the number i
SAMPLED = [k / 2 for k in range(8)]  # video_fps 2 over a header that promised 4 s: 3.0, 3.5 fail
ENDS = "The video ends at 3.0 s; 2 sampled frames after it were not decodable."


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    folder = tmp_path_factory.mktemp("clip")
    return numbered(folder / "clip.mp4", SECONDS, FPS, gop=10, faststart=True).read_bytes()


def upload(http: TestClient, key: str, files: dict[str, bytes]) -> str:
    answer = http.post(
        "/v1/jobs",
        headers=bearer(key),
        data={"model": "phash", "video_fps": "2"},
        files=[("files", (name, data, "application/octet-stream")) for name, data in files.items()],
    )
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def expand(sessions: sessionmaker[Session], job_id: str, key: str, times: list[float]) -> None:
    """Video item `key` becomes its frames: answered with a phash each, past the end failed."""
    with sessions() as session, unit_of_work(session):
        item = session.scalars(select(Item).where(Item.job_id == job_id, Item.key == key)).one()
        source = item.source
        session.execute(delete(Item).where(Item.id == item.id))
        frames = [
            NewItem(video.frame_key(key, t), 1, source, frame_index=round(t * FPS), frame_time_s=t)
            for t in times
        ]
        insert_items(session, job_id, frames)
        for t in times:
            ended = t >= SECONDS
            session.execute(
                update(Item)
                .where(Item.job_id == job_id, Item.key == video.frame_key(key, t))
                .values(
                    status=ItemStatus.FAILED if ended else ItemStatus.SUCCEEDED,
                    error=ENDS if ended else None,
                    frame_index=None if ended else round(t * FPS),
                    outputs=None if ended else {"phash": f"{round(t * FPS):016x}"},
                )
            )


@pytest.fixture
def acme_key(new_key: Callable[[str], str]) -> str:
    return new_key("acme")


@pytest.fixture
def browser(client: TestClient) -> TestClient:
    client.headers.pop("Authorization")
    return client


def thumbnail(http: TestClient, job_id: str, key: str, **params: str) -> tuple[int, bytes]:
    answer = http.get(f"/v1/jobs/{job_id}/thumbnail", params={"key": key, **params})
    return answer.status_code, answer.content


def test_a_frames_thumbnail_is_its_videos_frame_at_that_moment(
    client: TestClient, sessions: sessionmaker[Session], clip: bytes, acme_key: str
) -> None:
    job_id = upload(client, acme_key, {"clip.mp4": clip, "photo.png": png()})
    code, first = thumbnail(client, job_id, "clip.mp4")  # not yet split: its first frame
    assert code == 200 and Image.open(io.BytesIO(first)).size == (256, 192)
    expand(sessions, job_id, "clip.mp4", SAMPLED)

    code, data = thumbnail(client, job_id, "clip.mp4#t=1.500", max="160")
    assert code == 200
    with Image.open(io.BytesIO(data)) as image:
        assert (image.format, image.size) == ("JPEG", (160, 120))
    assert thumbnail(client, job_id, "photo.png")[0] == 200  # images as before

    answer = client.get(f"/v1/jobs/{job_id}/thumbnail", params={"key": "clip.mp4#t=3.500"})
    assert answer.status_code == 404
    assert answer.json()["detail"] == (
        "The video of item 'clip.mp4#t=3.500' ends at 3.0 s; it has no frame at 3.500 s."
    )


def test_a_frame_whose_video_is_not_one_is_a_sentence(
    client: TestClient, sessions: sessionmaker[Session], acme_key: str
) -> None:
    job_id = upload(client, acme_key, {"fake.mp4": b"\x00\x00\x00\x18ftypisom" + b"\x00" * 64})
    expand(sessions, job_id, "fake.mp4", [0.0])
    answer = client.get(f"/v1/jobs/{job_id}/thumbnail", params={"key": "fake.mp4#t=0.000"})
    assert answer.status_code == 422
    assert answer.json()["detail"].startswith(
        "The video of item 'fake.mp4#t=0.000' cannot be read as a video. The file is not a video "
        "Kiln can read ("
    )


def frame_times(page: str) -> list[str]:
    return re.findall(r'class="frame status-\w+" data-time="([\d.]+)"', page)


def test_the_job_page_shows_each_video_as_a_strip_in_time_order(
    browser: TestClient,
    sessions: sessionmaker[Session],
    clip: bytes,
    acme_key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(views, "STRIP_FRAMES", 5)
    monkeypatch.setattr(views, "VIDEOS_PAGE", 1)
    job_id = upload(browser, acme_key, {"a.mp4": clip, "b.mp4": clip, "photo.png": png()})
    expand(sessions, job_id, "a.mp4", SAMPLED)
    expand(sessions, job_id, "b.mp4", SAMPLED[:2])
    sign_in(browser, acme_key)

    page = browser.get(f"/console/jobs/{job_id}/items").text
    assert page.count('class="strip"') == 1  # a page of videos: one here
    assert 'data-video="a.mp4"' in page and "8 frames" in page and "2 failed" in page
    assert frame_times(page) == ["0.000", "0.500", "1.000", "1.500", "2.000"]
    assert ">t=0 s" in page and ">t=1.5 s" in page
    assert "phash 000000000000000f" in page  # the frame at 1.5 s: frame 15's answer
    assert page.count('class="item status-') == 1  # the photo, in the grid as before
    assert "photo.png" in page

    more = re.search(r'hx-get="(/console/jobs/[^"]+/frames\?[^"]+)"', page)
    assert more is not None
    rest = browser.get(more.group(1).replace("&amp;", "&")).text
    assert frame_times(rest) == ["2.500", "3.000", "3.500"]
    assert rest.count('<p class="sentence">The video ends at 3.0 s') == 2  # shown, not folded
    assert "More frames" not in rest  # the strip's end

    videos = re.search(r'hx-get="(/console/jobs/[^"]+/videos\?[^"]+)"', page)
    assert videos is not None
    second = browser.get(videos.group(1).replace("&amp;", "&")).text
    assert 'data-video="b.mp4"' in second and frame_times(second) == ["0.000", "0.500"]

    failed = browser.get(f"/console/jobs/{job_id}/items", params={"status": "failed"}).text
    assert frame_times(failed) == ["3.000", "3.500"] and "photo.png" not in failed


def test_another_tenant_sees_no_frames(
    browser: TestClient,
    sessions: sessionmaker[Session],
    clip: bytes,
    acme_key: str,
    new_key: Callable[[str], str],
) -> None:
    job_id = upload(browser, acme_key, {"a.mp4": clip})
    expand(sessions, job_id, "a.mp4", SAMPLED)
    sign_in(browser, new_key("globex"))
    params = {"source": "x", "video": "a.mp4", "t": "0", "after": "0"}
    assert browser.get(f"/console/jobs/{job_id}/frames", params=params).status_code == 404
    assert browser.get(f"/console/jobs/{job_id}/videos", params={"after": 0}).status_code == 404
    thumb = browser.get(f"/console/jobs/{job_id}/thumbnail", params={"key": "a.mp4#t=1.000"})
    assert thumb.status_code == 404


def test_a_job_of_images_alone_shows_its_grid_as_before(browser: TestClient, acme_key: str) -> None:
    job_id = upload(browser, acme_key, {"photo.png": png()})
    sign_in(browser, acme_key)
    page = browser.get(f"/console/jobs/{job_id}/items").text
    assert 'class="strip"' not in page and "photo.png" in page

"""A job of videos in the console, in a real headless Chromium against the real stack: each video
is a strip of its frames in time order, each with its moment and what the model read on it, a
page of frames at a time; a cut video's frames past the cut are marked failed with their
sentence in plain sight; the job's picture keeps its place in the grid."""

from __future__ import annotations

import io
import re
from pathlib import Path

import httpx
from PIL import Image, ImageChops, ImageStat
from playwright.sync_api import Page, expect

from devstack.images import photo
from tests.browser.conftest import Watched, key_of, screenshot, sign_in
from tests.integration.test_http_jobs import wait_done
from tests.videos import cut, number_frame, numbered

SECONDS, FPS, SAMPLED_FPS = 4, 10, 10  # every frame of the clip: 40 frames, frame i shows i
SIZE = (320, 240)
STRIP = 24  # frames a strip shows before "More frames" (app/console/views.py)


def submitted(client: httpx.Client, files: dict[str, bytes], fps: float) -> str:
    parts = [("files", (name, data, "video/mp4")) for name, data in files.items()]
    answer = client.post("/v1/jobs", data={"model": "ocr", "video_fps": str(fps)}, files=parts)
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def shown_number(data: bytes, candidates: range) -> int:
    """Which numbered frame a thumbnail shows: the one it differs from least."""
    got = Image.open(io.BytesIO(data)).convert("L")

    def distance(n: int) -> float:
        drawn = number_frame(n, *SIZE).convert("L").resize(got.size)
        return float(ImageStat.Stat(ImageChops.difference(got, drawn)).mean[0])

    return min(candidates, key=distance)


def visible_thumbs_loaded(page: Page, timeout_ms: int = 30_000) -> None:
    """Every thumbnail in the viewport has loaded (those scrolled out of a strip load lazily).
    Polled: the console's Content-Security-Policy forbids `wait_for_function`'s eval."""
    check = """() => [...document.querySelectorAll('img.thumb')].filter(i => {
        const r = i.getBoundingClientRect();
        return r.right > 0 && r.left < innerWidth && r.bottom > 0 && r.top < innerHeight;
    }).every(i => i.complete && i.naturalWidth > 0)"""
    waited = 0
    while not page.evaluate(check):
        assert waited < timeout_ms, "thumbnails still loading"
        page.wait_for_timeout(100)
        waited += 100


def test_each_video_is_a_strip_of_its_frames_in_time_order(
    watched: Watched, api_url: str, client: httpx.Client, tmp_path: Path, log_dir: Path
) -> None:
    clip = numbered(tmp_path / "clip.mp4", SECONDS, FPS, SIZE, gop=10, faststart=True)
    short = cut(clip, tmp_path / "cut.mp4", 0.6)  # its header still says 4 s
    files = {"clip.mp4": clip.read_bytes(), "cut.mp4": short.read_bytes(), "scan.jpg": photo(7)}
    job_id = submitted(client, files, SAMPLED_FPS)
    job = wait_done(client, job_id, timeout=300)
    assert job["status"] == "completed", job
    page = watched.page
    sign_in(page, api_url, key_of(client))
    page.goto(f"{api_url}/console/jobs/{job_id}")

    strip = page.locator("section.strip[data-video='clip.mp4']")
    frames = strip.locator("figure.frame")
    expect(frames).to_have_count(STRIP)  # a page of frames, then a control for more
    expect(strip.locator("h3")).to_contain_text(f"{SECONDS * FPS} frames")
    times = [f"t={t / SAMPLED_FPS:.3f}".rstrip("0").rstrip(".") + " s" for t in range(STRIP)]
    expect(frames.locator(".time")).to_have_text(times)  # t=0 s, t=0.1 s, … in time order
    texts = frames.locator("pre.ocr").all_inner_texts()
    read = sum(text.strip() == str(n) for n, text in enumerate(texts))
    assert read >= STRIP - 2, texts  # OCR read each frame's own number (a digit may slip)
    visible_thumbs_loaded(page)
    src = str(frames.nth(15).locator("img.thumb").get_attribute("src"))
    assert shown_number(page.request.get(f"{api_url}{src}").body(), range(40)) == 15

    more = strip.locator("button.more-frames")
    more.scroll_into_view_if_needed()  # the strip's end
    visible_thumbs_loaded(page)
    screenshot(page, "job-video-strip-end", log_dir)
    more.click()
    expect(frames).to_have_count(SECONDS * FPS)  # added to the same strip, in order
    expect(strip.locator("button.more-frames")).to_have_count(0)
    expect(frames.nth(STRIP).locator(".time")).to_have_text(f"t={STRIP / SAMPLED_FPS:g} s")
    expect(frames.last.locator(".time")).to_have_text("t=3.9 s")
    stamps = [float(t) for t in frames.evaluate_all("f => f.map(e => e.dataset.time)")]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)

    broken = page.locator("section.strip[data-video='cut.mp4']")
    expect(broken.locator("h3 .status-failed")).to_contain_text("failed")
    broken.locator("button.more-frames").click()  # the cut is past the first page of frames
    expect(broken.locator("figure.frame")).to_have_count(SECONDS * FPS)
    failed = broken.locator("figure.frame.status-failed")
    # the cut's last, partial packet is a damaged frame; the moments after it are past the end
    sentence = failed.last.locator(".sentence")
    expect(sentence).to_contain_text(re.compile(r"^The video ends at 2\.\d s; \d+ sampled"))
    failed.last.scroll_into_view_if_needed()
    expect(sentence).to_be_visible()  # in plain sight, not folded away
    expect(failed.locator(".sentence")).to_have_count(failed.count())  # every one says why
    expect(failed.last.locator(".time .status")).to_have_text("failed")
    expect(failed.last.locator("img.thumb")).to_have_count(0)  # no picture: a marked box
    ok = broken.locator("figure.frame.status-succeeded")
    assert ok.count() > 0 and failed.count() > 0
    assert ok.count() + failed.count() == SECONDS * FPS

    grid = page.locator("#items .grid figure.item")
    expect(grid).to_have_count(1)  # the picture, as before
    expect(grid.locator(".key")).to_have_text("scan.jpg")

    page.locator("section.strip[data-video='clip.mp4'] .frames").evaluate("e => e.scrollLeft = 0")
    page.locator("#items").scroll_into_view_if_needed()
    visible_thumbs_loaded(page)
    screenshot(page, "job-video-strips", log_dir, full_page=True)
    assert not watched.problems

"""The console in a real headless Chromium against the real stack: sign in and out, a job
watched from running to completed without a reload, a failed item's sentence, detector boxes,
cancel, tenant isolation, XSS and CSRF, the fleet, try-a-model, duplicate groups."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import httpx
from PIL import Image, ImageChops
from playwright.sync_api import Page, expect

from devstack.images import near_copy, photo, words
from tests.browser.conftest import Watched, key_of, screenshot, sign_in, thumbs_loaded
from tests.integration.test_bulk import put_objects, run_pipeline
from tests.integration.test_http_jobs import upload, wait_done
from tests.stack import SOURCE_BUCKET
from tests.workers.models.yolo import LABELS, SIZE, tiny_yolo

OPEN = ("queued", "running", "listing")


def submitted(client: httpx.Client, files: dict[str, bytes], model: str) -> str:
    response = upload(client, files, model=model)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def mark(page: Page) -> None:
    """A value that survives only while the page is not reloaded."""
    page.evaluate("window.kilnTestMark = 'still here'")


def not_reloaded(page: Page) -> bool:
    return bool(page.evaluate("window.kilnTestMark === 'still here'"))


def test_sign_in_and_out(watched: Watched, api_url: str, client: httpx.Client) -> None:
    page = watched.page
    page.goto(f"{api_url}/console/")
    expect(page).to_have_url(re.compile(r".*/console/login$"))  # signed out: to sign-in
    page.fill("input[name=key]", "kiln_nope_not-a-key")
    page.click("form button[type=submit]")
    expect(page.get_by_role("alert")).to_contain_text("not one Kiln knows")

    sign_in(page, api_url, key_of(client))
    expect(page.locator("h1")).to_have_text("Jobs")
    (cookie,) = [c for c in page.context.cookies() if c["name"] == "kiln_console"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Lax"
    assert key_of(client) not in cookie["value"] and key_of(client) not in page.content()

    page.click("form.signout button")
    expect(page).to_have_url(re.compile(r".*/console/login$"))
    page.goto(f"{api_url}/console/")
    expect(page).to_have_url(re.compile(r".*/console/login$"))
    assert not watched.problems


def test_a_job_runs_to_completion_without_a_reload(
    watched: Watched, api_url: str, client: httpx.Client, log_dir: Path
) -> None:
    page = watched.page
    sign_in(page, api_url, key_of(client))
    job_id = submitted(client, {f"scan-{i:02d}.jpg": photo(700 + i) for i in range(40)}, "ocr")
    page.goto(f"{api_url}/console/jobs/{job_id}")  # at once: 40 OCR items take seconds
    mark(page)
    assert page.locator("#summary").get_attribute("data-status") in OPEN
    expect(page.locator("#summary")).to_have_attribute("data-status", "completed", timeout=120_000)
    expect(page.locator("#items figure.item")).to_have_count(40)  # reloaded on its close
    assert not_reloaded(page)
    expect(page.locator("#summary dl")).to_contain_text("40")

    page.goto(f"{api_url}/console/")
    mark(page)
    listed = submitted(client, {f"more-{i:02d}.jpg": photo(800 + i) for i in range(8)}, "ocr")
    row = page.locator(f"tr[data-job='{listed}']")
    expect(row).to_be_visible(timeout=15_000)  # the list refreshed itself
    expect(row).to_have_attribute("data-status", "completed", timeout=120_000)
    assert not_reloaded(page)
    expect(page.locator(f"tr[data-job='{job_id}']")).to_have_attribute("data-status", "completed")
    screenshot(page, "jobs", log_dir)
    assert not watched.problems


def test_a_failed_item_shows_its_sentence(
    watched: Watched, api_url: str, client: httpx.Client, log_dir: Path
) -> None:
    """In its picture's place: no thumbnail is asked for (it would answer 422, drawn as a
    broken image)."""
    files = {"good.jpg": photo(1), "broken.jpg": b"this is not a picture"}
    job_id = submitted(client, files, "phash")
    wait_done(client, job_id)
    page = watched.page
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))
    sign_in(page, api_url, key_of(client))
    page.goto(f"{api_url}/console/jobs/{job_id}")
    expect(page.locator("#items figure.item")).to_have_count(2)
    thumbs_loaded(page)  # the good one's
    screenshot(page, "job-failed-item", log_dir, full_page=True)
    page.click("nav.filters a[data-status=failed]")
    card = page.locator("#items figure.item")
    expect(card).to_have_count(1)
    expect(card.locator(".key")).to_have_text("broken.jpg")
    sentence = card.locator(".no-picture .sentence")
    expect(sentence).to_be_visible()
    expect(sentence).to_contain_text("neither an image nor a video")
    expect(card.locator("img")).to_have_count(0)
    assert not [url for url in asked if "/thumbnail?" in url and "broken.jpg" in url]
    assert [url for url in asked if "/thumbnail?" in url and "good.jpg" in url]
    assert not watched.problems


def _register_yolo(client: httpx.Client, tmp_path: Path) -> str:
    path = tiny_yolo(tmp_path / "yolo.onnx")
    spec = {"input_size": SIZE, "labels": LABELS}
    form = {"name": "console-boxes", "kind": "detect", "spec": json.dumps(spec)}
    response = client.post("/v1/models", data=form, files=[("file", ("m.onnx", path.read_bytes()))])
    assert response.status_code == 201, response.text
    return str(response.json()["ref"])


def _purple(size: tuple[int, int] = (480, 360)) -> bytes:
    """Red and blue enough that the tiny detector finds both of its boxes."""
    buffer = io.BytesIO()
    image = Image.new("RGB", size, (210, 40, 190))
    image.paste((240, 60, 120), (40, 40, 200, 160))
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def test_detector_boxes_are_drawn_on_thumbnails(
    watched: Watched, api_url: str, client: httpx.Client, tmp_path: Path, log_dir: Path
) -> None:
    ref = _register_yolo(client, tmp_path)
    job_id = submitted(client, {f"frame-{i}.jpg": _purple() for i in range(3)}, ref)
    assert wait_done(client, job_id)["status"] == "completed"
    page = watched.page
    sign_in(page, api_url, key_of(client))
    page.goto(f"{api_url}/console/jobs/{job_id}")
    card = page.locator("#items figure.item").first
    expect(card.locator(".labels .label")).to_have_text(["red", "blue"])
    thumb = card.locator("img.thumb")
    expect(thumb).to_have_attribute("src", re.compile(r"boxes=1"))
    thumbs_loaded(page)

    src = str(thumb.get_attribute("src"))
    drawn = Image.open(io.BytesIO(page.request.get(f"{api_url}{src}").body())).convert("RGB")
    plain_src = src.replace("&boxes=1", "")
    plain = Image.open(io.BytesIO(page.request.get(f"{api_url}{plain_src}").body())).convert("RGB")
    assert drawn.size == plain.size
    changed = ImageChops.difference(drawn, plain).convert("L").point(lambda v: 255 if v > 60 else 0)
    assert changed.getbbox() is not None  # the boxes are on the drawn one only
    screenshot(page, "job-detector", log_dir, full_page=True)
    assert not watched.problems


def test_cancel_a_running_job(watched: Watched, api_url: str, client: httpx.Client) -> None:
    job_id = submitted(client, {f"page-{i:03d}.jpg": photo(900 + i) for i in range(80)}, "ocr")
    page = watched.page
    sign_in(page, api_url, key_of(client))
    page.goto(f"{api_url}/console/jobs/{job_id}")
    page.click("details.cancel summary")
    page.click("details.cancel button.danger")
    expect(page.locator("#summary")).to_have_attribute("data-status", re.compile("cancell(ing|ed)"))
    job = wait_done(client, job_id, timeout=120)
    assert job["status"] == "cancelled" and job["counts"]["cancelled"] > 0
    assert not watched.problems


def test_another_tenant_sees_nothing_of_it(
    watched: Watched, api_url: str, client: httpx.Client, other_client: httpx.Client
) -> None:
    job_id = submitted(client, {"mine.jpg": photo(5)}, "phash")
    page = watched.page
    sign_in(page, api_url, key_of(other_client))
    expect(page.locator(f"tr[data-job='{job_id}']")).to_have_count(0)
    for path in ("", "/items", "/groups", "/results.parquet", "/thumbnail?key=mine.jpg"):
        answer = page.request.get(f"{api_url}/console/jobs/{job_id}{path}")
        assert answer.status == 404, (path, answer.status)
    page.goto(f"{api_url}/console/jobs/{job_id}")
    expect(page.get_by_role("alert")).to_contain_text(f"There is no job {job_id}")


def test_nothing_a_user_wrote_runs_as_script(
    watched: Watched, api_url: str, client: httpx.Client
) -> None:
    # A browser sends `"` in a file name as %22 (WHATWG multipart), so the quote that breaks
    # out of an attribute here is the single one.
    name = "'><img src=x onerror=window.kilnPwned=1>.png"
    files = {name: words("<script>window.kilnPwned=2</script>", size=(1200, 160))}
    job_id = submitted(client, files, "ocr")
    assert wait_done(client, job_id)["status"] == "completed"
    page = watched.page
    sign_in(page, api_url, key_of(client))
    for url in (f"/console/jobs/{job_id}", f"/console/try/{job_id}"):
        page.goto(f"{api_url}{url}")
        expect(page.locator(".key").first).to_have_text(name)  # shown as text, as written
        thumbs_loaded(page)
        page.wait_for_timeout(500)  # an injected image's error handler would have run by now
        assert page.evaluate("window.kilnPwned") is None
        assert page.locator("img[src=x]").count() == 0
    text = page.locator("pre.ocr").inner_text()
    assert "script" in text.lower()  # the OCR read the markup, and it stayed text


def test_a_forged_form_changes_nothing(
    watched: Watched, api_url: str, client: httpx.Client
) -> None:
    job_id = submitted(client, {f"p-{i:02d}.jpg": photo(950 + i) for i in range(40)}, "ocr")
    page = watched.page
    sign_in(page, api_url, key_of(client))
    page.goto(f"{api_url}/console/jobs/{job_id}")
    page.evaluate("document.querySelector('details.cancel input[name=csrf]').value = 'forged'")
    page.click("details.cancel summary")
    page.click("details.cancel button.danger")
    expect(page.get_by_role("alert")).to_contain_text("not sent by the console")
    # and a form posted from another site: the SameSite cookie is not sent with it
    page.goto("about:blank")
    page.set_content(
        f'<form method="post" action="{api_url}/console/jobs/{job_id}/cancel">'
        '<input name="csrf" value="x"><button>go</button></form>'
    )
    page.click("button")
    expect(page).to_have_url(re.compile(r".*/console/login$"))
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] != "cancelling" and job["counts"]["cancelled"] == 0
    wait_done(client, job_id, timeout=180)


def test_fleet_lists_the_worker(
    watched: Watched, api_url: str, client: httpx.Client, log_dir: Path
) -> None:
    wait_done(client, submitted(client, {"warm.jpg": photo(3)}, "phash"))  # a model loaded
    page = watched.page
    sign_in(page, api_url, key_of(client))
    page.goto(f"{api_url}/console/fleet")
    worker = page.locator("article.worker").first
    expect(worker).to_be_visible(timeout=20_000)
    expect(page.locator("article.worker table.models")).not_to_have_count(0, timeout=20_000)
    expect(page.locator("#fleet")).to_contain_text("phash")
    expect(worker.locator("h3 .rss")).to_contain_text(re.compile(r"RSS [\d,]+ MiB"))  # its memory
    expect(page.locator("td[data-queue]")).not_to_have_count(0)  # Redis answers queue lengths
    # no GPU on this host: no chart is drawn from figures NVML never gave
    expect(page.locator("#gpus .gpu-chart")).to_have_count(0)
    screenshot(page, "fleet", log_dir)
    assert not watched.problems


def test_try_a_model(watched: Watched, api_url: str, client: httpx.Client, tmp_path: Path) -> None:
    sign = tmp_path / "sign.png"
    sign.write_bytes(words("Kiln reads this"))
    page = watched.page
    sign_in(page, api_url, key_of(client))
    page.goto(f"{api_url}/console/try")
    page.select_option("select[name=model]", "ocr")
    page.set_input_files("input[name=files]", str(sign))
    expect(page.locator("#chosen")).to_have_text("sign.png")
    page.click("form.try button[type=submit]")
    expect(page.locator("#answer")).to_have_attribute("data-status", "completed", timeout=60_000)
    expect(page.locator("#answer pre.ocr")).to_contain_text(re.compile("reads", re.I))
    stages = page.locator("#answer table.stages th")
    expect(stages).to_have_text(["queue", "fetch", "decode", "engine", "post", "worker total"])
    assert not watched.problems


def test_duplicate_groups_side_by_side(
    watched: Watched, api_url: str, client: httpx.Client, log_dir: Path
) -> None:
    files: dict[str, bytes] = {}
    for seed in (11, 12, 13):
        original = photo(seed)
        files[f"photo-{seed}.jpg"] = original
        files[f"photo-{seed}-small.jpg"] = near_copy(original, scale=0.5)
        files[f"photo-{seed}-copy.jpg"] = original  # the same bytes
    files["alone.jpg"] = photo(99)
    job_id = submitted(client, files, "phash")
    assert wait_done(client, job_id)["status"] == "completed"
    page = watched.page
    sign_in(page, api_url, key_of(client))
    page.goto(f"{api_url}/console/jobs/{job_id}/groups")
    groups = page.locator("section.dup-group")
    expect(groups).to_have_count(3)
    for index in range(3):
        expect(groups.nth(index).locator("figure.member")).to_have_count(3)
    expect(page.locator("figure.member", has_text="alone.jpg")).to_have_count(0)
    expect(page.locator(".tag", has_text="identical bytes")).not_to_have_count(0)
    thumbs_loaded(page)
    screenshot(page, "groups", log_dir)
    assert not watched.problems


def test_an_incremental_rerun_reads_done_of_what_it_had_to_do(
    watched: Watched, api_url: str, client: httpx.Client, s3: Any, log_dir: Path
) -> None:
    """A pipeline's rerun with 3 objects to do and 8 left alone (7 unchanged, 1 deleted): the
    list and the job's page read 3 of 3, 100% — the console once counted the left-alone in
    done (367%) — and show the left-alone apart."""
    prefix = "browser-rerun/"
    keys = [f"{prefix}img-{i:02d}.jpg" for i in range(10)]
    put_objects(s3, keys, seed=3)
    assert run_pipeline(client, prefix, "browser-rerun")["status"] == "completed"
    put_objects(s3, [*keys[:2], f"{prefix}new.jpg"], seed=4)  # 2 changed, 1 new
    s3.delete_object(Bucket=SOURCE_BUCKET, Key=keys[-1])
    rerun = run_pipeline(client, prefix, "browser-rerun")
    assert (rerun["counts"]["total"], rerun["counts"]["skipped"]) == (3, 7)
    page = watched.page
    sign_in(page, api_url, key_of(client))
    row = page.locator(f"tr[data-job='{rerun['id']}']")
    expect(row.locator(".percent")).to_have_text("100%")
    expect(row.locator("td.num").first).to_contain_text("3 / 3")
    expect(row.locator(".left-alone")).to_have_text("7 unchanged, 1 deleted at source")
    screenshot(page, "jobs-rerun", log_dir)
    page.goto(f"{api_url}/console/jobs/{rerun['id']}")
    summary = page.locator("#summary")
    expect(summary.locator(".percent")).to_have_text("100%")
    expect(summary.locator(".left-alone dt")).to_have_text(
        ["Unchanged (not in total)", "Deleted at source (not in total)"]
    )
    expect(summary.locator(".left-alone dd")).to_have_text(["7", "1"])
    for percent in page.locator(".percent").all_inner_texts():
        assert float(percent.rstrip("%")) <= 100
    screenshot(page, "job-rerun", log_dir, full_page=True)
    assert not watched.problems

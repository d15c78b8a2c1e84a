"""`kiln run` in process: files read where they are, any number of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.images import solid
from tests.support import migrated_settings
from workers.embedded import run_embedded


def test_a_folder_larger_than_the_api_job_cap_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.png", "b.png", "sub/c.png"):
        (folder / name).write_bytes(solid((200, 30, 30)))
    settings = migrated_settings(tmp_path, monkeypatch, max_files_per_job=2)

    outcome = run_embedded(settings, str(folder), "detector")

    assert outcome.progress.job.status == "completed"
    assert outcome.progress.counts.succeeded == 3
    assert sorted(outcome.table.column("key").to_pylist()) == ["a.png", "b.png", "sub/c.png"]
    objects = Path(settings.storage_url.removeprefix("file://"))
    assert not list(objects.glob("jobs/*/inputs/*"))  # nothing was copied

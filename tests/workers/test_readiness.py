from pathlib import Path

from celery.signals import worker_ready, worker_shutting_down

from kiln.workers.ops.readiness import install, parse_models


def test_parse_models() -> None:
    assert parse_models(None) == [] and parse_models(" ocr, ,phash ") == ["ocr", "phash"]


def test_the_file_exists_from_warm_up_to_shutdown(tmp_path: Path) -> None:
    ready = tmp_path / "probe" / "ready"
    ready.parent.mkdir()
    ready.write_text("stale, from a previous run")
    warmed: list[str] = []

    def warm_up() -> list[str]:
        warmed.append("ocr")
        return ["ocr"]

    uninstall = install(ready, warm_up)
    try:
        assert not ready.exists()  # a restarted worker is not ready until it warmed up again
        worker_ready.send(sender=None)
        assert warmed == ["ocr"] and ready.read_text() == "ready ocr\n"
        worker_shutting_down.send(sender=None, sig="SIGTERM", how="Warm", exitcode=0)
        assert not ready.exists()
    finally:
        uninstall()
    worker_ready.send(sender=None)
    assert not ready.exists() and warmed == ["ocr"]

"""The console bench renders every page it times of a small job (each answer a 200). No
timing is asserted: the figures live in bench/README.md."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from bench.console import markdown, measure

pytestmark = pytest.mark.integration


def test_every_timed_page_renders_for_a_small_job(postgres_url: str) -> None:
    server = make_url(postgres_url).set(database="postgres").render_as_string(hide_password=False)
    result = measure(items=400, repeats=2, server=server)
    assert result["items"] == 400
    pages = result["pages"]
    assert {"job page", "items, failed only", "job summary (polled every 2 s)"} <= set(pages)
    assert all(f["bytes"] > 0 and f["p99_ms"] >= f["p50_ms"] > 0 for f in pages.values())
    assert "| job page |" in markdown(result)

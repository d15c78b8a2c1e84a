from __future__ import annotations

from kiln.app import sources


def test_an_upload_source_round_trips_its_key() -> None:
    source = sources.in_store("uploads/job/0-a.jpg")
    assert source == "store:uploads/job/0-a.jpg"
    assert sources.store_key(source) == "uploads/job/0-a.jpg"


def test_other_sources_are_not_in_the_store() -> None:
    assert sources.store_key("s3://bucket/store:x") is None
    assert sources.store_key("file:///tmp/a.jpg") is None

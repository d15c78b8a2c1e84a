"""Where item bytes come from: Kiln's store, and local files only for `kiln run`."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

from kiln.app.core.config import Settings
from kiln.app.core.errors import InputError
from kiln.app.storage.local import LocalStore
from kiln.workers.prep.fetch import Fetcher, _uri_path, read_file
from kiln.workers.prep.settings import PrepSettings
from tests.support import migrated_settings


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(tmp_path, monkeypatch)


def fetcher(settings: Settings, **overrides: object) -> Fetcher:
    settings = settings.model_copy(update=overrides)
    return Fetcher(PrepSettings.of(settings), LocalStore.from_url(settings.storage_url))


def test_store_objects(settings: Settings) -> None:
    f = fetcher(settings)
    f.store.put("jobs/j/inputs/000000", b"pixels")
    assert f.fetch("store:jobs/j/inputs/000000", 100) == b"pixels"


def test_local_files_only_when_allowed(settings: Settings, tmp_path: Path) -> None:
    path = tmp_path / "a b.jpg"
    path.write_bytes(b"jpeg bytes")
    with pytest.raises(InputError, match="cannot read"):
        fetcher(settings).fetch(path.as_uri(), 100)
    assert fetcher(settings, local_inputs=True).fetch(path.as_uri(), 100) == b"jpeg bytes"


def test_a_missing_local_file_is_an_input_error(settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="There is no file at"):
        fetcher(settings, local_inputs=True).fetch((tmp_path / "gone.jpg").as_uri(), 100)


def test_an_oversized_local_file_is_an_input_error(settings: Settings, tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    path.write_bytes(b"x" * 101)
    with pytest.raises(InputError, match="over the 100 limit"):
        fetcher(settings, local_inputs=True).fetch(path.as_uri(), 100)


@pytest.mark.parametrize("source", [None, "", "http://example.com/a.jpg", "/etc/passwd"])
def test_other_sources_are_input_errors(settings: Settings, source: str | None) -> None:
    with pytest.raises(InputError):
        fetcher(settings, local_inputs=True).fetch(source, 100)


def test_a_local_file_is_read_whole_in_one_go(tmp_path: Path) -> None:
    """`read_file`: a file as large as it says, exactly (one read); a folder is no file; a
    pipe (its size says 0) is read to its end, never far past the limit."""
    path = tmp_path / "exact.jpg"
    path.write_bytes(bytes(range(256)) * 300)
    assert read_file(path, 10**6) == bytes(range(256)) * 300
    (tmp_path / "empty").touch()
    assert read_file(tmp_path / "empty", 10) == b""
    with pytest.raises(InputError, match="There is no file at"):
        read_file(tmp_path, 10**6)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def write() -> None:
        with contextlib.suppress(BrokenPipeError):  # the reader stops past the limit
            fifo.write_bytes(b"y" * 3_000_000)

    writer = threading.Thread(target=write)
    writer.start()
    data = read_file(fifo, 10)
    assert 10 < len(data) <= 10 + 2**20  # the caller says it is over the limit
    writer.join(10)


@pytest.mark.parametrize(
    "uri",
    [
        Path("/data/a b#c?.jpg").as_uri(),
        "file:///x/y.jpg",
        "file:///x/y?z=1",
        "file:///x/y#frag",
        "file:///x/\ty",
        "file:///x;p/y",
        "file:////x",
        "file:///x/%20y",
    ],
)
def test_a_file_uri_path_is_what_urlparse_says(uri: str) -> None:
    assert _uri_path(uri) == urlparse(uri).path

"""`kiln run`'s inputs: the folder walk (os.scandir) finds the same files, in the same order,
under the same keys and URIs, as the pathlib walk it replaced (kept below as the reference)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kiln.app.core.errors import InputError
from kiln.app.sources import IMAGE_SUFFIXES, VIDEO_SUFFIXES
from kiln.app.video import HEAD_BYTES, container_of
from kiln.workers.embedded import collect_inputs, image_inputs

MP4_HEAD = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2"


def _reference(source: str) -> list[tuple[str, str]]:
    """(key, uri) of each input as the pathlib walk made them (rglob, is_file, resolve)."""

    def media(path: Path) -> bool:
        if path.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES:
            return True
        if path.name.startswith("."):
            return False
        with path.open("rb") as file:
            return container_of(file.read(HEAD_BYTES)) is not None

    path = Path(source)
    files = [p for p in path.rglob("*") if p.is_file() and media(p)] if path.is_dir() else [path]
    resolved = sorted(f.resolve() for f in files)
    root = Path(os.path.commonpath([f.parent for f in resolved]))
    return [(f.relative_to(root).as_posix(), f.as_uri()) for f in resolved]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Nested folders, names that sort differently by component than as strings, a hidden
    file and folder, files that are not media, a video known only by its bytes, links."""
    top = tmp_path / "in put"
    for name in [
        "a.jpg", "B.PNG", "a b/x.jpg", "a/b.jpg", "a/c/d/e.webp", "ü ñ/é.jpeg", ".hidden.jpg",
        ".dir/f.png", "..jpg", "a.", "notes.txt", "x/clip.mp4", "x/deep/%20#?.gif",
    ]:  # fmt: skip
        path = top / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\xff\xd8\xff" + bytes(8))
    (top / "x" / "movie").write_bytes(MP4_HEAD + bytes(64))  # a video by content alone
    (top / ".movie").write_bytes(MP4_HEAD + bytes(64))  # hidden: not looked into
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / "target.jpg").write_bytes(b"\xff\xd8\xff")
    (elsewhere / "sub" / "inside.jpg").write_bytes(b"\xff\xd8\xff")
    (top / "link.jpg").symlink_to(elsewhere / "target.jpg")  # counted, as where it points
    (top / "linked-folder").symlink_to(elsewhere / "sub")  # not entered
    (top / "broken.jpg").symlink_to(tmp_path / "nothing.jpg")  # not a file
    return top


def test_the_walk_finds_what_the_pathlib_walk_found_in_its_order(tree: Path) -> None:
    inputs = image_inputs(str(tree))
    assert [(i.key, i.uri) for i in inputs] == _reference(str(tree))
    keys = [i.key for i in inputs]  # relative to tmp_path: the link points out of the tree
    assert "elsewhere/target.jpg" in keys and "in put/x/movie" in keys
    assert not {"in put/.movie", "in put/notes.txt", "in put/broken.jpg"} & set(keys)
    assert not any("inside.jpg" in key for key in keys)  # the linked folder was not entered
    assert keys.index("in put/a/b.jpg") < keys.index("in put/a b/x.jpg")  # as pathlib sorts


def test_a_folder_through_a_link_and_a_single_file(tree: Path, tmp_path: Path) -> None:
    (tmp_path / "via").symlink_to(tree)
    assert [(i.key, i.uri) for i in image_inputs(str(tmp_path / "via"))] == _reference(str(tree))
    one = tree / "a b" / "x.jpg"
    assert [(i.key, i.uri) for i in image_inputs(str(one))] == _reference(str(one))
    assert collect_inputs(str(tree / "link.jpg")) == [str(tmp_path / "elsewhere" / "target.jpg")]


def test_links_resolve_as_realpath_resolves_them(tmp_path: Path) -> None:
    """Links relative and absolute, through a linked folder, to a link, to `..`: each input is
    where `os.path.realpath` says (the walk resolves a target's folder once, not per link)."""
    real = tmp_path / "real"
    (real / "deep").mkdir(parents=True)
    for name in ("a.jpg", "b.jpg", "deep/c.jpg"):
        (real / name).write_bytes(b"\xff\xd8\xff")
    (tmp_path / "via").symlink_to(real)
    links = tmp_path / "links"
    (links / "sub").mkdir(parents=True)
    (links / "abs.jpg").symlink_to(real / "a.jpg")
    (links / "rel.jpg").symlink_to("../real/b.jpg")
    (links / "sub" / "up.jpg").symlink_to("../../via/deep/c.jpg")  # through a linked folder
    (links / "chain.jpg").symlink_to("abs.jpg")  # a link to a link
    (links / "dots.jpg").symlink_to(tmp_path / "via" / "deep" / ".." / "a.jpg")
    found = collect_inputs(str(links))
    expected = sorted(
        (os.path.realpath(p) for p in links.rglob("*.jpg")), key=lambda f: f.split("/")
    )
    assert found == expected and len(found) == 5


def test_a_folder_with_nothing_to_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(InputError, match="No images or videos"):
        collect_inputs(str(tmp_path))


def test_twelve_thousand_files_are_walked_and_named_in_well_under_a_second(
    tmp_path: Path,
) -> None:
    for i in range(12_000):
        folder = tmp_path / f"part{i % 12}"
        folder.mkdir(exist_ok=True)
        (folder / f"img{i:05d}.jpg").write_bytes(b"")
    started = time.process_time()
    inputs = image_inputs(str(tmp_path))
    spent = time.process_time() - started
    assert len(inputs) == 12_000 and inputs[0].key == "part0/img00000.jpg"
    assert spent < 1.0, f"{spent:.2f} CPU s"  # ~0.1 s; the pathlib walk took ~0.55 s here

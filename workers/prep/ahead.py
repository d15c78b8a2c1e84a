"""`kiln run`'s prep processes, started ahead of its own start-up and as many as its inputs need.

A prep process spends ~0.2 s of CPU importing the prep side; `kiln run` spends ~1 s importing
its stack (the database, Celery, Arrow) before it submits anything. Started first, the prep
processes' imports run on the other cores while the run's own do, instead of after them,
before its first batch; the run's runtime takes them over (`WorkerRuntime.use_prep`). Under
`KILN_PREP_PROCESSES=auto` a small run — at most SMALL_RUN image files by their names, no
video — gets one: another would cost more start-up than it saves. A source that is not there,
or a count set to 0, starts none here (the runtime does as it always does).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.app.sources import IMAGE_SUFFIXES, VIDEO_SUFFIXES
from kiln.workers.prep.pool import Preparer, PrepPool, usable_cores

if TYPE_CHECKING:
    from kiln.app.core.config import Settings

SMALL_RUN = 64  # image files one prep process serves sooner than two would start


def local_settings(settings: Settings) -> Settings:
    """What `kiln run` runs with: the embedded stack, local files read where they are."""
    return settings.embedded().model_copy(update={"local_inputs": True})


def start_ahead(settings: Settings, source: str) -> Preparer | None:
    """The prep processes for a `kiln run` over `source`, starting now; None where none
    should start yet (see the module's docstring)."""
    count = prep_count(settings, source)
    return PrepPool(local_settings(settings), count) if count else None


def prep_count(settings: Settings, source: str) -> int:
    """As configured; under `auto` one for a small run, else one per usable core; 0 for a
    source that is not there (the run is refused before it needs any)."""
    path = Path(source)
    if not path.exists() and not any(c in source for c in "*?["):
        return 0
    if settings.prep_processes != "auto":
        return settings.prep_processes
    return 1 if few_images(source) else settings.prep_count(usable_cores())


def few_images(source: str, limit: int = SMALL_RUN) -> bool:
    """`source` (a folder, a file or a glob) names at most `limit` files, each an image by its
    suffix. Any other file might be a video (`kiln run` looks inside files of other names), so
    it answers False; it stops looking at the first such file or past `limit`."""
    path = Path(source)
    if path.is_file():
        return _image(path.name)
    files = (
        (entry.name for entry in walk_files(os.path.realpath(path)))
        if path.is_dir()
        else _globbed(path)
    )
    seen = 0
    for name in files:
        image = _image(name)
        if not image and name.startswith(".") and not _video(name):
            continue  # hidden, named as no medium: never an input
        seen += 1
        if seen > limit or not image:
            return False
    return True


def _image(name: str) -> bool:
    return Path(name).suffix.lower() in IMAGE_SUFFIXES


def _video(name: str) -> bool:
    return Path(name).suffix.lower() in VIDEO_SUFFIXES


def walk_files(root: str) -> Iterator[os.DirEntry[str]]:
    """The files under `root`, lazily, walked with `os.scandir` (one system call per folder,
    its entries' types with it: no stat per file). A link to a file counts; a linked folder is
    not entered; a folder that cannot be read is passed over."""
    folders = [root]
    while folders:
        try:
            with os.scandir(folders.pop()) as entries:
                for entry in entries:
                    if entry.is_dir():
                        if not entry.is_symlink():
                            folders.append(entry.path)
                    elif entry.is_file():
                        yield entry
        except OSError:
            continue


def _globbed(pattern: Path) -> Iterator[str]:
    root = Path(pattern.anchor) if pattern.is_absolute() else Path()
    try:
        matches = root.glob(str(pattern.relative_to(root)))
        yield from (p.name for p in matches if p.is_file())
    except ValueError:  # not a usable pattern: the run says why
        return

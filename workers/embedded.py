"""`kiln run`: everything in one process, on the embedded stack.

The same submit path and Celery task code as production, with a Celery worker running in a
thread of this process over kombu's filesystem transport: no server to start. Always on the
embedded stack (`Settings.embedded`), whatever service the environment names: the inputs are
local files, which only this process's own worker may read.

Start-up (issue 38): the prep processes may be started by the caller before this module is
even imported (`prep/ahead.py`) and handed in; the worker's thread stops within a tenth of a
second of being told (the embedded transport's reads are short).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote_from_bytes

import pyarrow as pa
from celery.worker import WorkController

from kiln.app import video
from kiln.app.catalog.catalog import ModelInfo, get_model
from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError, InputError, NotFoundError
from kiln.app.db.migrate import upgrade
from kiln.app.db.models import Job
from kiln.app.db.queries import is_open
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.dispatch.contract import QUEUES
from kiln.app.dispatch.producer import CeleryDispatcher
from kiln.app.jobs import jobs
from kiln.app.results import results
from kiln.app.sources import IMAGE_SUFFIXES, VIDEO_SUFFIXES
from kiln.app.storage import open_store
from kiln.workers.celery.app import KilnCelery, make_celery
from kiln.workers.chunk import warm as chunk_path
from kiln.workers.prep.ahead import local_settings, walk_files
from kiln.workers.prep.pool import Preparer
from kiln.workers.prep.slots import reclaim
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)

PROGRESS_S = 1.0  # the longest a progress report waits when no chunk finishes
CANCEL_WAIT_S = 30.0  # the longest a cancelled run waits for its job to close
DRAIN_S = 30.0  # the longest the worker's tasks in flight are waited for on the way out
STOP_S = 5.0  # the longest the worker's thread is waited for once told to stop (~0.1 s)
LOCAL_TENANT = "local"


class Interrupted(Exception):
    """The run was asked to stop before its job was submitted: nothing ran."""


@dataclass(frozen=True)
class RunOutcome:
    job_id: str
    progress: jobs.Progress
    table: pa.Table
    seconds: float
    cancelled: bool = False  # the run was asked to stop (`cancel`) and cancelled its job


def collect_inputs(source: str) -> list[str]:
    """A folder (recursively), a single file, or a glob pattern → image and video files, as
    resolved paths in pathlib's order (component by component). In a folder, a file of another
    name that begins as a video does is one too."""
    path = Path(source)
    if path.is_dir():
        files = _folder_media(os.path.realpath(path))
    elif path.is_file():
        files = [os.path.realpath(path)]
    else:
        files = [os.path.realpath(p) for p in _glob(path) if p.is_file()]
    if not files:
        _check_exists(source)
        raise InputError(f"No images or videos found at {source!r}.")
    return sorted(files, key=_components)


def _check_exists(source: str) -> None:
    """A path that is not there (and no glob) is refused with its own sentence."""
    if not Path(source).exists() and not any(c in source for c in "*?["):
        raise InputError(f"{source!r} does not exist; give a folder, an image file or a glob.")


def _components(path: str) -> list[str]:
    """How pathlib orders absolute paths: by their components (`a/b` before `a b/c`)."""
    return path.split("/")


def _folder_media(root: str) -> list[str]:
    """The media files under the resolved folder `root`, as `Path.rglob` finds them (`walk_files`:
    a link to a file counts, as where it points; a linked folder is not entered)."""
    folders: dict[str, str] = {}
    return [
        _link_target(entry.path, folders) if entry.is_symlink() else entry.path
        for entry in walk_files(root)
        if _media(entry.name, entry.path)
    ]


def _link_target(path: str, folders: dict[str, str]) -> str:
    """`os.path.realpath(path)` for a link to a file in a resolved folder: its target's folder
    resolved once per folder (`folders`, by the target's folder as written), not component by
    component for every link (~40 µs a link; a folder of links is a bench's usual input)."""
    # path strings throughout, no Path per file
    target = os.readlink(path)  # noqa: PTH115
    head, tail = os.path.split(os.path.join(os.path.dirname(path), target))  # noqa: PTH118,PTH120
    if tail in ("", ".", ".."):
        return os.path.realpath(path)
    real = folders.get(head)
    if real is None:
        real = folders[head] = os.path.realpath(head)
    found = os.path.join(real, tail)  # noqa: PTH118
    # a link to a link: resolved as realpath resolves it
    return os.path.realpath(found) if os.path.islink(found) else found  # noqa: PTH114


def _media(name: str, path: str) -> bool:
    dot = name.rfind(".")  # `Path.suffix`: the last dot's, unless it leads or ends the name
    suffix = name[dot:].lower() if 0 < dot < len(name) - 1 else ""
    if suffix in IMAGE_SUFFIXES or suffix in VIDEO_SUFFIXES:
        return True
    if name.startswith("."):
        return False
    try:
        with open(path, "rb") as file:  # noqa: PTH123 - a walk's path string, no Path per file
            return video.container_of(file.read(video.HEAD_BYTES)) is not None
    except OSError:
        return False


def _glob(pattern: Path) -> list[Path]:
    """pathlib globs relative patterns only: an absolute one is globbed from its root."""
    root = Path(pattern.anchor) if pattern.is_absolute() else Path()
    try:
        return list(root.glob(str(pattern.relative_to(root))))
    except ValueError as error:  # e.g. "**" inside a name
        raise InputError(f"{str(pattern)!r} is not a usable glob pattern: {error}.") from None


def image_inputs(source: str) -> list[jobs.InputRef]:
    """The files where they are (nothing copied, nothing held in memory); item keys are paths
    relative to their common folder (`sub/a.jpg`)."""
    files = collect_inputs(source)
    root = os.path.commonpath([os.path.dirname(f) for f in files])  # noqa: PTH120 - as above
    start = len(root) if root.endswith("/") else len(root) + 1
    # `Path.as_uri` and `Path.relative_to(root).as_posix()`, without a Path per file
    return [
        jobs.InputRef(uri="file://" + quote_from_bytes(os.fsencode(f)), key=f[start:])
        for f in files
    ]


def text_inputs(source: str) -> list[jobs.InputRef]:
    """A text file: every non-empty line is one input, named by its line number."""
    path = Path(source)
    if not path.is_file():
        raise InputError(f"{source!r} is not a file; a text model reads one input per line.")
    if path.suffix.lower() in IMAGE_SUFFIXES:
        raise InputError(
            f"{source!r} is an image; a text model reads a UTF-8 file with one input per line."
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise InputError(f"{source} is not UTF-8 text.") from None
    inputs = [
        jobs.InputRef(text=line, key=f"line-{number:06d}")
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not inputs:
        raise InputError(f"{source} has no non-empty line.")
    return inputs


def _model(settings: Settings, model: str, options: dict[str, Any]) -> ModelInfo:
    """The model, its options checked as the submit will check them: a run refused for either
    is refused before anything starts loading."""
    engine = make_engine(settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            info = get_model(session, model, LOCAL_TENANT)
            jobs.check_options(session, LOCAL_TENANT, info, options)
            return info
    except NotFoundError as error:
        raise InputError(str(error)) from None
    finally:
        engine.dispose()


@contextmanager
def _warming(runtime: WorkerRuntime, info: ModelInfo) -> Iterator[None]:
    """The model's engine (on a GPU its build and graph capture) and the prep processes, made on
    a thread while the folder is walked and the items inserted, rather than once the first
    chunk asks for them; and what the chunk path pays once (its statements' compiles, Arrow's
    first table), on a thread of its own: the first chunk takes its items before the model has
    loaded. Waited for on the way out, so nothing loads into a closed runtime."""

    def warm() -> None:
        try:
            runtime.models.runner(info)
        except Exception as error:  # recorded by the runners: the first chunk's items say why
            log.info("model %s did not load ahead of its job: %s", info.ref, error)

    threads = [
        threading.Thread(target=warm, name="kiln-warm-up", daemon=True),
        threading.Thread(
            target=chunk_path.warm, args=(runtime, info), name="kiln-warm-up-chunks", daemon=True
        ),
    ]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for thread in threads:
            thread.join()


@contextmanager
def embedded_worker(
    app: KilnCelery, concurrency: int, drain_s: Callable[[], float] = lambda: DRAIN_S
) -> Iterator[WorkController]:
    """A Celery worker on a thread of this process, stopped (warm) on exit, once its tasks
    in flight have finished or `drain_s()` (asked then) seconds have passed."""
    from celery.worker import state

    # The threads pool runs each task through `current_app`, which a pool thread takes from
    # the process default: make it this app, as `celery worker` and celery.contrib.testing do.
    app.set_default()
    worker = app.WorkController(
        pool_cls="threads",
        concurrency=concurrency,
        queues=list(QUEUES),
        hostname=f"embedded-{time.monotonic_ns()}@localhost",
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
        loglevel="WARNING",
    )
    state.should_terminate = None
    thread = threading.Thread(target=worker.start, name="kiln-embedded-worker", daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        _wait_idle(timeout=drain_s())
        # Stop as celery.contrib.testing does. The consumer looks between its broker reads,
        # which the embedded transport ends every WAKE_S (`fs_transport`), so the thread ends
        # in a tenth of a second and no worker of this run outlives it.
        state.should_terminate = 0
        thread.join(STOP_S)
        app.close_runtime()


def _in_flight() -> list[Any]:
    """The worker's tasks running now."""
    from celery.worker import state

    while True:
        try:
            return list(state.active_requests)
        except RuntimeError:  # a task began or ended while the set was copied
            continue


def _wait_done(requests: list[Any], timeout: float) -> None:
    """Until none of `requests` is running any more (or `timeout` passes)."""
    from celery.worker import state

    deadline = time.monotonic() + timeout
    while any(r in state.active_requests for r in requests) and time.monotonic() < deadline:
        time.sleep(0.02)


def _wait_idle(timeout: float) -> None:
    """Let tasks still running (e.g. the one that closed the job) finish and acknowledge."""
    from celery.worker import state

    deadline = time.monotonic() + timeout
    while state.active_requests and time.monotonic() < deadline:
        time.sleep(0.02)


def run_embedded(
    settings: Settings,
    source: str,
    model: str,
    on_progress: Callable[[jobs.Progress], None] = lambda _p: None,
    options: dict[str, Any] | None = None,
    cancel: threading.Event | None = None,
    prep: Preparer | None = None,
) -> RunOutcome:
    """Run `model` over `source` on the embedded stack under `settings.data_dir` (its URLs
    are not used) and collect the results. `cancel`, once set (`kiln run`'s Ctrl-C), cancels
    the job and waits at most CANCEL_WAIT_S for it to close; set before the job is
    submitted, it raises Interrupted instead. `prep`: prep processes started ahead
    (`prep.ahead.start_ahead`), which the run's runtime takes over and closes."""
    settings = settings.embedded()
    if cancel is not None and cancel.is_set():
        raise Interrupted
    upgrade(settings)
    reclaim()  # shared memory a killed run on this host could not unlink
    info = _model(settings, model, options or {})
    text = info.input == "text"
    # A text model's one file is read now; images are found while the model loads.
    inputs = text_inputs(source) if text else None
    _check_exists(source)
    settings = local_settings(settings)  # files are read in place
    app = make_celery(settings)
    store = open_store(settings)
    started = time.monotonic()
    stop = _Stop(cancel)
    with embedded_worker(app, settings.task_threads, drain_s=stop.drain_s):
        runtime = app.runtime()
        if prep is not None:
            runtime.use_prep(prep)
        with _warming(runtime, info):
            if inputs is None:
                inputs = image_inputs(source)
            if cancel is not None and cancel.is_set():
                raise Interrupted
            # The API's per-job cap does not apply to a local run.
            cap = max(len(inputs), settings.max_files_per_job)
            with runtime.sessions() as session:
                submitted = jobs.submit_job(
                    session,
                    store,
                    CeleryDispatcher(app),
                    settings.model_copy(update={"max_files_per_job": cap}),
                    jobs.JobRequest(
                        tenant=LOCAL_TENANT,
                        model=model,
                        inputs=inputs,
                        options=options,
                        local_files=not text,
                    ),
                )
                job_id = submitted.job.id
            report = _wait(runtime, job_id, on_progress, stop)
            if not stop.gave_up:
                # The summary's counts once the tasks running at the close have committed: the
                # read that saw the job close may come before the last chunk's counters do (on
                # SQLite its results' UPDATE commits on its own, the counters just after).
                _wait_done(_in_flight(), timeout=DRAIN_S)
                report = _read(runtime, job_id)
    return RunOutcome(
        job_id,
        report,
        results.combined_table(results.Place(store, results.results_prefix(job_id))),
        time.monotonic() - started,
        cancelled=stop.cancelled,
    )


class _Stop:
    """A run asked to stop: when its job was cancelled, and whether the wait gave up."""

    def __init__(self, requested: threading.Event | None) -> None:
        self.requested = requested
        self.deadline: float | None = None  # set when the stop is acted on
        self.cancelled = False  # the job was open then, and cancelled
        self.gave_up = False  # the job was still open at the deadline

    def drain_s(self) -> float:
        """Once the job was cancelled, the tasks left are the cancelled chunks' messages (they
        would run nothing) or runs the deadline already waited for: none is waited for."""
        return 0.0 if self.deadline is not None else DRAIN_S


def _wait(
    runtime: WorkerRuntime,
    job_id: str,
    on_progress: Callable[[jobs.Progress], None],
    stop: _Stop,
) -> jobs.Progress:
    """Until the job closes: woken as each chunk finishes (and once a second besides, for a
    close that is not a chunk's, or a stop asked for), one read of its progress each time.
    Asked to stop, the job is cancelled and waited for until CANCEL_WAIT_S after that."""
    seen = 0
    while True:
        if stop.deadline is None and stop.requested is not None and stop.requested.is_set():
            stop.cancelled = _cancel(runtime, job_id)
            stop.deadline = time.monotonic() + CANCEL_WAIT_S
        report = _read(runtime, job_id)
        on_progress(report)
        if not is_open(report.job):
            return report
        if stop.deadline is not None and time.monotonic() >= stop.deadline:
            stop.gave_up = True
            return report
        seen = runtime.chunk_stats.wait(seen, timeout=PROGRESS_S)


def _read(runtime: WorkerRuntime, job_id: str) -> jobs.Progress:
    with runtime.sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None  # this run made it
        return jobs.progress(session, job, jobs.LeaseTiming.of(runtime.settings))


def _cancel(runtime: WorkerRuntime, job_id: str) -> bool:
    """Cancel the job; False when it had closed on its own meanwhile."""
    with runtime.sessions() as session:
        try:
            jobs.cancel_job(session, LOCAL_TENANT, job_id)
        except ConflictError:
            return False
    return True

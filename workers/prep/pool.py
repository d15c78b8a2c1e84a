"""The prep processes of one worker, and what happens when one dies.

`PrepPool` starts `processes` interpreters with `spawn` (never a fork of a process that may hold
CUDA), sends each unit to the least busy one, and resolves one future per unit from one I/O
thread. A unit is written to its process's pipe without blocking, by the caller; what a full
pipe does not take waits in the process's outbox for the I/O thread, which writes it as the
pipe drains — so no caller, and never the thread that reads the answers, waits on a pipe, and
the engine process has one thread for all its prep processes, not one per process.

A prep process that dies — killed, out of memory, a decoder that crashed on a hostile file — is
replaced at once and the units it held are sent again; only the unit it was working on (the
first it was sent) is charged with the death: a unit that has stopped two processes is split
into its items, and an item that stops two processes alone fails with a sentence. So every item
ends exactly once, and one bad file never takes its chunk, its neighbours or its worker down. A
process silent on a unit for longer than `stuck_s` is killed and treated the same way.

`InlinePrep` runs the same units on the calling thread (`KILN_PREP_PROCESSES=0`): for tests,
debugging and the smallest hosts.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import multiprocessing
import os
import select
import signal
import socket
import struct
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Protocol

from kiln.app.core.config import Settings
from kiln.app.core.errors import TransientError
from kiln.workers.prep.fetch import Fetcher
from kiln.workers.prep.frames import FrameScheduler
from kiln.workers.prep.process import PrepWorker, serve
from kiln.workers.prep.settings import PrepSettings
from kiln.workers.prep.units import Prepped, Unit

log = logging.getLogger(__name__)

STUCK_FLOOR_S = 30.0
TRIES = 2  # prep processes a unit (an item alone) may stop before it is split (failed)


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity and its cgroup's CPU quota (a pod's
    limit), whichever is fewer — not the host's, which a container may see all of."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    quota = _cgroup_cpus()
    return max(1, min(cores, quota) if quota else cores)


def _cgroup_cpus() -> int | None:
    """cgroup v2's `cpu.max` as whole CPUs (rounded up), or None where unlimited or absent."""
    try:
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return math.ceil(int(limit) / int(period))
    except (OSError, ValueError):  # no cgroup v2 file, or "max": no quota
        return None


class PrepClosedError(TransientError):
    """The prep pool closed (the worker is stopping) with the unit unanswered."""


class Preparer(Protocol):
    """Where a chunk sends its units: the pool of prep processes, or `InlinePrep`."""

    processes: int
    replaced: int  # processes that died and were replaced
    frames: FrameScheduler  # which process decodes a chunk's run of video frames

    def pids(self) -> list[int]:
        """The prep processes' ids (none when prep runs on the chunk's thread)."""
        ...

    def start(self) -> None:
        """Start the processes now (once); the first unit starts them otherwise."""
        ...

    def submit(self, unit: Unit, prefer: int = -1) -> Future[Prepped]: ...

    def close(self) -> None: ...


@dataclass
class _Task:
    unit: Unit
    future: Future[Prepped]
    deaths: int = 0


@dataclass
class _Proc:
    id: int  # unique per process started (a replacement gets a new one)
    process: BaseProcess
    conn: Connection
    tasks: dict[int, _Task] = field(default_factory=dict)  # by unit id, in the order sent
    answered: float = field(default_factory=time.monotonic)
    dead: bool = False
    outbox: bytearray = field(default_factory=bytearray)  # framed units the pipe has not taken

    def __post_init__(self) -> None:
        # The same pipe (a socket pair) for writes that never block: `MSG_DONTWAIT` per send
        # leaves the descriptor blocking for `recv`, which reads a whole answer at once.
        self.sock = socket.socket(fileno=os.dup(self.conn.fileno()))

    def post(self, message: Any) -> None:
        """Queue `message` as `Connection.send` frames it, and write what the pipe takes now
        (the pool's lock is held: one writer at a time, frames in order)."""
        payload = ForkingPickler.dumps(message)
        self.outbox += struct.pack("!i", len(payload))
        self.outbox += payload
        self.flush()

    def flush(self) -> None:
        """Write what the pipe takes without waiting; a dead process's outbox is dropped (the
        I/O thread sees it die by its sentinel)."""
        try:
            while self.outbox:
                sent = self.sock.send(self.outbox, socket.MSG_DONTWAIT)
                del self.outbox[:sent]
        except BlockingIOError:
            pass
        except OSError:
            self.outbox.clear()

    def close(self) -> None:
        self.sock.close()
        self.conn.close()


class PrepPool:
    def __init__(
        self,
        settings: Settings,
        processes: int,
        stuck_s: float | None = None,
        start: bool = True,
    ) -> None:
        """`start`: start the processes now; else the first `start`, unit or frame claim does
        (a worker's runtime is built before it knows whether it will run a chunk)."""
        if processes < 1:
            raise ValueError("A prep pool needs at least one process; use InlinePrep for none.")
        self.settings, self.processes = settings, processes
        self.prep_settings = PrepSettings.of(settings)  # what crosses into the processes
        # A video decoder's threads in each process: the cores each has to itself (one where
        # there is a process per core, the default: threads on shared cores only contend).
        self.decoder_threads = max(1, usable_cores() // max(1, processes))
        # A unit is stuck past the batch deadline, but never under STUCK_FLOOR_S: a huge image
        # may take seconds to decode.
        self.stuck_s = stuck_s or max(STUCK_FLOOR_S, settings.batch_deadline_s)
        self._context = multiprocessing.get_context("spawn")
        self._ids = itertools.count(1)
        self._units = itertools.count(1)
        self._lock = threading.Lock()
        self._closing = False
        self._procs: list[_Proc] = []  # none until the pool starts
        self.frames = FrameScheduler(self._loads)
        self.replaced = 0  # processes that died and were replaced (a metric)
        self._wake_r, self._wake_w = os.pipe()  # tells the I/O thread an outbox has bytes
        os.set_blocking(self._wake_w, False)
        self._io = threading.Thread(target=self._serve, name="kiln-prep-io", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        with self._lock:
            self._begin()

    def _begin(self) -> None:
        """The processes and the I/O thread, once (the lock is held); none after a close."""
        if self._procs or self._closing:
            return
        self._procs = [self._start() for _ in range(self.processes)]
        self._io.start()
        log.info("%d prep processes started", self.processes)

    def _start(self) -> _Proc:
        ours, theirs = self._context.Pipe()
        number = next(self._ids)
        process = self._context.Process(
            target=serve, args=(theirs, self.prep_settings, os.getpid(), self.decoder_threads),
            name=f"kiln-prep-{number}", daemon=True,
        )  # fmt: skip
        process.start()
        theirs.close()
        return _Proc(number, process, ours)

    def pids(self) -> list[int]:
        with self._lock:
            return [p.process.pid for p in self._procs if p.process.pid is not None]

    # --- sending -------------------------------------------------------------------------

    def submit(self, unit: Unit, prefer: int = -1) -> Future[Prepped]:
        """Prepare `unit` in a prep process (`prefer`: the one that read its bytes)."""
        unit.id = next(self._units)
        task = _Task(unit, Future())
        self._send(task, prefer)
        return task.future

    def _loads(self) -> dict[int, int]:
        """The live processes by id, each with the units it holds, in order (for `frames`)."""
        with self._lock:
            self._begin()  # a frame claimed before any unit: its process must be known
            return {p.id: len(p.tasks) for p in self._procs if not p.dead}

    def _send(self, task: _Task, prefer: int = -1) -> None:
        with self._lock:
            if self._closing:
                task.future.set_exception(PrepClosedError("The worker is stopping."))
                return
            self._begin()
            live = [p for p in self._procs if not p.dead]
            proc = next((p for p in live if p.id == prefer), None)
            proc = proc or min(live, key=lambda p: len(p.tasks))
            if not proc.tasks:
                proc.answered = time.monotonic()  # its silence counts from now
            proc.tasks[task.unit.id] = task
            proc.post(task.unit)  # never blocks: what the pipe does not take waits in its outbox
            if proc.outbox:
                self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the thread is woken already
            os.write(self._wake_w, b"\0")

    # --- the I/O thread ------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._lock:
                if self._closing:
                    return
                procs = list(self._procs)
            try:
                self._serve_once(procs)
            except Exception:  # never let the one thread that answers every unit die
                log.exception("the prep I/O thread failed; going on")
                time.sleep(0.1)

    def _serve_once(self, procs: list[_Proc]) -> None:
        """Wait for an answer, a process's death, room in a pipe with bytes waiting, or a
        wake-up; handle what came; then look for processes stuck on a unit."""
        poller = select.poll()
        by_fd: dict[int, _Proc] = {}
        with self._lock:
            for proc in procs:
                writing = select.POLLOUT if proc.outbox and not proc.dead else 0
                poller.register(proc.conn.fileno(), select.POLLIN | writing)
                poller.register(proc.process.sentinel, select.POLLIN)
                by_fd[proc.conn.fileno()] = by_fd[proc.process.sentinel] = proc
        poller.register(self._wake_r, select.POLLIN)
        for fd, events in poller.poll(500):
            if fd == self._wake_r:
                os.read(self._wake_r, 4096)
                continue
            proc = by_fd[fd]
            if fd == proc.process.sentinel:
                self._died(proc)
                continue
            if events & select.POLLOUT:
                with self._lock:
                    proc.flush()
            readable = events & (select.POLLIN | select.POLLHUP | select.POLLERR)
            if readable and not self._receive(proc):
                self._died(proc)
        self._kill_stuck(procs)

    def _receive(self, proc: _Proc) -> bool:
        """One answer from `proc`; False when its pipe has closed (it died)."""
        try:
            answer: Prepped = proc.conn.recv()
        except (EOFError, OSError):
            return False
        answer.worker = proc.id  # a dead process's late answers too: its read bytes are gone
        with self._lock:
            task = proc.tasks.pop(answer.unit, None)
            proc.answered = time.monotonic()
        if task is not None and not task.future.done():
            task.future.set_result(answer)
        return True

    def _died(self, proc: _Proc) -> None:
        """Replace the process and send its units again (or split them, or fail the item)."""
        try:  # answers it sent before it died still count
            while not proc.dead and proc.conn.poll() and self._receive(proc):
                pass
        except (EOFError, OSError):
            pass
        with self._lock:
            if proc.dead or self._closing:
                return
            proc.dead = True
            tasks = list(proc.tasks.values())  # in the order sent: the first was in hand
            self._procs[self._procs.index(proc)] = self._start()
            self.replaced += 1
        proc.process.join(1)
        code = proc.process.exitcode
        log.warning(
            "prep process %s died (exit %s) holding %d units; replaced", proc.process.name,
            code, len(tasks),
        )  # fmt: skip
        with self._lock:
            proc.outbox.clear()
            proc.close()
        for position, task in enumerate(tasks):
            self._redo(task, code, charged=position == 0)

    def _redo(self, task: _Task, code: int | None, charged: bool = True) -> None:
        """Send a dead process's task again; `charged`: it was the unit in hand, so it may be
        what killed the process (the ones queued behind it were not started)."""
        task.deaths += charged
        if task.deaths < TRIES:
            self._send(task)
        elif len(task.unit) > 1:
            self._split(task)
        else:
            task.future.set_result(_stopped(task.unit, code))

    def _split(self, task: _Task) -> None:
        """Each item of a unit that keeps stopping its process, alone: the one at fault fails."""
        parts = [self.submit(task.unit.only(i)) for i in range(len(task.unit))]
        unit_id = task.unit.id

        def joined(_: Future[Prepped]) -> None:
            if all(p.done() for p in parts) and not task.future.done():
                failed = next((p.exception() for p in parts if p.exception()), None)
                if failed is not None:
                    task.future.set_exception(failed)
                else:
                    task.future.set_result(Prepped.join(unit_id, [p.result() for p in parts]))

        for part in parts:
            part.add_done_callback(joined)

    def _kill_stuck(self, procs: list[_Proc]) -> None:
        now = time.monotonic()
        for proc in procs:
            with self._lock:
                busy = bool(proc.tasks) and not proc.dead
                silent = now - proc.answered
            if busy and silent > self.stuck_s and proc.process.pid is not None:
                log.error(
                    "prep process %s has not answered for %.0f s; killing it",
                    proc.process.name, silent,
                )  # fmt: skip
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.process.pid, signal.SIGKILL)

    # --- stopping ------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            procs = list(self._procs)
        self.frames.close()
        self._wake()
        if self._io.ident is not None:  # started
            self._io.join(2)  # no answer is taken after this
        deadline = time.monotonic() + timeout
        for proc in procs:
            _tell_to_stop(proc, deadline)
        for proc in procs:
            proc.process.join(max(0.0, deadline - time.monotonic()))
            if proc.process.is_alive():
                proc.process.kill()
                proc.process.join(1)
            with self._lock:
                left = list(proc.tasks.values())
                proc.tasks.clear()
            for task in left:
                _settle(task.future, PrepClosedError("The worker is stopping."))
            proc.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _tell_to_stop(proc: _Proc, deadline: float) -> None:
    """None after the units it was sent (a unit half written is finished first): the process
    stops when it reaches it. Waits for room in the pipe until `deadline` at most (a process
    that never reads it is killed then)."""
    proc.post(None)
    if not proc.outbox:
        return
    with contextlib.suppress(OSError):
        proc.sock.settimeout(max(0.01, deadline - time.monotonic()))
        proc.sock.sendall(proc.outbox)
    proc.outbox.clear()


def _settle(future: Future[Prepped], error: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


def _stopped(unit: Unit, code: int | None) -> Prepped:
    """The answer for an item that stopped two prep processes: failed, with the reason."""
    how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
    sentence = (
        f"Preparing this input stopped Kiln's decoder process twice ({how}); the file is "
        "probably damaged or hostile, so it was not tried again."
    )
    return Prepped(unit.id, [sentence] * len(unit), [None] * len(unit))


class InlinePrep:
    """The same units on the calling thread: no processes (`KILN_PREP_PROCESSES=0`)."""

    processes = 0
    replaced = 0

    def __init__(self, settings: Settings, fetcher: Fetcher | None = None) -> None:
        self._worker = PrepWorker(
            PrepSettings.of(settings), fetcher, decoder_threads=usable_cores()
        )
        self._lock = threading.Lock()  # one worker: its caches are not thread-safe
        self._units = itertools.count(1)
        self.frames = FrameScheduler(dict)  # no processes: frames go anywhere

    def start(self) -> None:
        pass  # nothing to start: units run on the caller's thread

    def submit(self, unit: Unit, prefer: int = -1) -> Future[Prepped]:
        unit.id = next(self._units)
        future: Future[Prepped] = Future()
        with self._lock:
            future.set_result(self._worker.run(unit))
        return future

    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        self._worker.close()

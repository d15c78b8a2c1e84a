"""`bench.gpu`'s profile part (h, issue 33's next step): one `kiln run` of the large folder with
the GPU decoding, under py-spy (`--gil --subprocesses --threads`: a sample only where a thread
holds the GIL, so each process's samples are its Python time), summarised where the time went:
per process (the engine process, its prep processes), per thread group of the engine process
(task threads, Batcher runners, each device stage) and the functions holding the GIL most.

Why: on an H200 `kiln run` did ~3,000 images/s with every device stage starved for batches and
the GPU a quarter busy (docs/gpu.md), and a small run spent ~15 s before its first answers; what
feeds the Batcher that slowly, and what the start-up does, is what this answers. Needs py-spy on
PATH (the bundle's `profile` part); without it the part says so.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

RATE = 100  # samples per second
TOP = 15
# A child's stack names its parents first (`process P:"…";process C:"…";thread …`), and a
# command line may hold ";" (a spawned prep process's `-c` code): each process runs to the `";`
# before the next process or the thread.
_PROCESS = re.compile(r'process (\d+):"(.*?)";(?=process \d+:"|thread \()')
_THREAD = re.compile(r"thread \(\d+\)(?:: ([^;]*))?;?(.*)$")
_FRAME = re.compile(r"^(.*) \((.*?):\d+\)$")
_NUMBERED = re.compile(r"[-_]?\d+$")


@dataclass
class Process:
    command: str
    root: bool = True  # no parent named before it: the process py-spy started (kiln run)
    samples: int = 0
    threads: Counter[str] = field(default_factory=Counter)
    own: Counter[str] = field(default_factory=Counter)  # the frame holding the GIL
    within: Counter[str] = field(default_factory=Counter)  # any frame on the stack


def py_spy() -> str | None:
    """py-spy on PATH, or beside this interpreter (a virtual environment not activated)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


def command(raw: Path, rate: int = RATE) -> list[str]:
    """The py-spy prefix for a command whose Python time is to be sampled into `raw`."""
    spy = py_spy() or "py-spy"
    return [spy, "record", "--gil", "--subprocesses", "--threads", "--rate", str(rate),
            "--format", "raw", "--nonblocking", "-o", str(raw), "--"]  # fmt: skip


def parse(lines: Iterable[str]) -> dict[str, Process]:
    """py-spy's raw (collapsed) stacks → per process: samples, by thread group, by function."""
    found: dict[str, Process] = {}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        pid = text = None
        parents = 0
        while (head := _PROCESS.match(stack)) is not None:  # the last is the one sampled
            parents += pid is not None
            pid, text = head.groups()
            stack = stack[head.end() :]
        tail = _THREAD.match(stack)
        if pid is None or text is None or tail is None or not count.isdigit():
            continue
        thread, rest = tail.groups()
        process = found.setdefault(pid, Process(text))
        # The newest command line named wins: a prep process sampled between its fork and its
        # exec still shows its parent's (`kiln run …`), or none before py-spy read it.
        process.command = text or process.command
        process.root = process.root and not parents
        samples = int(count)
        process.samples += samples
        process.threads[_NUMBERED.sub("", (thread or "").strip()) or "main"] += samples
        frames = [_name(p) for p in rest.split(";") if _FRAME.match(p)]
        if frames:
            process.own[frames[-1]] += samples
            for frame in set(frames):
                process.within[frame] += samples
    return found


def _name(frame: str) -> str:
    match = _FRAME.match(frame)
    assert match is not None
    function, file = match.groups()
    return f"{function} ({Path(file).name})"


def role(process: Process) -> str:
    """What a sampled process is: the `kiln run` engine process, or one of its prep processes
    (spawned by multiprocessing)."""
    text = process.command
    if "multiprocessing" in text or "spawn_main" in text or "forkserver" in text:
        return "prep"
    # py-spy may not have read the command line of the process it started yet ("")
    return "engine" if "kiln" in text or process.root else "other"


def summarise(found: dict[str, Process], rate: int = RATE, top: int = TOP) -> str:
    """A short text: seconds of GIL time per process role, then for the engine process its
    thread groups and the functions that held the GIL most (own and within)."""
    lines: list[str] = []
    roles: dict[str, list[Process]] = defaultdict(list)
    for process in found.values():
        roles[role(process)].append(process)
    for name, group in sorted(roles.items()):
        seconds = sum(p.samples for p in group) / rate
        lines.append(f"{name}: {len(group)} process(es), {seconds:.1f} s holding the GIL")
    engines = roles.get("engine", [])
    if not engines:
        return "\n".join(lines)
    engine = max(engines, key=lambda p: p.samples)
    lines.append("engine process, by thread group (s):")
    lines += [f"  {t}: {n / rate:.2f}" for t, n in engine.threads.most_common(top)]
    lines.append("engine process, functions holding the GIL (own s):")
    lines += [f"  {f}: {n / rate:.2f}" for f, n in engine.own.most_common(top)]
    lines.append("engine process, functions on the stack (within s):")
    lines += [f"  {f}: {n / rate:.2f}" for f, n in engine.within.most_common(top)]
    return "\n".join(lines)

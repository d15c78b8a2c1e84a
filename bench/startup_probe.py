"""A prep process's start-up, timed in a fresh interpreter: `python -m bench.startup_probe N`.

Its main module imports `kiln.app.cli` as the `kiln` console script's does, so each prep
process it spawns re-imports that, as a `kiln run`'s do. Each of N pools of one process is
started and sent one unit whose prep (`ReportPrep`, built in the process) answers with what
the process had imported and spent by then. Prints one JSON line: per pool, the wall seconds
from starting it to that answer (`ready_s`), the process's CPU seconds and module count then.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

from kiln.app.cli import main  # noqa: F401 - as the console script does (see above)


class ReportPrep:
    """An object prep whose answer is its process's imports and CPU so far."""

    def prepare(self, data: bytes | str, slot: Any, meta: Any) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "modules": len(sys.modules),
            "pydantic": "pydantic" in sys.modules,
        }


def ready_once() -> dict[str, Any]:
    from kiln.app.core.config import get_settings
    from kiln.workers.prep.pool import PrepPool
    from kiln.workers.prep.spec import prep_spec
    from kiln.workers.prep.units import Unit

    spec = prep_spec("bench.startup_probe:ReportPrep", {})
    started = time.perf_counter()
    pool = PrepPool(get_settings(), 1)
    try:
        answer = pool.submit(Unit(0, spec, [0], [None], ["probe"], 100)).result(120)
        ready = time.perf_counter() - started
    finally:
        pool.close()
    if answer.errors[0] or not answer.objects:
        raise RuntimeError(f"the probe unit failed: {answer.errors[0]}")
    return {"ready_s": round(ready, 3), **answer.objects[0]}


if __name__ == "__main__":
    print(json.dumps([ready_once() for _ in range(int(sys.argv[1]))]))

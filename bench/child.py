"""Run one in-process case in a fresh interpreter, so the CPU and memory it reports are its own."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.results import CaseResult


def run_child(
    module: str, args: dict[str, Any], log_dir: Path, timeout: float = 3600
) -> CaseResult:
    runs = len(list(log_dir.glob(f"{module}-*.args.json")))
    out = log_dir / f"{module}-{args.get('model', 'x')}-{runs}.json"
    args_file = out.with_suffix(".args.json")  # argv can't hold thousands of paths
    args_file.write_text(json.dumps(args))
    command = [sys.executable, "-m", "bench.child", module, str(args_file), str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    out.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"bench case {module} failed (exit {proc.returncode}):\n{tail}")
    return CaseResult(**json.loads(out.read_text()))


def main() -> None:
    module, args, out = sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    case = importlib.import_module(f"bench.cases.{module}")
    result: CaseResult = case.measure(args)
    data = result.as_dict()
    data.pop("items_per_s")
    out.write_text(json.dumps(data))


if __name__ == "__main__":
    main()

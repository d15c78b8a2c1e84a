"""`kiln doctor`: what this host lacks for each engine backend, and which one `auto` would use."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from kiln.app.cli.common import console

if TYPE_CHECKING:
    from kiln.workers.ops.doctor import Probe


def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check the GPU pieces (driver, TensorRT, CuPy, NVRTC, ONNX Runtime's CUDA provider and its
    libraries, PyTorch CUDA) and say which engine backend `auto` would use; exit 1 when none
    is usable."""
    from kiln.workers.ops import doctor as diagnosis  # imports CUDA libraries: only when asked

    probe = diagnosis.probe()
    if as_json:
        typer.echo(json.dumps(diagnosis.report(probe), indent=2))
    else:
        _print(probe)
    if diagnosis.chosen(diagnosis.verdicts(probe)) is None:
        raise typer.Exit(1)


def _print(probe: Probe) -> None:
    from kiln.workers.ops.doctor import chosen, findings, verdicts

    pieces = Table("piece", "", "found", title="GPU pieces", title_justify="left")
    for finding in findings(probe):
        pieces.add_row(finding.piece, _mark(finding.ok), escape(finding.sentence))
    judged = verdicts(probe)
    backends = Table("backend", "", "why", title="Engine backends, best first",
                     title_justify="left")  # fmt: skip
    for verdict in judged:
        backends.add_row(verdict.backend, _mark(verdict.usable), escape(verdict.reason))
    console.print(pieces, backends)
    best = chosen(judged)
    if best is None:
        console.print("[red]No engine backend is usable here.[/red]")
    else:
        console.print(f"KILN_ENGINE=auto would build with [bold]{best}[/bold] first.")


def _mark(ok: bool) -> str:
    return "[green]ok[/green]" if ok else "[red]no[/red]"

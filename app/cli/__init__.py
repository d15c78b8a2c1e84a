"""The `kiln` command: run locally, serve, work, administer, and talk to a remote API.

The commands are in `commands`. This package's own import stays bare: the console script
imports it for `main`, and so does every process `multiprocessing` spawns from `kiln` (a
prep process re-imports its parent's main script), which has no use for a command line.
"""

from __future__ import annotations


def main() -> None:
    from kiln.app.cli.commands import app

    app()

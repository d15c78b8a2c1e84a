"""Start-up (issue 32): each command imports what it uses, no more. Each check runs in a fresh
interpreter and looks at what it imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imported(code: str, *names: str) -> set[str]:
    """Which of `names` a fresh interpreter has imported after running `code`."""
    found = f"[n for n in {list(names)!r} if n in sys.modules]"
    probe = f"{code}\nimport json, sys\nprint(json.dumps({found}))"
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return set(json.loads(run.stdout.splitlines()[-1]))


HEAVY = ("sqlalchemy", "alembic", "boto3", "botocore", "pandas", "torch", "celery", "pyarrow",
         "numpy", "psycopg", "pydantic_settings", "kiln.app.core.config")  # fmt: skip


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["db", "--help"]])
def test_help_imports_no_command_s_dependencies(args: list[str]) -> None:
    code = (
        f"import sys\nfrom kiln.app.cli import main\nsys.argv = ['kiln', *{args!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass"
    )
    assert _imported(code, *HEAVY) == set()


def test_the_console_script_s_import_is_bare() -> None:
    """The `kiln` script imports `kiln.app.cli` for `main`, and so does every prep process
    spawned from it (its parent's main script is imported again there)."""
    assert _imported("import kiln.app.cli", "typer", "rich", "kiln.app.cli.commands") == set()


def test_a_prep_process_imports_the_prep_side_only() -> None:
    code = "import kiln.workers.prep.process"
    assert _imported(code, *HEAVY, "pydantic", "typer") == {"numpy"}


def test_kiln_run_imports_neither_boto3_nor_alembic_nor_psycopg() -> None:
    found = _imported("import kiln.workers.embedded", "alembic", "boto3", "botocore", "psycopg")
    assert found == set()


def test_an_upgrade_at_head_imports_no_alembic(tmp_path: Path) -> None:
    code = (
        "from kiln.app.core.config import get_settings\nfrom kiln.app.db.migrate import upgrade\n"
        f"done = upgrade(get_settings(data_dir={str(tmp_path)!r}).embedded())\n"
        "print(done.applied)"
    )
    assert _imported(code, "alembic") == {"alembic"}  # a new database: its migrations ran
    assert _imported(code, "alembic") == set()  # at head: one query, nothing to run

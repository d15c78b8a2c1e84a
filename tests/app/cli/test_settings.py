"""A variable Kiln cannot take stops a command with a sentence naming it, not a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kiln.app.cli.commands import app


def test_a_bad_variable_is_a_sentence_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_LOG_LEVEL", "loud")
    monkeypatch.setenv("KILN_MAX_BATCH", "many")
    result = CliRunner().invoke(app, ["run", "missing-folder", "--model", "phash"])
    assert result.exit_code == 1
    said = " ".join(result.output.split())  # Rich wraps the sentence
    assert "Kiln cannot start with this environment:" in said
    assert "KILN_LOG_LEVEL='loud': Input should be 'debug', 'info', 'warning' or 'error'" in said
    # a union's members each say why: an integer, or 'auto'
    assert "KILN_MAX_BATCH='many': Input should be a valid integer" in said
    assert "or Input should be 'auto'" in said
    assert "Traceback" not in said

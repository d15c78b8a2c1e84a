"""The console's sign-in page hints at a command that works: run as shown (NAME filled in), it
prints a key that signs in."""

from __future__ import annotations

import re
import shlex

import pytest
from typer.testing import CliRunner

from kiln.app.cli.commands import app
from kiln.app.core.config import Settings
from tests.app.api.conftest import TestClient
from tests.app.api.test_console import sign_in


def test_the_login_hint_makes_a_key_that_signs_in(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.headers.pop("Authorization")  # a browser: only its cookie
    page = client.get("/console/login").text
    hints = re.findall(r"<code>(kiln [^<]*)</code>", page)
    assert hints == ["kiln keys create --tenant NAME"]

    monkeypatch.setenv("KILN_DATA_DIR", str(settings.data_dir))  # the app's database
    words = shlex.split(hints[0].replace("NAME", "hinted"))[1:]
    made = CliRunner().invoke(app, words)
    assert made.exit_code == 0, made.output
    key = made.stdout.strip().splitlines()[-1]
    assert key.startswith("kiln_")

    sign_in(client, key)
    home = client.get("/console/", follow_redirects=False)
    assert home.status_code == 200 and "hinted" in home.text

"""`--option KEY=VALUE` on `kiln submit`, `kiln bulk` and `kiln schedule add`: parsed once,
sent to the API, which checks them against the model's family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kiln.app.cli import remote as remote_cli
from kiln.app.cli.commands import app
from kiln.app.cli.common import parse_options


@pytest.mark.parametrize(
    ("pairs", "options"),
    [
        (None, {}),
        (["max_distance=8"], {"max_distance": 8}),
        (["note=nightly run"], {"note": "nightly run"}),  # not JSON: text
        (['group={"threshold": 0.9}', "flag=true"], {"group": {"threshold": 0.9}, "flag": True}),
        (["a=1", "a=2"], {"a": 2}),  # the last one wins, as with any repeated flag
        (["empty="], {"empty": ""}),
    ],
)
def test_pairs_become_options(pairs: list[str] | None, options: dict[str, Any]) -> None:
    assert parse_options(pairs) == options


@pytest.mark.parametrize("pair", ["max_distance", "=8", " =1"])
def test_a_pair_without_a_key_is_a_usage_error(pair: str) -> None:
    with pytest.raises(typer.BadParameter, match="is not KEY=VALUE"):
        parse_options([pair])


class FakeApi:
    """Stands in for the API client: remembers what the command sent."""

    sent: list[tuple[str, Any]] = []

    def __enter__(self) -> FakeApi:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def submit(
        self,
        files: list[Path],
        model: str,
        options: dict[str, Any],
        notify: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        self.sent.append(("submit", (model, options, notify) if notify else (model, options)))
        return {"id": "job-1", "status": "queued", "counts": {"total": len(files)}}

    def submit_json(self, body: dict[str, Any]) -> dict[str, Any]:
        self.sent.append(("submit_json", body))
        return {"id": "job-2", "status": "queued"}

    def add_schedule(self, body: dict[str, Any]) -> dict[str, Any]:
        self.sent.append(("add_schedule", body))
        return {"name": body["name"], "next_run_at": "2026-11-24T02:00:00Z"}


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    from kiln.app.cli import bulk as bulk_cli

    FakeApi.sent = []
    monkeypatch.setattr(remote_cli, "ApiClient", FakeApi)
    monkeypatch.setattr(bulk_cli, "ApiClient", FakeApi)
    return FakeApi.sent


def test_submit_sends_its_options(api: list[tuple[str, Any]], tmp_path: Path) -> None:
    image = tmp_path / "a.jpg"
    image.write_bytes(b"x")
    args = ["submit", str(image), "--model", "phash", "--option", "max_distance=8"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert api == [("submit", ("phash", {"max_distance": 8}))]


def test_submit_and_bulk_send_their_webhook(api: list[tuple[str, Any]], tmp_path: Path) -> None:
    image = tmp_path / "a.jpg"
    image.write_bytes(b"x")
    hook = ["--notify", "https://e.example/h", "--notify-events", "failed"]
    done = CliRunner().invoke(app, ["submit", str(image), "--model", "phash", *hook])
    assert done.exit_code == 0, done.output
    wanted = {"url": "https://e.example/h", "events": ["failed"]}
    assert api == [("submit", ("phash", {}, wanted))]
    bulk = CliRunner().invoke(app, ["bulk", "s3://photos/", "--model", "phash", *hook])
    assert bulk.exit_code == 0, bulk.output
    assert api[1][0] == "submit_json" and api[1][1]["notify"] == wanted
    alone = CliRunner().invoke(app, ["bulk", "s3://p/", "--model", "phash", "--notify-events", "x"])
    assert alone.exit_code == 1 and "--notify-events needs --notify URL." in alone.output


def test_bulk_and_schedules_send_their_options(api: list[tuple[str, Any]]) -> None:
    runner = CliRunner()
    bulk = ["bulk", "s3://photos/", "--model", "phash", "--option", "max_distance=6"]
    assert runner.invoke(app, bulk).exit_code == 0
    schedule = ["schedule", "add", "nightly", "--cron", "0 2 * * *", "--source", "s3://photos/",
                "--model", "phash", "--option", "max_distance=6"]  # fmt: skip
    assert runner.invoke(app, schedule).exit_code == 0
    assert [body["options"] for _call, body in api] == [{"max_distance": 6}] * 2


def test_no_option_sends_no_options_key(api: list[tuple[str, Any]]) -> None:
    assert CliRunner().invoke(app, ["bulk", "s3://photos/", "--model", "phash"]).exit_code == 0
    assert "options" not in api[0][1]


def test_a_malformed_option_stops_before_anything_is_sent(
    api: list[tuple[str, Any]], tmp_path: Path
) -> None:
    done = CliRunner().invoke(app, ["bulk", "s3://photos/", "--model", "phash", "--option", "x"])
    assert done.exit_code == 2
    assert "'x' is not KEY=VALUE" in done.output
    assert api == []

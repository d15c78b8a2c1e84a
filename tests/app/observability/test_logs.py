"""Log lines: JSON objects with the fields collectors index, or text on a terminal."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.app.core.config import get_settings
from kiln.app.observability.logs import HANDLER, configure_logging
from kiln.app.observability.tracing import tracer
from tests.tracing import in_memory_tracing


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def root() -> Iterator[logging.Logger]:
    """The root logger, restored afterwards (configure_logging changes it)."""
    logger = logging.getLogger()
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.handlers, logger.level = handlers, level


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_json_line_carries_the_fields_and_the_extras(root: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging("json", "INFO", stream)
    logging.getLogger("kiln.workers.chunk.run").info(
        "chunk %s/%d: done", "j1", 2, extra={"job_id": "j1", "chunk": 2, "items": 3}
    )
    (line,) = lines(stream)
    assert line["level"] == "INFO" and line["logger"] == "kiln.workers.chunk.run"
    assert line["message"] == "chunk j1/2: done"
    assert (line["job_id"], line["chunk"], line["items"]) == ("j1", 2, 3)
    assert str(line["time"]).endswith("+00:00")  # ISO 8601, UTC
    assert "trace_id" not in line  # no span is active


def test_a_json_line_inside_a_span_names_it(root: logging.Logger, tmp_path: Path) -> None:
    stream = io.StringIO()
    configure_logging("json", "INFO", stream)
    with (
        in_memory_tracing(get_settings(data_dir=tmp_path)),
        tracer().start_as_current_span("kiln.batch") as span,
    ):
        logging.getLogger("kiln.workers.batching").warning(
            "out of memory", extra={"batch_id": 7, "batch_size": 16, "device": "cpu"}
        )
        context = span.get_span_context()
    (line,) = lines(stream)
    assert line["trace_id"] == f"{context.trace_id:032x}"
    assert line["span_id"] == f"{context.span_id:016x}"
    assert (line["batch_id"], line["batch_size"], line["device"]) == (7, 16, "cpu")


def test_an_exception_stays_one_line(root: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging("json", "INFO", stream)
    try:
        raise ValueError("bad pixels")
    except ValueError:
        logging.getLogger("x").exception("preparing failed")
    (line,) = lines(stream)
    assert "ValueError: bad pixels" in str(line["exc_info"])


def test_auto_is_text_on_a_terminal_and_json_elsewhere(root: logging.Logger) -> None:
    terminal, pipe = Terminal(), io.StringIO()
    configure_logging("auto", "INFO", terminal)
    logging.getLogger("kiln").info("hello")
    configure_logging("auto", "INFO", pipe)  # replaces the first handler, never stacks
    logging.getLogger("kiln").info("hello")
    assert "INFO    kiln: hello" in terminal.getvalue()
    assert terminal.getvalue().count("hello") == 1
    assert lines(pipe)[0]["message"] == "hello"
    assert [h.get_name() for h in root.handlers].count(HANDLER) == 1


def test_the_setting_reads_kiln_log_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_LOG_FORMAT", "json")
    assert get_settings(data_dir=tmp_path).log_format == "json"
    monkeypatch.setenv("KILN_LOG_FORMAT", "yaml")
    with pytest.raises(ValueError):
        get_settings(data_dir=tmp_path)


def test_the_level_is_the_flag_then_kiln_log_level_then_the_commands_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.app.observability import log_level

    quiet = get_settings(data_dir=tmp_path)
    assert log_level(quiet, None) == "INFO"  # a service
    assert log_level(quiet, None, default="WARNING") == "WARNING"  # `kiln run`
    monkeypatch.setenv("KILN_LOG_LEVEL", "debug")
    told = get_settings(data_dir=tmp_path)
    assert log_level(told, None, default="WARNING") == "DEBUG"
    assert log_level(told, "error") == "ERROR"  # `--loglevel` wins


def test_an_unknown_log_level_is_refused_with_the_levels_there_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydantic import ValidationError

    monkeypatch.setenv("KILN_LOG_LEVEL", "loud")
    with pytest.raises(ValidationError, match="'debug', 'info', 'warning', 'error' or 'critical'"):
        get_settings(data_dir=tmp_path)


def test_a_log_level_is_read_in_any_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.app.observability import log_level

    monkeypatch.setenv("KILN_LOG_LEVEL", " WARNING ")  # as Python's logging writes them
    assert log_level(get_settings(data_dir=tmp_path), None) == "WARNING"

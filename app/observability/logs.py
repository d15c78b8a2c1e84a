"""Log lines: one JSON object per line for collectors, or text for a person at a terminal.

`configure_logging` is called by the process entry points (`kiln api`, `kiln worker`, `kiln
beat`, `kiln run`); `KILN_LOG_FORMAT=auto` (the default) picks text on a TTY, JSON otherwise.
A JSON line carries `time`, `level`, `logger`, `message`, whatever the call site passed in
`extra=` (job_id, chunk, items, batch_id, batch_size, device, ...) and, inside a span,
`trace_id` and `span_id`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO

from opentelemetry import trace
from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

Format = Literal["auto", "json", "text"]

HANDLER = "kiln"  # the name of the handler this module installs on the root logger
TEXT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class KilnJsonFormatter(JsonFormatter):
    """python-json-logger's formatter, with the active span's ids."""

    def __init__(self) -> None:
        super().__init__(
            "{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp="time",  # ISO 8601, UTC
            # Python 3.12's asyncio task name, and uvicorn's ANSI-coloured copy of the message
            reserved_attrs=[*RESERVED_ATTRS, "taskName", "color_message"],
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        super().add_fields(log_data, record, message_dict)
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            log_data["trace_id"] = trace.format_trace_id(context.trace_id)
            log_data["span_id"] = trace.format_span_id(context.span_id)


def formatter(fmt: Format, stream: TextIO) -> logging.Formatter:
    if fmt == "auto":
        fmt = "text" if stream.isatty() else "json"
    return KilnJsonFormatter() if fmt == "json" else logging.Formatter(TEXT)


def configure_logging(
    fmt: Format = "auto", level: int | str = logging.INFO, stream: TextIO | None = None
) -> logging.Handler:
    """Send every logger's records to `stream` (stderr) in `fmt`, replacing the handler an
    earlier call installed; other handlers (a test's, a library's) are left alone."""
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.set_name(HANDLER)
    handler.setFormatter(formatter(fmt, stream))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler

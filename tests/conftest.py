"""The real-services stack (tests/stack.py) serves tests/integration and tests/reliability.

Every test gets the root logger back as it found it: a command run in-process (`kiln run`
under CliRunner) installs Kiln's handler on the runner's stream, which is closed when the
command returns — a later test's records would then fail on it before `caplog` sees them."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kiln.app.observability.logs import HANDLER

pytest_plugins = ["tests.stack"]


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    root = logging.getLogger()
    level, before = root.level, set(root.handlers)
    yield
    # only Kiln's own: pytest adds and removes its capturing handlers around each phase
    for handler in [h for h in root.handlers if h.get_name() == HANDLER and h not in before]:
        root.removeHandler(handler)
    root.setLevel(level)

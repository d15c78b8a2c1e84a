"""The real-services stack (tests/stack.py) serves tests/integration and tests/reliability."""

pytest_plugins = ["tests.stack"]

# One command per chore; CI runs the same ones (.ci/run).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
CONSTRAINTS := constraints/test.txt
DEMO_DIR ?= .kiln/demo

.PHONY: demo test check services browser unit integration bench bench-quick gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# The CPU flavour (ONNX Runtime CPU); a GPU host installs `.[gpu]` instead (docs/gpu.md).
$(VENV)/.run: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[cpu]'
	touch $@

# tensorrt-stubs pins tensorrt itself, which downloads from NVIDIA: take the stubs alone, so mypy
# checks workers/engines/tensorrt.py against the TensorRT 10 API without a GPU.
STUBS := 'tensorrt-stubs>=10.0,<11'

$(VENV)/.dev: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[cpu,dev]'
	$(PIP) install --quiet --no-deps $(STUBS)
	touch $@ $(VENV)/.run

## demo: run the OCR model over examples/ with the embedded defaults (no servers)
demo: $(VENV)/.run
	KILN_DATA_DIR=$(DEMO_DIR) $(BIN)/kiln run examples --model ocr -o $(DEMO_DIR)/results.parquet

## services: make sure PostgreSQL and Redis answer (starting or installing them if needed)
services:
	bash scripts/ensure-services.sh

## browser: make sure Debian's chromium is installed (the console's browser tests drive it)
browser:
	bash scripts/ensure-browser.sh

## test: install dev dependencies, start services, install the browser, run the whole suite
# Two test processes (pytest-xdist): most of the suite's time is spent waiting on workers and
# services, so two halve it on a 2-core machine; each process has its own database, Redis index
# and S3 server (tests/stack.py). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.dev services browser
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=15

unit: $(VENV)/.dev
	$(BIN)/python -m pytest tests/app tests/workers

integration: $(VENV)/.dev services
	$(BIN)/python -m pytest tests/integration

$(VENV)/.bench: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[cpu,dev,bench]'
	$(PIP) install --quiet --no-deps $(STUBS)
	touch $@ $(VENV)/.dev $(VENV)/.run

## bench: Kiln against the raw engine and its peers (bench/README.md); BENCH_ARGS=--quick
bench: $(VENV)/.bench services
	$(BIN)/python -m bench $(BENCH_ARGS)

## gpu-check: on a GPU host (.venv with .[gpu,dev]): tests/gpu required, kiln run per backend, a bench
gpu-check:
	BIN=$(BIN) bash scripts/gpu-check.sh

## check: lint, format and type checks
check: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy kiln bench devstack
	# mypy --strict of the TensorRT engine against tensorrt-stubs (see the test for why apart)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/workers/engines/test_tensorrt_types.py

clean:
	rm -rf $(VENV) .kiln .mypy_cache .ruff_cache .pytest_cache

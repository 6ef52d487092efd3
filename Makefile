# make demo: create .venv, install torch 2.13.0 (CPU) and zerotrain, train the demo GPT.
# make test: the same environment, then lint, format check, type check and the test suite.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch. On a machine without a local wheel, point pip at PyTorch's CPU
# index to avoid the CUDA build: make demo TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
# Extra pytest arguments, e.g. make test PYTEST_ARGS="-x tests/unit" (.ci/run adds --durations)
PYTEST_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.zerotrain-installed

.PHONY: demo test lint format venv clean bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install --quiet -e '.[dev,demo]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/zerotrain demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Byte-compiled first: where PYTHONDONTWRITEBYTECODE is set (this machine's shells set it)
# nothing is cached at import, and each of the suite's ~800 processes would compile
# zerotrain and the tests again (0.6 s a process for zerotrain alone).
test: lint
	$(BIN)/python -m compileall -q src tests
	$(BIN)/pytest $(PYTEST_ARGS)

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) demo_out .pytest_cache .ruff_cache

# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
# Both set up a virtual environment on first use; nothing else needs installing by hand.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Extra pip arguments for torch on CPU machines, e.g.
#   make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=

.PHONY: install test lint demo clean

install: $(STAMP)

# CPU machines install torch 2.13.0 first (on our CI machines a local CPU wheel), so that the
# `torch>=2.6` range in pyproject.toml is already satisfied and pip never pulls a multi-GB
# CUDA build. Machines with a GPU (nvidia-smi present) let pip pick the CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/pip install --quiet torch==2.13.0 $(TORCH_PIP_ARGS); fi
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

lint: install
	$(BIN)/ruff check .

test: lint
	$(BIN)/pytest -q

# The main job on CPU (`sinklm demo --help`): data, three tiny models, streaming comparison.
#   make demo DATA=DIR                        local data laid out as ../shared/data
#   make demo PYTHIA=EleutherAI/pythia-160m   the real model streamed where the Hub is reachable
#   make demo DEMO_ARGS="--threads 1"         any other `sinklm demo` option
DATA ?=
PYTHIA ?= EleutherAI/pythia-70m
DEMO_ARGS ?=

# OMP_WAIT_POLICY=PASSIVE: on a shared machine torch's idle threads sleep instead of spinning
# against other jobs (measured with one of 2 cores busy: +45% tokens/s; no cost when idle).
demo: install
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} \
		$(BIN)/sinklm demo $(if $(DATA),--data "$(DATA)") --pythia "$(PYTHIA)" $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

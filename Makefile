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
# `torch>=2.5` range in pyproject.toml is already satisfied and pip never pulls a multi-GB
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

demo: install
	@echo "sinklm demo: not built yet (issue 7: train tiny vanilla / zero_sink / sink_token" \
		"models and compare their streaming perplexity). Meanwhile: $(BIN)/sinklm --help"
	@exit 1

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# The two commands of the README. Each one does all its own set-up.
#   make demo   — the supervised demo on an embedded local Ray (about 5 minutes on 2 cores)
#   make test   — the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: demo test setup clean

$(BIN)/spikeguard: pyproject.toml
	$(PY) -m venv $(VENV)
	# the CPU build of torch first (from local disk on the dev machines); a bare
	# `torch` requirement would otherwise pull a multi-GB CUDA build
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/spikeguard

demo: setup
	$(BIN)/spikeguard demo --run-dir runs/demo

test: setup
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) runs

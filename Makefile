# The two commands of the README. Each one does all its own set-up.
#   make demo   — the supervised demo on an embedded local Ray (a few minutes on 2 cores)
#   make test   — formatting, lint and type checks, then the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# pytest-xdist workers for `make test`: the training tests on one, the fault tests on the other
# (tests/conftest.py: TRAINING_MODULES, FAULT_MODULES); 0 runs the suite in one process
TEST_WORKERS ?= 2
# the rooms that must stay pure (no Ray, no I/O, no torch): type-checked on every test run
TYPED := -p spikeguard.supervisor.decide.recovery -p spikeguard.workers.contract -p spikeguard.policies \
	-m spikeguard.supervisor.intake.collector -m spikeguard.supervisor.decide.events \
	-m spikeguard.supervisor.journal -m spikeguard.supervisor.controller \
	-m spikeguard.supervisor.intake.validate -m spikeguard.workers.checkpoint.files \
	-m spikeguard.workers.checkpoint.location -m spikeguard.workers.checkpoint.mirror \
	-m spikeguard.supervisor.redaction -m spikeguard.supervisor.launch.environment \
	-m spikeguard.workers.checkpoint.choose -m spikeguard.workers.checkpoint.format \
	-m spikeguard.workers.checkpoint.pickle_scan -m spikeguard.workers.checkpoint.integrity \
	-m spikeguard.supervisor.launch.topology \
	-m spikeguard.supervisor.intake.forensics -m spikeguard.supervisor.observe.status \
	-m spikeguard.supervisor.observe.metrics -m spikeguard.supervisor.observe.svg \
	-m spikeguard.workers.batches \
	-m spikeguard.workers.checkpoint.commit -m spikeguard.workers.checkpoint.retention \
	-m spikeguard.workers.checkpoint.remove -m spikeguard.supervisor.observe.checkpoint_table \
	-m spikeguard.workers.checkpoint.storage -m spikeguard.supervisor.decide.lifecycle \
	-m spikeguard.supervisor.decide.observation -m spikeguard.supervisor.intake.tick \
	-m spikeguard.supervisor.settings -m spikeguard.supervisor.decide.wording \
	-p spikeguard.supervisor.sinks.pagers

.PHONY: demo test setup lint typecheck clean

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

lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: setup
	mkdir -p build/typecheck/spikeguard
	touch build/typecheck/spikeguard/__init__.py
	for d in workers policies supervisor examples; do \
		ln -sfn ../../../$$d build/typecheck/spikeguard/$$d; done
	$(BIN)/mypy $(TYPED)

test: setup lint typecheck
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --durations=25

# the documentation site into site/; --strict: a broken link, a missing page or anchor fails it
# (NO_MKDOCS_2_WARNING: mkdocs-material's banner about MkDocs 2, printed on every build)
.PHONY: docs
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs build

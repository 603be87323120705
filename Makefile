# Installs exactly what the project needs, then runs the whole test suite.
# TORCH_SPEC pins the CPU build that lies on this kind of machine's disk; on a GPU box pass
# TORCH_SPEC='torch' (or your CUDA build) instead.
PYTHON ?= python
TORCH_SPEC ?= torch==2.13.0

.PHONY: install lint test test-fast train
install:
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q -e ".[dev,hf,cluster,data,plan]"

# the style holds by tool: lint and format are checked before the tests run
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: install lint
	$(PYTHON) -m pytest -q tests

# the single-process suite: no test that starts another process (gloo ranks, torchrun, a fresh interpreter)
test-fast: install lint
	$(PYTHON) -m pytest -q -m "not distributed" tests

train: install
	WANDB_MODE=offline $(PYTHON) -m experiments.train

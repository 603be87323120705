# Installs exactly what the project needs, then runs the whole test suite.
# TORCH_SPEC pins the CPU build that lies on this kind of machine's disk; on a GPU box pass
# TORCH_SPEC='torch' (or your CUDA build) instead.
PYTHON ?= python
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test train bench
install:
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q -e ".[dev,hf,cluster]"

test: install
	$(PYTHON) -m pytest -q tests

train: install
	WANDB_MODE=offline $(PYTHON) -m experiments.train

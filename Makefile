# pipec: `make demo` and `make test` work on a fresh machine (they create .venv when needed).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pin torch exactly: an open range would pull a multi-GB CUDA build on a CPU machine.
TORCH ?= torch==2.13.0
# Devices of this machine: its GPUs, or 4 CPU processes.
DEVICES = $(shell $(BIN)/python -c "import torch; print(torch.cuda.device_count() or 4)")
HARDWARE = $(shell $(BIN)/python -c "import torch; print('h100-80g' if torch.cuda.is_available() else 'cpu')")
export OMP_NUM_THREADS ?= 1

.PHONY: venv demo test lint unit clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH) -e '.[dev]'
	touch $@

# --pp: one stage per device, to show a pipeline (for this small model --pp auto would pick
# pure data parallelism, which has no bubble).
demo: venv
	$(BIN)/pipec compile samples/resnet.py --gpus $(DEVICES) --pp $(DEVICES) --batch-size 64 \
		--hardware $(HARDWARE) -o out/demo
	@echo "--- out/demo/report.md (head) ---"
	@head -12 out/demo/report.md
	$(BIN)/torchrun --standalone --nproc_per_node $(DEVICES) out/demo/train.py --steps 5

lint: venv
	$(BIN)/ruff check pipec tests samples benchmarks
	$(BIN)/mypy

unit: venv
	$(BIN)/python -m pytest -q

test: lint unit

clean:
	rm -rf out build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache

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
# The other torch releases pipec supports (pipec.torchcompat.SUPPORTED_TORCH), for test-torch:
# CUDA builds, which run on a CPU (about 4.5 GB a venv; pip caches their wheels).
OTHER_TORCH ?= 2.11.0 2.14.1
# timm and torchvision, installed beside torch 2.14 for tests/frontend/test_vision_models.py and
# benchmarks/zoo.py: torchvision 0.29.1 loads there (0.28 does not beside the CPU 2.13 wheel).
VISION = torchvision==0.29.1 timm==1.0.31

.PHONY: venv demo test lint unit test-torch clean

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

# The test suite on each of OTHER_TORCH, then the same plans compiled and trained on it against
# this venv's torch (tests/test_torch_versions.py). One other venv at a time: with
# PRUNE_OTHER_VENVS=1 (CI) each is removed after its tests, so the run needs about 6 GB of free
# disk rather than 12.
PRUNE_OTHER_VENVS ?= 0
test-torch: venv
	set -e; for version in $(OTHER_TORCH); do \
		other=.venv-torch-$$version; \
		df -h . | tail -1; \
		$(MAKE) --no-print-directory venv VENV=$$other TORCH=torch==$$version; \
		case $$version in 2.14.*) $$other/bin/python -m pip install -q $(VISION);; esac; \
		$$other/bin/python -m pytest -q -p no:cacheprovider; \
		PIPEC_TORCH_VENVS="$(CURDIR)/$$other" $(BIN)/python -m pytest -q tests/test_torch_versions.py; \
		if [ "$(PRUNE_OTHER_VENVS)" = 1 ]; then rm -rf $$other; fi; \
	done

clean:
	rm -rf out build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache

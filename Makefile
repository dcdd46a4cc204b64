# medusa_train — `make help` lists the targets.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKDIR ?= runs/default
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (auto: one per CPU core; 0: one process). On CI's 2 cores two
# workers took 12 min 18 s where one process took 16 min 26 s (docs/benchmarks.md, "Test suite").
TEST_WORKERS ?= auto
LOCK := requirements/lock.txt
# `make lock` keeps torch and triton as locked unless given TORCH=x.y.z TRITON=a.b.c (TRITON: the version
# torch x.y.z's Linux wheel on PyPI requires; the CPU build requires none, so it is pinned by hand).
TORCH ?= $(shell sed -n 's/^torch==//p' $(LOCK))
TRITON ?= $(shell sed -n 's/^triton==//p' $(LOCK))

.PHONY: help install lock demo test test-oldest eval lint format clean gpu-wheels gpu-demo gpu-check

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-8s %s\n", $$1, $$2}'

# Every install is constrained (pip -c) to $(LOCK), the exact versions of everything below, so a fresh
# clone installs what was tested; pyproject.toml keeps the supported ranges. torch first: the lock pins
# it (an unpinned torch pulls a multi-GB CUDA build on CPU machines). deepspeed ships as a source
# package whose build imports torch, so it (and our editable install) builds without isolation
# against the torch already in the venv.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c $(LOCK) --upgrade pip
	$(BIN)/pip install -q -c $(LOCK) torch
	$(BIN)/pip install -q -c $(LOCK) setuptools wheel
	$(BIN)/pip install -q -c $(LOCK) --no-build-isolation "deepspeed>=0.16"
	$(BIN)/pip install -q -c $(LOCK) --no-build-isolation -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the package with dev extras (quick when done)

lock:  ## refresh requirements/lock.txt: the newest versions pyproject admits, installed in a fresh venv and frozen
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	printf '%s\n' torch==$(TORCH) $(if $(TRITON),triton==$(TRITON)) > $$tmp/pins.txt; \
	$(MAKE) --no-print-directory install VENV=$$tmp/venv LOCK=$$tmp/pins.txt; \
	{ grep '^#' $(LOCK) | grep -v '^# Frozen'; \
	  echo "# Frozen by make lock from $$($$tmp/venv/bin/python -V) on $$(uname -sm), $$(date -u +%F)."; \
	  $$tmp/venv/bin/pip freeze --all --exclude-editable | sed 's/+.*$$//'; } > $$tmp/lock.txt; \
	mv $$tmp/lock.txt $(LOCK); echo "wrote $(LOCK)"

demo: install  ## the whole pipeline on the embedded tiny backbone (CPU, offline)
	$(BIN)/python -m medusa_train stage=all workdir=$(WORKDIR)

test: install  ## run the test suite on TEST_WORKERS processes (pytest's "no tests collected", exit 5, is not a failure)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The oldest transformers pyproject admits (the GPU image's) and the huggingface_hub it needs (<2), laid
# over the venv's newer ones on PYTHONPATH (two wheels, ~10 s): the decoders, custom_generate and the
# version-dependent names are tested on it too (CI runs it after `make test`; ~3 min on 2 cores).
OLDEST := transformers==5.17.0 huggingface_hub==1.33.0
OLDEST_DIR := $(VENV)/oldest
OLDEST_TESTS := tests/unit/decoding tests/stages/test_export_custom_generate.py tests/unit/test_hf_compat.py
# Tests marked torch_only (the kernels against their reference, their compile checks, ~50 s of CPU) run
# no transformers code, and the sampling laws' statistical tests (~20 s) test our draws, transformers
# giving only the logits, whose forward the parity tests check on 5.17: `make test` runs them all.
OLDEST_SKIP := -m "not torch_only" \
  --deselect tests/unit/decoding/test_decoding_sampling.py::test_sampling_distribution_matches_ancestral \
  --deselect tests/unit/decoding/test_decoding_sampling.py::test_static_sampling_distribution_matches_ancestral \
  --deselect tests/unit/decoding/test_decoding_batched.py::test_batched_sampling_distribution_matches_ancestral

test-oldest: install  ## the decoders' tests on the oldest transformers pyproject admits (5.17, the GPU image's)
	grep -qxF '$(OLDEST)' $(OLDEST_DIR)/.installed 2>/dev/null || { rm -rf $(OLDEST_DIR) && \
	  $(BIN)/pip install -q --no-deps --target $(OLDEST_DIR) $(OLDEST) && echo '$(OLDEST)' > $(OLDEST_DIR)/.installed; }
	PYTHONPATH=$(OLDEST_DIR) $(BIN)/python -c 'import transformers as t; assert t.__version__ == "5.17.0", t.__version__'
	PYTHONPATH=$(OLDEST_DIR) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider $(OLDEST_TESTS) $(OLDEST_SKIP)

eval: install  ## tree decoding vs plain greedy on held-out prompts (after `make demo`)
	$(BIN)/python -m medusa_train stage=eval workdir=$(WORKDIR)

lint: install  ## ruff lint + format check
	$(BIN)/ruff check medusa_train scripts tests
	$(BIN)/ruff format --check medusa_train scripts tests

format: install  ## ruff autoformat
	$(BIN)/ruff format medusa_train scripts tests
	$(BIN)/ruff check --fix medusa_train scripts tests

# The GPU image (Python 3.12, torch + transformers, no internet) lacks these; versions from $(LOCK).
GPU_WHEELS := .gpu-wheels
GPU_WHEEL_PACKAGES := hydra-core omegaconf datasets dill multiprocess hjson pydantic pydantic-core \
	annotated-types typing-inspection
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))
gpu-wheels: install  ## download the wheels scripts/gpu_check.sh installs on an offline Python 3.12 GPU machine
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d $(GPU_WHEELS) \
		$(foreach p,$(GPU_WHEEL_PACKAGES),$(p)==$(shell sed -n 's/^$(subst -,[-_],$(p))==//Ip' $(LOCK)))
	$(BIN)/pip wheel -q --no-deps -w $(GPU_WHEELS) antlr4-python3-runtime==$(shell sed -n 's/^antlr4-python3-runtime==//p' $(LOCK))
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w $(GPU_WHEELS) deepspeed==$(shell sed -n 's/^deepspeed==//p' $(LOCK))
	@ls $(GPU_WHEELS)

gpu-demo:  ## copy the demo workdir ($(WORKDIR), after make demo) without train/ to runs/gpu-demo (~32 MB)
	rm -rf runs/gpu-demo && mkdir -p runs/gpu-demo
	cd $(WORKDIR) && cp -a pretrain distill heads export $(CURDIR)/runs/gpu-demo/

gpu-check:  ## on a GPU machine: every decoding path and stage on CUDA + GPU benchmarks (scripts/gpu_check.sh)
	bash scripts/gpu_check.sh

clean:  ## remove runs/ (keeps .venv)
	rm -rf runs outputs

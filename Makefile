# medusa_train — `make help` lists the targets.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKDIR ?= runs/default
PYTEST_ARGS ?=
LOCK := requirements/lock.txt
# `make lock` keeps torch and triton as locked unless given TORCH=x.y.z TRITON=a.b.c (TRITON: the version
# torch x.y.z's Linux wheel on PyPI requires; the CPU build requires none, so it is pinned by hand).
TORCH ?= $(shell sed -n 's/^torch==//p' $(LOCK))
TRITON ?= $(shell sed -n 's/^triton==//p' $(LOCK))

.PHONY: help install lock demo test eval lint format clean

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

test: install  ## run the test suite (pytest's "no tests collected", exit 5, is not a failure)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

eval: install  ## tree decoding vs plain greedy on held-out prompts (after `make demo`)
	$(BIN)/python -m medusa_train stage=eval workdir=$(WORKDIR)

lint: install  ## ruff lint + format check
	$(BIN)/ruff check medusa_train scripts tests
	$(BIN)/ruff format --check medusa_train scripts tests

format: install  ## ruff autoformat
	$(BIN)/ruff format medusa_train scripts tests
	$(BIN)/ruff check --fix medusa_train scripts tests

clean:  ## remove runs/ (keeps .venv)
	rm -rf runs outputs

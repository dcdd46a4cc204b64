# medusa_train — `make help` lists the targets.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKDIR ?= runs/default
PYTEST_ARGS ?=

.PHONY: help install demo test eval lint format clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-8s %s\n", $$1, $$2}'

# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build on CPU machines.
# deepspeed ships as a source package whose build imports torch, so it (and our editable install)
# builds without isolation against the torch already in the venv.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q setuptools wheel
	$(BIN)/pip install -q --no-build-isolation "deepspeed>=0.16"
	$(BIN)/pip install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the package with dev extras (quick when done)

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

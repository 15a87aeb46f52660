# GPT-2 to Kimi K3: build the book, test everything.
#   make book   - create .venv, install, run every notebook at full size, build _build/html
#   make test   - lint, unit tests (with and without Triton), notebooks small (SMOKE), Colab-like check, site build, browser check
#   make serve  - serve the built site on http://127.0.0.1:8000
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
# Small tensors run much faster on one thread (TOOLING.md); notebooks read this too.
export OMP_NUM_THREADS := 1
export PYTHONHASHSEED := 0
export PYDEVD_DISABLE_FILE_VALIDATION := 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

ENV_HASH := $(shell cat requirements/ci.txt pyproject.toml | sha1sum | cut -c1-12)
ENV_STAMP := $(VENV)/.installed-$(ENV_HASH)

.PHONY: help env vendor book test lint unit unit-no-triton notebooks run-notebooks smoke colab html browser serve clean freeze

help:
	@sed -n '2,5p' Makefile

## environment ---------------------------------------------------------------------------------
env: $(ENV_STAMP)
$(ENV_STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/ci.txt
	$(PY) -m pip install --quiet --no-deps -e .
	@rm -f $(VENV)/.installed-*
	@touch $@

# MathJax, RequireJS and the widget manager, from npm, so the site needs no CDN.
vendor: _vendor/.stamp
_vendor/.stamp: package.json package-lock.json tools/vendor_assets.py | $(ENV_STAMP)
	npm ci --no-audit --no-fund --loglevel=error
	$(PY) tools/vendor_assets.py
	@touch $@

freeze: env
	$(PY) -m pip freeze --exclude-editable | grep -v -E '^(tinyk3|pip|setuptools|wheel)==' \
	  | sed 's/+cpu//' > requirements/ci.txt.new && mv requirements/ci.txt.new requirements/ci.txt

## the book ------------------------------------------------------------------------------------
# Notebook sources are py:percent files in notebooks/src; the .ipynb beside them keep outputs.
notebooks: env
	for f in notebooks/src/*.py; do \
	  $(BIN)/jupytext --quiet --update --to ipynb -o notebooks/$$(basename $${f%.py}).ipynb $$f; \
	done

run-notebooks: env
	$(PY) tools/run_notebooks.py $(NOTEBOOKS)

html: env vendor
	rm -rf _build/html _build/.doctrees
	$(BIN)/jupyter-book build . -W -n --keep-going --quiet

book: env vendor run-notebooks html
	@echo "Site built: _build/html/index.html  (make serve to view it)"

serve:
	@echo "Serving _build/html on http://127.0.0.1:8000"
	$(PY) -m http.server --directory _build/html --bind 127.0.0.1 8000

## tests ---------------------------------------------------------------------------------------
test: env vendor lint unit unit-no-triton smoke colab html browser
	@echo "make test: all checks passed"

lint: env
	$(BIN)/ruff check lib tests tools notebooks

unit: env
	$(BIN)/pytest -q -m "not browser" tests

# The same tests in a process where `import triton` fails (Triton is optional): the kernel tests
# skip with the reason, everything else must pass.
unit-no-triton: env
	rm -rf _build/no-triton && mkdir -p _build/no-triton/triton
	echo 'raise ImportError("triton hidden by make unit-no-triton")' > _build/no-triton/triton/__init__.py
	PYTHONPATH=$(CURDIR)/_build/no-triton $(BIN)/pytest -q -p no:cacheprovider -m "not browser" tests

# Every notebook, small: papermill injects SMOKE=True, nbval runs it on a fresh kernel and
# compares the outputs of cells tagged `nbval-check-output` with the stored full run.
smoke: env
	rm -rf _build/smoke && mkdir -p _build/smoke
	for nb in $(NOTEBOOKS); do \
	  $(BIN)/papermill --prepare-only -p SMOKE True $$nb _build/smoke/$$(basename $$nb) >/dev/null 2>&1; \
	done
	$(BIN)/pytest -q -p no:cacheprovider --nbval-lax --nbval-cell-timeout=600 _build/smoke

# What a Colab reader does: install the wheel with runtime dependencies only, run the
# notebooks from a folder outside the repository.
colab: env
	bash tools/colab_check.sh

browser: env
	$(BIN)/pytest -q -m browser tests/test_site.py

clean:
	rm -rf _build _vendor node_modules

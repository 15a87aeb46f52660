"""Every chapter's first code cell, written once, here; `python tools/setup_cell.py` puts it
into every notebook (the sources in notebooks/src/*.py and the stored .ipynb, outputs kept).

The cell installs the course package where it is missing (Colab, Kaggle, a fresh Jupyter)
from the repository named in _config.yml (`repository.url`, the one place the URL is
written), WITHOUT changing any package already installed: every installed package is passed
to pip as a constraint at its installed version, so pip only adds what is missing, or stops
and says which requirement conflicts. In Colab that keeps torch, ipywidgets and numpy the
ones the running kernel has already imported. tools/colab_check.py runs this very cell
(with the wheel in place of ``PACKAGE``) and fails if any pre-installed package changes.

    python tools/setup_cell.py            # after editing SETUP or repository.url
    python tools/setup_cell.py --check    # exit 1 if a notebook's setup cell differs
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETUP = '''\
# Setup. Where the course package is missing (Colab, Kaggle, a fresh Jupyter), install
# it from the repository without changing any package already installed: each one is
# pinned to its installed version, so pip adds only what is missing (or stops and says
# why). Locally, `make book` or `pip install -e .` has installed it. Then fix threads
# and seeds.
import importlib
import importlib.util
import subprocess
import sys
import tempfile

REPO_URL = "{url}"
PACKAGE = f"git+{{REPO_URL}}"
if importlib.util.find_spec("tinyk3") is None:
    pip = [sys.executable, "-m", "pip"]
    installed = subprocess.run(pip + ["list", "--format=freeze"], check=True,
                               capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
        pins.write(installed)
    subprocess.run(pip + ["install", "-q", "-c", pins.name, PACKAGE], check=True)
    importlib.invalidate_caches()

import time

import tinyk3

tinyk3.setup(seed=0)
NOTEBOOK_START = time.perf_counter()'''

#: The line tools/colab_check.py replaces to install a local wheel instead.
PACKAGE_LINE = 'PACKAGE = f"git+{REPO_URL}"'
TAGS = ["hide-input"]


def repo_url() -> str:
    import yaml

    return yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]


def setup_source(url: str | None = None) -> str:
    """The setup cell's source, for the configured repository (or ``url``)."""
    return SETUP.format(url=url or repo_url())


def main(argv: list[str]) -> int:
    import jupytext
    import nbformat

    check = "--check" in argv
    want = setup_source()
    stale = []
    for path in sorted((ROOT / "notebooks" / "src").glob("*.py")):
        nb = jupytext.read(path)
        first = next(c for c in nb.cells if c.cell_type == "code")
        if first.source != want or sorted(first.metadata.get("tags", [])) != TAGS:
            stale.append(path)
            if not check:
                first.source = want
                first.metadata["tags"] = TAGS
                jupytext.write(nb, path, fmt="py:percent")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        first = next(c for c in nb.cells if c.cell_type == "code")
        if first.source != want:
            stale.append(path)
            if not check:
                first.source = want
                nbformat.write(nb, path)
    for path in stale:
        print(f"{'differs' if check else 'updated'}: {path.relative_to(ROOT)}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

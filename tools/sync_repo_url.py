"""Rewrite every notebook's install cell to use the repository URL from _config.yml.

_config.yml is the one place the URL is written; run this after changing it. Both the notebook
sources (notebooks/src/*.py) and the .ipynb files are updated; outputs are kept.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]
PATTERN = re.compile(r'^REPO_URL = ".*"$', re.MULTILINE)


def main() -> None:
    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    line = f'REPO_URL = "{url}"'
    for path in sorted((ROOT / "notebooks" / "src").glob("*.py")):
        text = path.read_text()
        if PATTERN.sub(line, text) != text:
            path.write_text(PATTERN.sub(line, text))
            print(f"updated {path.relative_to(ROOT)}")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        changed = False
        for cell in nb.cells:
            if cell.cell_type == "code" and PATTERN.search(cell.source):
                new = PATTERN.sub(line, cell.source)
                changed |= new != cell.source
                cell.source = new
        if changed:
            nbformat.write(nb, path)
            print(f"updated {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

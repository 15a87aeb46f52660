"""Copies of the notebooks with ``SMOKE = True`` injected, for `make smoke` (nbval runs them).

papermill's prepare-only mode (the parameter cell after the one tagged ``parameters``, no
kernel started), for every notebook in one process: the command-line tool started a Python
per notebook, about two seconds each.

    python tools/prepare_smoke.py _build/smoke notebooks/*.ipynb
"""

from __future__ import annotations

import sys
from pathlib import Path

import papermill


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: prepare_smoke.py OUT_DIR NOTEBOOK...")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for nb in argv[1:]:
        papermill.execute_notebook(nb, str(out / Path(nb).name), parameters={"SMOKE": True},
                                   prepare_only=True, progress_bar=False, log_output=False)


if __name__ == "__main__":
    main(sys.argv[1:])

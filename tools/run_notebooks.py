"""Execute notebooks in place, at full size, and store their outputs (used by `make book`).

The committed notebooks carry the outputs of this run, which is what the website shows. A
cell error stops the run (only cells tagged ``raises-exception`` may show an error). Widget
state is stored in the notebook so that the static site can render the widgets.

    python tools/run_notebooks.py notebooks/01_gpt2.ipynb [...] [--param SMOKE=True]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

BUDGET_S = 180  # each full-size notebook should run in about 3 minutes on 2 CPU cores


def inject(nb, params: dict) -> None:
    """Insert a cell after the one tagged ``parameters`` (what papermill does)."""
    idx = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    src = "# Injected parameters\n" + "\n".join(f"{k} = {v}" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(src, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(idx + 1, cell)


def run(path: Path, params: dict, timeout: int) -> float:
    nb = nbformat.read(path, as_version=4)
    if params:
        inject(nb, params)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    t0 = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as exc:
        nbformat.write(nb, path)  # keep the outputs so the error can be read in the notebook
        print(f"FAILED {path}:\n{exc}", file=sys.stderr)
        raise SystemExit(1) from None
    seconds = time.perf_counter() - t0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--param", action="append", default=[], help="NAME=VALUE to inject")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    ap.add_argument("--timings", type=Path, default=Path("_build/notebook_timings.json"))
    args = ap.parse_args()
    params = dict(p.split("=", 1) for p in args.param)
    timings = {}
    for path in args.notebooks:
        seconds = run(path, params, args.timeout)
        timings[str(path)] = round(seconds, 1)
        flag = "" if seconds <= BUDGET_S or params else f"  (over the {BUDGET_S} s budget!)"
        print(f"{path}: {seconds:6.1f} s{flag}", flush=True)
    args.timings.parent.mkdir(parents=True, exist_ok=True)
    args.timings.write_text(json.dumps(timings, indent=1))


if __name__ == "__main__":
    main()

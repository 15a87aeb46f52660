"""Triton is optional: the notebooks that use ``tinyk3.kernels`` run top to bottom, small, in a
kernel where ``import triton`` fails, and say so instead of crashing.

CI has Triton (requirements/ci.txt pins it) and so does the Colab-like check (PyPI's torch pulls it
in), so this is the one place the no-Triton path of a chapter runs. A ``triton`` package that raises
ImportError is put first on the kernel's PYTHONPATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
USERS = [p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
         if "tinyk3.kernels" in p.read_text() or "from tinyk3 import kernels" in p.read_text()]


@pytest.mark.parametrize("path", USERS, ids=[p.stem for p in USERS])
def test_notebook_runs_without_triton(path, tmp_path):
    shim = tmp_path / "shim" / "triton"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("triton is hidden by tests/test_without_triton.py")')
    nb_path = tmp_path / path.name
    shutil.copy(path, nb_path)
    path_entries = [str(shim.parent), str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path_entries)}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "run_notebooks.py"), str(nb_path),
                           "--param", "SMOKE=True", "--timings", str(tmp_path / "t.json")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = "\n".join(o.get("text", "") for c in nbformat.read(nb_path, as_version=4).cells
                     if c.cell_type == "code" for o in c.get("outputs", []))
    assert "triton is hidden by tests/test_without_triton.py" in text or "Triton is not installed" in text

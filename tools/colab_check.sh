#!/usr/bin/env bash
# A Colab-like run: build the wheel, install it into a FRESH virtual environment with only the
# runtime dependencies (plus a Jupyter kernel), copy the notebooks to a folder outside the
# repository and run them small. Proves a notebook needs nothing but the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=$(mktemp -d /tmp/tinyk3-colab.XXXXXX)
trap 'rm -rf "$work"' EXIT

.venv/bin/python -m build --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet "$work"/dist/tinyk3-*.whl ipykernel nbclient nbformat \
  2> >(grep -v "Location 'file:" >&2)

mkdir "$work/notebooks"
cp notebooks/*.ipynb "$work/notebooks/"
cp tools/run_notebooks.py "$work/"
cd "$work/notebooks"
# The kernel must import tinyk3 from the wheel, not from the repository.
where=$("$work/venv/bin/python" -c "import tinyk3, os; print(os.path.dirname(tinyk3.__file__))")
case "$where" in "$work/venv/"*) ;; *) echo "tinyk3 imported from $where, not the wheel"; exit 1;; esac
"$work/venv/bin/python" - "$work/venv" <<'PY'
import sys
from jupyter_client.kernelspec import KernelSpecManager
argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
if not (argv0 in ("python", "python3") or argv0.startswith(sys.argv[1])):
    sys.exit(f"the python3 kernel runs {argv0}, not the fresh venv")
PY
for t in transformers papermill pytest; do
  if "$work/venv/bin/python" -c "import $t" 2>/dev/null; then
    echo "the runtime-only venv unexpectedly has $t"; exit 1
  fi
done
env -u PYTHONPATH "$work/venv/bin/python" "$work/run_notebooks.py" --param SMOKE=True \
  --timings "$work/timings.json" "$work"/notebooks/*.ipynb
echo "colab check: notebooks ran from $work with only the wheel's runtime dependencies"

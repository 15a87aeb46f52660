"""The weekly run (`make weekly`, .github/workflows/weekly.yml): every notebook at full size
against the libraries readers will have next month.

1. A fresh environment in _build/weekly/venv with Colab's packages (requirements/colab.txt) at
   the versions Colab has today (googlecolab/backend-info's pip-freeze.txt, fetched; offline,
   the committed snapshot requirements/colab-freeze.txt) and the newest releases of torch (CPU
   build) and Triton. The report lists where Colab has moved since the snapshot.
2. The course's wheel installed into it (`make wheel`'s).
3. Every notebook run at full size (or small with --smoke), each in its own process, from a
   folder outside the repository (_build/weekly/notebooks), so one failure does not hide
   the others. A failed notebook is kept with its outputs.
4. _build/weekly/report.md: one line per notebook (passed or failed, seconds) and, for each
   failure, the cell (its number and first lines), the error, and the versions of the
   packages that matter. The workflow posts it as an issue. Exit status 1 on any failure.

    .venv/bin/python tools/weekly_check.py --wheel dist/tinyk3-1.0.0-py3-none-any.whl
        [--notebooks notebooks/01_gpt2.ipynb ...] [--smoke] [--keep-venv] [--torch-index URL]
        [--newest torch==2.13.0 ...]   (a local try that downloads nothing new)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
WEEKLY = ROOT / "_build" / "weekly"
VENV = WEEKLY / "venv"
COLAB = ROOT / "requirements" / "colab.txt"
FREEZE = ROOT / "requirements" / "colab-freeze.txt"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
NEWEST = ("torch", "triton")  # always the newest release, whatever Colab has
# Colab's runtime as Google publishes it today (the committed FREEZE is a snapshot of it).
COLAB_NOW = "https://raw.githubusercontent.com/googlecolab/backend-info/main/pip-freeze.txt"
LEFT_OUT = ("setuptools",)  # as in FREEZE: torch needs a newer setuptools than Colab's
REPORTED = ("python", "torch", "triton", "numpy", "matplotlib", "ipywidgets", "ipykernel",
            "ipython", "transformers", "nbclient", "tinyk3")


def say(msg: str) -> None:
    print(f"weekly: {msg}", flush=True)


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def parse_freeze(text: str) -> dict[str, str]:
    """``name -> version`` of a pip freeze, its ``name==version`` lines only (direct-URL
    lines such as Colab's torch are not on PyPI) and without :data:`LEFT_OUT`."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and "@" not in line:
            name, version = line.split("==", 1)
            if _name(name) not in LEFT_OUT:
                out[_name(name)] = version.strip()
    return out


def colab_now(url: str = COLAB_NOW, timeout: float = 30) -> tuple[str, str]:
    """Colab's current pip freeze and where it came from: fetched from ``url``, or, where that
    fails (no network), the committed snapshot, saying so."""
    import urllib.request

    if url:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.read().decode(), url
        except OSError as err:
            say(f"could not fetch {url} ({err}); using the committed snapshot")
    return FREEZE.read_text(), f"{FREEZE.relative_to(ROOT)} (the committed snapshot)"


def moved(current: dict[str, str], snapshot: dict[str, str], names) -> list[str]:
    """The packages the course touches whose Colab version is no longer the snapshot's."""
    return [f"{n} {snapshot[n]} -> {current[n]}" for n in names
            if n in current and n in snapshot and current[n] != snapshot[n]]


def requirements_and_constraints(colab: Path = COLAB, freeze: Path = FREEZE,
                                 newest: tuple[str, ...] = NEWEST, freeze_text: str | None = None):
    """Colab's package list (without a version: the constraints decide) plus ``newest``
    (requirement specifiers, by default :data:`NEWEST`: plain names, so the newest release),
    and the constraints: Colab's published versions of everything except :data:`NEWEST`."""
    reqs = []
    for line in colab.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and _name(line) not in NEWEST:
            reqs.append(_name(line))
    versions = parse_freeze(freeze.read_text() if freeze_text is None else freeze_text)
    constraints = [f"{n}=={v}" for n, v in versions.items() if n not in NEWEST]
    return reqs + list(newest), constraints


def build_venv(wheel: Path, keep: bool, torch_index: str = TORCH_INDEX,
               newest: tuple[str, ...] = NEWEST, freeze_text: str | None = None) -> Path:
    python = VENV / "bin" / "python"
    if keep and python.exists():
        say(f"reusing {VENV.relative_to(ROOT)}")
    else:
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        reqs, constraints = requirements_and_constraints(newest=newest,
                                                         freeze_text=freeze_text)
        pins = WEEKLY / "constraints.txt"
        pins.write_text("\n".join(constraints) + "\n")
        say(f"installing {' '.join(reqs)} ({len(constraints)} Colab versions as constraints; "
            f"then {', '.join(newest)})")
        index = ["--extra-index-url", torch_index] if torch_index else []
        subprocess.run([python, "-m", "pip", "install", "-q", "-c", pins, *index, *reqs],
                       check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps",
                    wheel], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", wheel], check=True)  # its floors
    return python


def versions(python: Path) -> dict[str, str]:
    code = ("import json, platform, importlib.metadata as m\n"
            f"names = {list(REPORTED[1:])!r}\n"
            "out = {'python': platform.python_version()}\n"
            "for n in names:\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = 'not installed'\n"
            "print(json.dumps(out))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def first_error(nb) -> dict | None:
    """The first cell of an executed notebook with an error output: its position among the
    code cells, its execution count, its first lines, and the error."""
    n_code = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        n_code += 1
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                head = "\n".join(cell.source.splitlines()[:4])
                return {"code_cell": n_code, "execution_count": cell.get("execution_count"),
                        "source": head, "ename": out.get("ename", ""),
                        "evalue": str(out.get("evalue", ""))[:500]}
    return None


def run_one(python: Path, nb: Path, work: Path, smoke: bool) -> dict:
    target = work / nb.name
    shutil.copy(nb, target)
    cmd = [python, work / "run_notebooks.py", "--timings", work / f"{nb.stem}.json", target]
    if smoke:
        cmd[2:2] = ["--param", "SMOKE=True"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JUPYTER_PATH")}
    env.update(OMP_NUM_THREADS="1", MPLBACKEND="module://matplotlib_inline.backend_inline")
    t0 = time.perf_counter()
    done = subprocess.run([str(c) for c in cmd], cwd=work, env=env, capture_output=True,
                          text=True)
    result = {"notebook": nb.name, "seconds": round(time.perf_counter() - t0, 1),
              "passed": done.returncode == 0}
    if not result["passed"]:
        error = first_error(nbformat.read(target, as_version=4)) if target.exists() else None
        result["error"] = error or {"log": (done.stderr or done.stdout)[-1500:]}
    return result


def render(results: list[dict], vers: dict[str, str], smoke: bool, source: str = "",
           colab_moved: list[str] | None = None) -> str:
    failed = [r for r in results if not r["passed"]]
    size = "small (SMOKE)" if smoke else "full size"
    lines = [f"# Weekly notebook run: {len(failed)} of {len(results)} notebooks failed"
             if failed else f"# Weekly notebook run: all {len(results)} notebooks passed", ""]
    if source:
        lines += [f"Colab's package versions from {source}.", ""]
    if colab_moved:
        lines += ["Colab has moved since requirements/colab-freeze.txt was taken (refresh it, "
                  "and the floors in pyproject.toml where needed): " + ", ".join(colab_moved)
                  + ".", ""]
    lines += [f"Every notebook at {size} on {platform.machine()}, with:", "",
             "| package | version |", "|---|---|",
             *(f"| {k} | {v} |" for k, v in vers.items()), "",
             "| notebook | result | seconds |", "|---|---|---|",
             *(f"| {r['notebook']} | {'passed' if r['passed'] else '**failed**'} | "
               f"{r['seconds']} |" for r in results)]
    for r in failed:
        e = r["error"]
        lines += ["", f"## {r['notebook']}", ""]
        if "log" in e:
            lines += ["The notebook did not run to its first cell error; the log ends:", "",
                      "```text", e["log"], "```"]
            continue
        lines += [f"Code cell {e['code_cell']} (execution count {e['execution_count']}) "
                  f"raised `{e['ename']}`: {e['evalue']}", "", "```python", e["source"], "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--wheel", type=Path, required=True)
    ap.add_argument("--notebooks", nargs="*", type=Path,
                    default=sorted((ROOT / "notebooks").glob("*.ipynb")))
    ap.add_argument("--smoke", action="store_true", help="run the notebooks small")
    ap.add_argument("--keep-venv", action="store_true", help="reuse _build/weekly/venv")
    ap.add_argument("--torch-index", default=TORCH_INDEX,
                    help="where torch's CPU wheels come from ('' for the default index)")
    ap.add_argument("--colab-freeze", default=COLAB_NOW, metavar="URL",
                    help="Colab's current pip freeze ('' for the committed snapshot)")
    ap.add_argument("--newest", nargs="*", default=list(NEWEST), metavar="SPEC",
                    help="what to take beyond Colab's versions (default: the newest torch and "
                         "triton); e.g. --newest torch==2.13.0 for a try without downloads")
    args = ap.parse_args()
    if not args.wheel.is_file():
        sys.exit(f"no wheel at {args.wheel} (make wheel)")
    WEEKLY.mkdir(parents=True, exist_ok=True)
    freeze_text, source = colab_now(args.colab_freeze)
    names = requirements_and_constraints()[0]
    colab_moved = moved(parse_freeze(freeze_text), parse_freeze(FREEZE.read_text()), names)
    python = build_venv(args.wheel.resolve(), args.keep_venv, args.torch_index,
                        tuple(args.newest), freeze_text)
    vers = versions(python)
    say("versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()))
    work = WEEKLY / "notebooks"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "run_notebooks.py", work / "run_notebooks.py")
    results = []
    for nb in args.notebooks:
        r = run_one(python, nb.resolve(), work, args.smoke)
        say(f"{nb.name}: {'passed' if r['passed'] else 'FAILED'} in {r['seconds']} s")
        results.append(r)
    report = render(results, vers, args.smoke, source, colab_moved)
    (WEEKLY / "report.md").write_text(report)
    (WEEKLY / "results.json").write_text(json.dumps({"versions": vers, "results": results},
                                                    indent=1))
    print(report)
    if any(not r["passed"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The Colab-image check (`make colab`): the course as a Colab reader gets it.

1. An environment with Colab's pre-installed packages at Colab's versions
   (requirements/colab.txt, constrained by requirements/colab-freeze.txt: ipywidgets 7.7.1,
   ipykernel 6.17.1, ipython 7.34.0, numpy 2.1.3, matplotlib 3.10.0, transformers 5.15.0, ...),
   cached in _build/colab/venv and rebuilt when those files change or the venv drifted.
2. The wheel of this repository (``make wheel``'s, the release's), installed by running
   every notebook's own setup cell (tools/setup_cell.py) with the wheel in place of
   ``git+REPO_URL``. Fails if pip changed or removed ANY package that was there before;
   lists what it added.
3. Every notebook run small (SMOKE=True) on that environment's kernel, from a folder outside
   the repository, two at a time; tinyk3 must be imported from the installed wheel. Every
   chapter runs once, every other one from its Japanese edition (ja/notebooks/, whose code
   cells `make translations` proves identical to the English ones), so both editions' notebooks
   run on the Colab image at the cost of one. The
   executed notebooks (with their ipywidgets 7 widget state) are kept in
   _build/colab/executed/ for tests/test_widgets_ipywidgets7.py.
4. The venv is put back as it was (tinyk3 and anything the install added are removed).

    .venv/bin/python tools/colab_check.py [--notebooks notebooks/01_gpt2.ipynb ...] [--rebuild]
        [--wheel dist/tinyk3-VERSION-py3-none-any.whl]   (make colab passes make wheel's)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from setup_cell import PACKAGE_LINE, setup_source  # noqa: E402

COLAB = ROOT / "_build" / "colab"
VENV = COLAB / "venv"
EXECUTED = COLAB / "executed"
REQUIREMENTS = ROOT / "requirements" / "colab.txt"
FREEZE = ROOT / "requirements" / "colab-freeze.txt"
BASE_PYTHON = os.environ.get("COLAB_CHECK_PYTHON", "python3")
# Colab's versions of the packages the issue names; checked after the venv is built, so a
# constraints file that stopped applying cannot go unnoticed.
EXPECT = {"ipywidgets": "7.7.1", "ipykernel": "6.17.1", "ipython": "7.34.0",
          "numpy": "2.1.3", "matplotlib": "3.10.0", "tqdm": "4.67.3",
          "transformers": "5.15.0"}


def say(msg: str) -> None:
    print(f"colab check: {msg}", flush=True)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    return subprocess.run([str(c) for c in cmd], **kw)


def quiet_pip(stderr: str) -> str:
    """pip's stderr without this machine's 'Location file:... is ignored' noise."""
    return "\n".join(line for line in stderr.splitlines() if "Location 'file:" not in line)


def freeze(python: Path) -> dict[str, str]:
    out = run([python, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
              capture_output=True, text=True).stdout
    pairs = (line.split("==", 1) for line in out.splitlines() if "==" in line)
    return {name.lower().replace("_", "-"): version for name, version in pairs}


def env_key() -> str:
    version = run([BASE_PYTHON, "-c", "import sys; print(sys.version)"],
                  capture_output=True, text=True).stdout
    h = hashlib.sha1(REQUIREMENTS.read_bytes() + FREEZE.read_bytes() + version.encode())
    return h.hexdigest()[:12]


def base_venv(rebuild: bool) -> tuple[Path, dict[str, str]]:
    """The cached Colab-image venv and its package list, (re)built if needed."""
    python = VENV / "bin" / "python"
    stamp = VENV / "colab-image.json"
    key = env_key()
    if not rebuild and stamp.is_file() and python.is_file():
        saved = json.loads(stamp.read_text())
        if saved["key"] == key and saved["packages"] == freeze(python):
            say(f"reusing {VENV.relative_to(ROOT)} (Colab image {key})")
            return python, saved["packages"]
        say("the cached Colab-image venv is stale or was changed: rebuilding it")
    shutil.rmtree(VENV, ignore_errors=True)
    t0 = time.perf_counter()
    run([BASE_PYTHON, "-m", "venv", VENV])
    # --no-compile: the bytecode of what the notebooks import is written as they import it
    # (make unexports PYTHONDONTWRITEBYTECODE), not all of every package's up front.
    done = run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                "--no-compile", "-r", REQUIREMENTS, "-c", FREEZE],
               capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"could not build the Colab image:\n{quiet_pip(done.stderr)[-3000:]}")
    packages = freeze(python)
    wrong = {p: (packages.get(p), v) for p, v in EXPECT.items() if packages.get(p) != v}
    if wrong:
        sys.exit(f"the Colab image has the wrong versions (have, Colab's): {wrong}")
    stamp.write_text(json.dumps({"key": key, "packages": packages}, indent=1))
    say(f"built the Colab image in {time.perf_counter() - t0:.0f} s: "
        + ", ".join(f"{p} {packages[p]}" for p in ["torch", *EXPECT]))
    return python, packages


def build_wheel(out: Path) -> Path:
    done = run([sys.executable, "-m", "build", "--wheel", "--outdir", out, ROOT],
               capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"building the wheel failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    (wheel,) = out.glob("tinyk3-*.whl")
    return wheel


def install_like_the_setup_cell(python: Path, wheel: Path, work: Path) -> None:
    source = setup_source()
    if source.count(PACKAGE_LINE) != 1:
        sys.exit(f"the setup cell has no single line {PACKAGE_LINE!r} to point at the wheel")
    cell = source.replace(PACKAGE_LINE, f"PACKAGE = {str(wheel)!r}")
    done = run([python, "-c", cell], cwd=work, capture_output=True, text=True, check=False,
               env={**os.environ, "PYTHONPATH": ""})
    print(done.stdout.strip())
    if done.returncode != 0:
        sys.exit(f"the setup cell failed on the Colab image:\n{quiet_pip(done.stderr)[-3000:]}")


def compare(before: dict[str, str], after: dict[str, str]) -> list[str]:
    changed = [f"{p}: {v} -> {after[p]}" for p, v in before.items() if p in after and after[p] != v]
    removed = [f"{p}: {v} removed" for p, v in before.items() if p not in after]
    return changed + removed


def run_notebooks(python: Path, notebooks: list[Path], work: Path, jobs: int = 2) -> None:
    """Run the notebooks small on the venv's kernel, `jobs` at a time, from `work`."""
    nb_dir = work / "notebooks"
    nb_dir.mkdir()
    for nb in notebooks:
        shutil.copy(nb, nb_dir / nb.name)
    shutil.copy(ROOT / "tools" / "run_notebooks.py", work / "run_notebooks.py")
    where = run([python, "-c", "import os, tinyk3; print(os.path.dirname(tinyk3.__file__))"],
                cwd=nb_dir, capture_output=True, text=True).stdout.strip()
    if not where.startswith(str(VENV)):
        sys.exit(f"tinyk3 imported from {where}, not from the installed wheel")
    # A user-level `python3` kernelspec would run another interpreter: the kernel must be ours.
    argv0 = run([python, "-c", "from jupyter_client.kernelspec import KernelSpecManager as K; "
                 "print(K().get_kernel_spec('python3').argv[0])"],
                cwd=nb_dir, capture_output=True, text=True).stdout.strip()
    if argv0 not in ("python", "python3") and not argv0.startswith(str(VENV)):
        sys.exit(f"the python3 kernel runs {argv0}, not the Colab-image venv")
    # Largest first, dealt round-robin, so the two runners end at about the same time.
    order = sorted(notebooks, key=lambda p: -p.stat().st_size)
    shares = [order[i::jobs] for i in range(jobs)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JUPYTER_PATH")}
    env.update(OMP_NUM_THREADS="1", MPLBACKEND="module://matplotlib_inline.backend_inline")
    procs = []
    for i, share in enumerate(s for s in shares if s):
        cmd = [python, work / "run_notebooks.py", "--param", "SMOKE=True",
               "--timings", work / f"timings-{i}.json", *[nb_dir / p.name for p in share]]
        procs.append(subprocess.Popen([str(c) for c in cmd], cwd=nb_dir, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit("a notebook failed on the Colab image (its error is printed above)")
    shutil.rmtree(EXECUTED, ignore_errors=True)
    shutil.copytree(nb_dir, EXECUTED)


def alternate_editions(notebooks: list[Path]) -> list[Path]:
    """Every second notebook (in name order) from the Japanese edition, where it has one."""
    out = []
    for i, nb in enumerate(sorted(notebooks, key=lambda p: p.name)):
        ja = ROOT / "ja" / "notebooks" / nb.name
        out.append(ja if i % 2 == 1 and ja.is_file() else nb)
    japanese = [p.name for p in out if p.parent.parent.name == "ja"]
    say(f"{len(japanese)} of {len(out)} notebooks from the Japanese edition: "
        + ", ".join(japanese))
    return out


def restore(python: Path, before: dict[str, str]) -> None:
    added = sorted(set(freeze(python)) - set(before))
    if added:
        run([python, "-m", "pip", "uninstall", "-y", "-q", *added], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--notebooks", nargs="*", type=Path,
                    default=sorted((ROOT / "notebooks").glob("*.ipynb")))
    ap.add_argument("--rebuild", action="store_true", help="rebuild the cached Colab image")
    ap.add_argument("--jobs", type=int, default=2, help="notebooks run at once")
    ap.add_argument("--wheel", type=Path, help="install this wheel (make dist's) instead of "
                    "building one")
    ap.add_argument("--english-only", action="store_true",
                    help="run every notebook from the English edition")
    args = ap.parse_args()
    if not args.english_only:
        args.notebooks = alternate_editions(args.notebooks)
    if args.wheel is not None and not args.wheel.is_file():
        sys.exit(f"no wheel at {args.wheel} (make wheel)")
    t0 = time.perf_counter()
    python, before = base_venv(args.rebuild)
    work = Path(tempfile.mkdtemp(prefix="tinyk3-colab."))
    try:
        wheel = args.wheel.resolve() if args.wheel else build_wheel(work / "dist")
        say(f"installing {wheel.name}")
        install_like_the_setup_cell(python, wheel, work)
        after = freeze(python)
        problems = compare(before, after)
        if problems:
            sys.exit("the setup cell changed packages the Colab image already had:\n  "
                     + "\n  ".join(problems))
        added = sorted(set(after) - set(before))
        say(f"the setup cell changed no pre-installed package ({len(before)} checked); "
            f"it added: {', '.join(f'{p} {after[p]}' for p in added)}")
        t1 = time.perf_counter()
        run_notebooks(python, [p.resolve() for p in args.notebooks], work, args.jobs)
        say(f"{len(args.notebooks)} notebooks ran small in {time.perf_counter() - t1:.0f} s "
            f"(total {time.perf_counter() - t0:.0f} s); executed copies in "
            f"{EXECUTED.relative_to(ROOT)}")
    finally:
        restore(python, before)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

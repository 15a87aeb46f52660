#!/usr/bin/env python3
"""Check, in about a second, that this machine has what `make book` / `make test` need.

    python3 tools/check_prereqs.py book     # before `make book`
    python3 tools/check_prereqs.py test     # before `make test` (adds Chromium and a
                                            # Japanese font, fonts-noto-cjk)
    python3 tools/check_prereqs.py test --packages   # just the Debian packages to install

Runs with the system Python and its standard library only, before any virtual environment
exists. On a miss it prints what is missing and ONE command that installs all of it, and
exits with status 1, so a fresh machine learns in seconds, not after minutes of tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

MIN_PYTHON = (3, 10)
CHROMIUM = os.environ.get("TINYK3_CHROMIUM", "/usr/bin/chromium")


def python_ok() -> str | None:
    if sys.version_info < MIN_PYTHON:
        return f"Python {'.'.join(map(str, MIN_PYTHON))}+ (this is {sys.version.split()[0]})"
    return None


def venv_ok() -> str | None:
    # Debian's python3 has `venv` but, without the python3-venv package, no ensurepip:
    # `python3 -m venv` then fails half-way. Making a throwaway one is the real test (~2 s).
    import tempfile

    if os.environ.get("TINYK3_PREREQS_SKIP_VENV") == "1":  # tests of the other checks
        return None
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "venv", os.path.join(tmp, "v")],
                              capture_output=True, text=True)
    if done.returncode != 0:
        return ("Python's venv module with pip (Debian: python3-venv); `python3 -m venv` said: "
                + (done.stderr or done.stdout).strip().splitlines()[-1][:200])
    return None


def command_ok(name: str) -> bool:
    return shutil.which(name) is not None


def chromium_ok() -> str | None:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"Chromium at {CHROMIUM} (the browser check; TINYK3_CHROMIUM points elsewhere)"
    try:
        out = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"a working Chromium at {CHROMIUM} ({exc})"
    return None if out else f"a working Chromium at {CHROMIUM} (`--version` printed nothing)"


def japanese_font_ok() -> str | None:
    """A font with Japanese glyphs, for the browser check of the Japanese site (without one,
    Chromium draws boxes and the pages' screenshots and widths mean nothing)."""
    fc_list = shutil.which("fc-list")
    if fc_list is None:
        return "fontconfig's fc-list (comes with Chromium) to find a Japanese font"
    out = subprocess.run([fc_list, ":lang=ja", "family"], capture_output=True, text=True).stdout
    return None if out.strip() else "a Japanese font (Noto CJK) for the Japanese site's check"


def main(argv: list[str]) -> int:
    args = argv[1:]
    packages_only = "--packages" in args
    args = [a for a in args if a != "--packages"]
    goal = args[0] if args else "test"
    if goal not in ("book", "test") or len(args) > 1:
        print(f"usage: {argv[0]} book|test [--packages]", file=sys.stderr)
        return 2
    missing: list[tuple[str, str | None]] = []  # (what, Debian package)
    if (msg := python_ok()) is not None:
        missing.append((msg, "python3"))
    if (msg := venv_ok()) is not None:
        missing.append((msg, "python3-venv"))
    for cmd, pkg in (("git", "git"), ("make", "make"), ("npm", "npm"), ("node", "nodejs")):
        if not command_ok(cmd):
            missing.append((f"`{cmd}`", pkg))
    if goal == "test" and (msg := chromium_ok()) is not None:
        missing.append((msg, "chromium"))
    if goal == "test" and (msg := japanese_font_ok()) is not None:
        missing.append((msg, "fonts-noto-cjk"))
    packages = list(dict.fromkeys(p for _, p in missing if p))
    if packages_only:  # for .ci/run: the Debian packages that would install what is missing
        print(" ".join(packages))
        return 0
    if not missing:
        print(f"prerequisites for `make {goal}`: all present")
        return 0
    print(f"`make {goal}` cannot start; this machine lacks:")
    for what, _ in missing:
        print(f"  - {what}")
    sudo = "" if hasattr(os, "geteuid") and os.geteuid() == 0 else "sudo "
    print("Install them with (Debian/Ubuntu):")
    print(f"  {sudo}apt-get update && {sudo}apt-get install -y --no-install-recommends "
          + " ".join(packages))
    print("then run the command again. (.ci/run installs these itself.)")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""The repository's tools: the prerequisite check, the setup cell's sync, the Colab-image
check's package comparison, and the site extension's links and chapter guide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import tinyk3_site  # noqa: E402

import colab_check  # noqa: E402
import setup_cell  # noqa: E402

PREREQS = ROOT / "tools" / "check_prereqs.py"


def _prereqs(*args, env=None):
    """The check, without its (slow, ~3 s) trial venv unless ``env`` re-enables it."""
    env = {**os.environ, "TINYK3_PREREQS_SKIP_VENV": "1", **(env or {})}
    return subprocess.run([sys.executable, str(PREREQS), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_prerequisites_present_here():
    done = _prereqs("book", env={"TINYK3_PREREQS_SKIP_VENV": "0"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all present" in done.stdout


def test_a_missing_chromium_is_named_with_one_install_command():
    done = _prereqs("test", env={"TINYK3_CHROMIUM": "/nonexistent/chromium"})
    assert done.returncode == 1
    out = done.stdout
    assert "Chromium at /nonexistent/chromium" in out
    commands = [line for line in out.splitlines() if "apt-get install" in line]
    assert len(commands) == 1 and commands[0].rstrip().endswith("chromium"), out
    # `book` does not need a browser.
    assert _prereqs("book", env={"TINYK3_CHROMIUM": "/nonexistent/chromium"}).returncode == 0
    # .ci/run reads the package names alone.
    names = _prereqs("test", "--packages", env={"TINYK3_CHROMIUM": "/nonexistent/chromium"})
    assert names.returncode == 0 and names.stdout.split() == ["chromium"]


def test_missing_commands_are_all_listed_in_the_same_command(tmp_path):
    # A PATH with only python itself: git, make, npm and node are missing.
    (tmp_path / "python3").symlink_to(sys.executable)
    done = _prereqs("book", env={"PATH": str(tmp_path)})
    assert done.returncode == 1, done.stdout
    (command,) = [line for line in done.stdout.splitlines() if "apt-get install" in line]
    for package in ("git", "make", "npm", "nodejs"):
        assert f" {package}" in command, command


def test_usage_errors_exit_2():
    assert _prereqs("deploy").returncode == 2


def test_every_notebook_has_the_setup_cell():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "setup_cell.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_colab_check_reports_changed_and_removed_packages_but_not_additions():
    before = {"torch": "2.11.0", "ipywidgets": "7.7.1", "numpy": "2.1.3"}
    after = {"torch": "2.11.0", "ipywidgets": "8.1.9", "tinyk3": "0.1.0"}
    assert sorted(colab_check.compare(before, after)) == [
        "ipywidgets: 7.7.1 -> 8.1.9", "numpy: 2.1.3 removed"]
    assert colab_check.compare(before, {**before, "tinyk3": "0.1.0"}) == []


def test_colab_check_installs_through_the_setup_cells_package_line():
    src = setup_cell.setup_source()
    assert src.count(setup_cell.PACKAGE_LINE) == 1


def test_colab_image_pins_the_published_versions():
    freeze = (ROOT / "requirements" / "colab-freeze.txt").read_text()
    for name, version in colab_check.EXPECT.items():
        assert f"{name}=={version}" in freeze, name
    assert "@" not in "".join(line for line in freeze.splitlines() if not line.startswith("#"))


def test_launch_links_open_the_notebook_in_the_repository():
    links = tinyk3_site.launch_links("https://github.com/o/r", "main", "notebooks/01_x.ipynb")
    assert links["Colab"] == ("https://colab.research.google.com/github/o/r/blob/main/"
                              "notebooks/01_x.ipynb")
    assert links["Kaggle"] == ("https://kaggle.com/kernels/welcome?src=https://github.com/o/r/"
                               "blob/main/notebooks/01_x.ipynb")
    assert tinyk3_site.site_url("https://github.com/My-Org/the-book") == \
        "https://my-org.github.io/the-book/"


def test_chapter_guide_reads_titles_times_and_exercises(tmp_path):
    nb = {"cells": [
        {"cell_type": "markdown", "source": ["# A title\n", "text"]},
        {"cell_type": "markdown", "source": "```{exercise} One\n```\n```{exercise} Two\n```"},
        {"cell_type": "code", "source": "", "outputs": [
            {"output_type": "stream", "text": ["This notebook ran in 73 s.\n"]}]},
    ]}
    (tmp_path / "notebooks").mkdir()
    import json

    (tmp_path / "notebooks" / "01_a.ipynb").write_text(json.dumps(nb))
    rows = tinyk3_site.chapter_rows(tmp_path, ["book/intro", "notebooks/01_a"])
    assert rows == [{"file": "notebooks/01_a", "title": "A title", "seconds": 73,
                     "exercises": 2}]


def test_ci_run_takes_its_package_list_from_the_prerequisite_check():
    text = (ROOT / ".ci" / "run").read_text()
    assert 'tools/check_prereqs.py "$prereqs" --packages' in text and 'make "$goal"' in text
    assert "goal=${1:-test}" in text  # make test by default
    # make test and make dist (the PDF is printed by Chromium) install the test prerequisites
    assert "test|dist) prereqs=test" in text

"""The notebooks' structure and stored outputs (fast: nothing is executed here).

Executing them is `make smoke` (nbval, small sizes), `make colab` (installed wheel only) and
`make book` (full size, outputs stored).
"""

from __future__ import annotations

import re
from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

from tinyk3 import checks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [c["file"] for part in toc["parts"] for c in part["chapters"]]


def _read(path: Path):
    return nbformat.read(path, as_version=4)


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _tags(cell) -> list[str]:
    return cell.metadata.get("tags", [])


def test_there_are_notebooks_and_the_toc_lists_each_once():
    assert NOTEBOOKS, "no notebooks found"
    listed = [f for f in _toc_files() if f.startswith("notebooks/")]
    assert sorted(listed) == sorted(f"notebooks/{p.stem}" for p in NOTEBOOKS)
    for f in _toc_files():
        assert any((ROOT / f).with_suffix(s).exists() for s in (".md", ".ipynb")), f


def test_colab_launch_buttons_are_configured():
    assert CONFIG["launch_buttons"]["colab_url"].startswith("https://colab.research.google.com")
    assert CONFIG["repository"]["url"].startswith("https://github.com/")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_setup_cell_installs_from_the_configured_repository(path):
    first = _code_cells(_read(path))[0]
    assert "hide-input" in _tags(first), "the setup cell should be hidden (tag hide-input)"
    urls = re.findall(r'^REPO_URL = "(.*)"$', first.source, re.MULTILINE)
    assert urls == [CONFIG["repository"]["url"]], (
        f"install cell uses {urls}, _config.yml says {CONFIG['repository']['url']!r}: "
        "run `python tools/sync_repo_url.py`"
    )
    assert 'f"git+{REPO_URL}"' in first.source and "google.colab" in first.source
    assert "tinyk3.setup(" in first.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_parameters_cell_defaults_to_full_size(path):
    cells = [c for c in _code_cells(_read(path)) if "parameters" in _tags(c)]
    assert len(cells) == 1, "exactly one cell tagged 'parameters'"
    assert re.search(r"^SMOKE = False\b", cells[0].source, re.MULTILINE)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_are_a_clean_full_run(path):
    nb = _read(path)
    code = _code_cells(nb)
    assert not any("injected-parameters" in _tags(c) for c in nb.cells), (
        "stored notebook has injected parameters: store a full-size run (make book)"
    )
    counts = [c.execution_count for c in code if c.source.strip()]
    assert counts == list(range(1, len(counts) + 1)), (
        "cells were not executed top to bottom on a fresh kernel: run `make book`"
    )
    for c in code:
        errors = [o for o in c.outputs if o.output_type == "error"]
        assert not errors or "raises-exception" in _tags(c), (
            f"stored error output in cell {c.execution_count}: {errors[0].ename}"
        )
    texts = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "Traceback" not in texts


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_widget_views_have_stored_state(path):
    nb = _read(path)
    views = [
        o.data["application/vnd.jupyter.widget-view+json"]["model_id"]
        for c in _code_cells(nb) for o in c.outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    if not views:
        pytest.skip("no widgets")
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    missing = [v for v in views if v not in state.get("state", {})]
    assert not missing, f"widget views without stored state (the site cannot render them): {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_source_py_and_ipynb_are_in_sync(path):
    src = ROOT / "notebooks" / "src" / f"{path.stem}.py"
    assert src.exists(), f"missing notebook source {src}"
    def cells(nb):
        return [(c.cell_type, c.source, sorted(_tags(c))) for c in nb.cells
                if "injected-parameters" not in _tags(c)]

    assert cells(jupytext.read(src)) == cells(_read(path)), (
        f"{path.name} and {src.name} differ: edit the .py, then `make notebooks` and `make book`"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_sys_path_tricks(path):
    text = path.read_text()
    assert "sys.path.insert" not in text and "sys.path.append" not in text


def _chapter(path: Path) -> int:
    return int(path.stem.split("_")[0])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_exercises_have_stub_check_and_folded_solution(path):
    nb = _read(path)
    cells = nb.cells
    ids = []
    for i, cell in enumerate(cells):
        for ex_id, fn in re.findall(r'checks\.run\("([^"]+)",\s*(\w+)\)', cell.source):
            assert ex_id in checks.EXERCISES, f"{ex_id} is not registered in tinyk3.checks"
            if fn.endswith("_mine"):
                ids.append(ex_id)
                stub = next(c for c in cells[:i] if f"def {fn}(" in c.source)
                assert "raise NotImplementedError" in stub.source
                out = "".join(o.get("text", "") for o in cell.outputs)
                assert "not attempted" in out, f"{ex_id}: the stub's check should say not attempted"
                assert "nbval-check-output" in _tags(cell)
            else:
                assert fn.endswith("_solution"), f"{fn}: name learner stubs *_mine, solutions *_solution"
                before = "".join(c.source for c in cells[max(0, i - 1) : i])
                after = "".join(c.source for c in cells[i + 1 : i + 2])
                assert "{solution-start}" in before and ":class: dropdown" in before, (
                    f"{ex_id}: solution cell must follow a folded solution-start"
                )
                assert "{solution-end}" in after, f"{ex_id}: solution cell must precede solution-end"
                out = "".join(o.get("text", "") for o in cell.outputs)
                assert "✔" in out, f"{ex_id}: the stored solution run should pass its check"
    chapter_ids = sorted(e.id for e in checks.EXERCISES.values() if e.chapter == _chapter(path))
    assert sorted(ids) == chapter_ids, "every exercise of this chapter appears in its notebook"
    assert len(ids) >= 2, "at least two exercises per chapter"
    assert len(re.findall(r"\{exercise\}", "".join(c.source for c in cells))) == len(ids)


def test_environment_yml_mirrors_the_pinned_requirements():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    assert "-r requirements/ci.txt" in pip and "-e ." in pip
    pinned = (ROOT / "requirements" / "ci.txt").read_text()
    for tool in ("jupyter-book==1.", "torch==", "papermill==", "nbval==", "ipywidgets==", "matplotlib=="):
        assert tool in pinned, f"{tool} missing from requirements/ci.txt"

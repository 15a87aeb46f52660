"""The notebooks' structure and stored outputs (fast: nothing is executed here).

Executing them is `make smoke` (nbval, small sizes), `make colab` (installed wheel only) and
`make book` (full size, outputs stored).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

from tinyk3 import checks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import setup_cell  # noqa: E402  (tools/setup_cell.py: the one copy of the setup cell)

#: Code in the notebooks fits the website's code blocks (and GitHub's, and Colab's).
CODE_COLUMNS = 88
#: Figures are shown unscaled in the website's text column (tinyk3.notebook.FIGSIZE).
MAX_FIGURE_CSS_PX = 690
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
def test_setup_cell_is_the_one_written_in_tools_setup_cell(path):
    """Every notebook starts with the same setup cell, for the repository in _config.yml;
    tools/colab_check.py runs exactly this cell on the Colab image."""
    first = _code_cells(_read(path))[0]
    assert "hide-input" in _tags(first), "the setup cell should be hidden (tag hide-input)"
    assert first.source == setup_cell.setup_source(CONFIG["repository"]["url"]), (
        "the setup cell differs from tools/setup_cell.py: run `python tools/setup_cell.py`")
    assert setup_cell.PACKAGE_LINE in first.source and "tinyk3.setup(" in first.source


def test_setup_cell_pins_every_installed_package():
    """The cell installs with a constraint on every installed package (nothing is upgraded
    under a running kernel) and only when tinyk3 is missing."""
    src = setup_cell.setup_source("https://github.com/o/r")
    assert 'REPO_URL = "https://github.com/o/r"' in src
    assert '"list", "--format=freeze"' in src and '"-c", pins.name, PACKAGE' in src
    assert 'find_spec("tinyk3") is None' in src


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


def _chapter(path: Path) -> int | None:
    """The chapter number of ``NN_name``; None for an appendix notebook (``A1_name``)."""
    head = path.stem.split("_")[0]
    return int(head) if head.isdigit() else None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_exercises_have_stub_check_and_folded_solution(path):
    nb = _read(path)
    cells = nb.cells
    ids = []
    for i, cell in enumerate(cells):
        calls = re.findall(r'checks\.run\("([^"]+)",\s*([\w.]+)\)', cell.source)
        # chapter 9's Triton exercise launches the learner's kernel through its own entry point
        # (a demonstrated wrong kernel, named for its mistake, is neither stub nor solution)
        calls += [("kernel.output_stage", fn)
                  for fn in re.findall(r'check_output_kernel\(([\w.]+)\)', cell.source)
                  if fn.endswith(("_mine", "_solution"))]
        calls += [("backward.adjoint_kernel", fn)  # chapter 21's, the same way
                  for fn in re.findall(r'check_adjoint_kernel\(([\w.]+)\)', cell.source)
                  if fn.endswith(("_mine", "_solution"))]
        for ex_id, fn in calls:
            assert ex_id in checks.EXERCISES, f"{ex_id} is not registered in tinyk3.checks"
            if fn.endswith("_mine"):
                ids.append(ex_id)
                stub = next(c for c in cells[:i] if f"def {fn}(" in c.source)
                assert "raise NotImplementedError" in stub.source
                out = " ".join("".join(o.get("text", "") for o in cell.outputs).split())
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
    if _chapter(path) is None:  # an optional appendix reading: no exercises of its own
        assert not ids, "exercises belong to chapters, not to appendix notebooks"
        return
    assert len(ids) >= 2, "at least two exercises per chapter"
    assert len(re.findall(r"\{exercise\}", "".join(c.source for c in cells))) == len(ids)


def test_environment_yml_mirrors_the_pinned_requirements():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    pinned = (ROOT / "requirements" / "ci.txt").read_text()
    pins = [line for line in pinned.splitlines() if line and not line.startswith("#")]
    assert [p for p in pip if "==" in p] == pins, "run `make environment`"
    assert "-e ." in pip and sum("==" not in p for p in pip) == 2  # the CPU index, the course
    for tool in ("jupyter-book==1.", "torch==", "papermill==", "nbval==", "ipywidgets==", "matplotlib=="):
        assert tool in pinned, f"{tool} missing from requirements/ci.txt"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_code_fits_in_88_columns(path):
    long = [(i, len(line), line[:60]) for i, c in enumerate(_read(path).cells)
            if c.cell_type == "code" for line in c.source.splitlines()
            if len(line) > CODE_COLUMNS]
    assert not long, (f"{len(long)} code lines over {CODE_COLUMNS} columns "
                      f"(cell, length, start): {long[:5]}")


def _image_cells(nb):
    return [c for c in _code_cells(nb)
            if any("image/png" in o.get("data", {}) for o in c.outputs)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_figures_have_captions_alt_text_and_fit_the_page(path):
    """Every figure cell carries myst-nb metadata with a caption and alt text that describes
    it, makes one figure, and stores it at retina resolution no wider than the text column."""
    cells = _image_cells(_read(path))
    names = []
    for c in cells:
        where = f"cell {c.execution_count} ({c.source.splitlines()[0][:50]!r})"
        meta = c.metadata.get("mystnb", {})
        caption = meta.get("figure", {}).get("caption", "")
        alt = meta.get("image", {}).get("alt", "")
        assert len(caption.split()) >= 5, f"{where}: no caption (mystnb.figure.caption)"
        assert len(alt.split()) >= 8 and not re.search(r"[$\\`]|\.png", alt), (
            f"{where}: alt text {alt!r} should describe the figure in plain words")
        names.append(meta.get("figure", {}).get("name"))
        images = [o for o in c.outputs if "image/png" in o.get("data", {})]
        assert len(images) == 1, f"{where}: {len(images)} figures in one cell (one per cell)"
        size = images[0].get("metadata", {}).get("image/png", {})
        assert size.get("width"), f"{where}: stored without the retina display size"
        assert size["width"] <= MAX_FIGURE_CSS_PX, (
            f"{where}: {size['width']} px wide, over {MAX_FIGURE_CSS_PX} (squeezed on the site)")
    assert all(names) and len(set(names)) == len(names), f"figure names missing or repeated: {names}"


def test_figure_names_are_unique_across_the_book():
    names = [c.metadata["mystnb"]["figure"].get("name") for p in NOTEBOOKS
             for c in _image_cells(_read(p)) if "mystnb" in c.metadata]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_widget_sliders_show_labels(path):
    """Stored widgets use only what ipywidgets 7.7 and 8 share (no Stack) and label their
    sliders with values (SelectionSlider), never a bare IntSlider index."""
    state = _read(path).metadata.get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}).get("state", {})
    if not state:
        pytest.skip("no widgets")
    names = {m["model_name"] for m in state.values()}
    assert not names & {"StackModel", "IntSliderModel"}, names & {"StackModel", "IntSliderModel"}
    sliders = [m for m in state.values() if m["model_name"] == "SelectionSliderModel"]
    assert sliders, "a widget notebook with no SelectionSlider"
    for m in sliders:
        assert m["state"]["_options_labels"], "a slider without labels"

"""The widgets under ipywidgets 7.7, Colab's version, rendered by ipywidgets 7's own front end.

`make colab` runs every notebook on the Colab image (ipywidgets 7.7.1) and keeps the executed
copies, with their ipywidgets 7 widget state, in _build/colab/executed/. Here each notebook's
widgets are put on a page with the HTML manager of the ipywidgets 7 line
(@jupyter-widgets/html-manager 0.20.1, from npm as `html-manager-ipywidgets7`), opened in
headless Chromium at desktop and phone widths, and checked as on the website: rendered with
no error, tab bars of the picture stacks hidden, sliders that show the notebook's values and
fit a phone, and pictures that change when a slider moves (jslink, no kernel).

This is not Colab's own front end (which cannot run offline), but the same ipywidgets 7
JavaScript models and views that Colab loads for ipywidgets 7 output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from site_browser import (
    JS_WIDGETS_DONE,
    VIEWPORTS,
    PageLog,
    check_widgets,
    chromium,
    serve,
    wait,
    widget_labels,
)

REPO = Path(__file__).resolve().parents[1]
EXECUTED = REPO / "_build" / "colab" / "executed"
MANAGER = REPO / "node_modules" / "html-manager-ipywidgets7" / "dist"
REQUIRE = REPO / "node_modules" / "requirejs" / "require.js"
SHOTS = REPO / "_build" / "screenshots" / "ipywidgets7"
STATE_MIME = "application/vnd.jupyter.widget-state+json"
VIEW_MIME = "application/vnd.jupyter.widget-view+json"

NOTEBOOKS = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb")
                   if VIEW_MIME in p.read_text(encoding="utf-8"))


def page_html(nb: dict) -> str:
    state = nb["metadata"]["widgets"][STATE_MIME]
    views = [o["data"][VIEW_MIME] for c in nb["cells"] if c["cell_type"] == "code"
             for o in c.get("outputs", []) if VIEW_MIME in o.get("data", {})]
    blocks = "\n".join(
        f'<div class="cell_output"><script type="{VIEW_MIME}">{json.dumps(v)}</script></div>'
        for v in views)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<script src="require.js"></script>
<script src="embed-amd.js"></script>
<script type="{STATE_MIME}">{json.dumps(state)}</script>
</head><body style="margin: 8px">
{blocks}
</body></html>"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not MANAGER.is_dir() or not REQUIRE.is_file():
        pytest.fail("node_modules lacks html-manager-ipywidgets7 or requirejs: run `make vendor`",
                    pytrace=False)
    if not EXECUTED.is_dir():
        pytest.fail(f"no {EXECUTED.relative_to(REPO)}: run `make colab` first", pytrace=False)
    root = tmp_path_factory.mktemp("ipywidgets7")
    for f in MANAGER.iterdir():
        if f.is_file() and not f.name.endswith(".map"):
            shutil.copy(f, root / f.name)
    shutil.copy(REQUIRE, root / "require.js")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with serve(root) as base, chromium() as browser:
        yield root, base, browser


@pytest.mark.browser  # runs after `make colab` in `make test` (the browser step)
def test_every_widget_notebook_was_run_on_the_colab_image():
    if not EXECUTED.is_dir():
        pytest.fail(f"no {EXECUTED.relative_to(REPO)}: run `make colab` first", pytrace=False)
    assert NOTEBOOKS, "no notebook has widgets"
    missing = [n for n in NOTEBOOKS if not (EXECUTED / n).is_file()]
    assert not missing, f"not run by `make colab`: {missing}"


@pytest.mark.browser
@pytest.mark.parametrize("view", list(VIEWPORTS))
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_widgets_render_and_respond_under_ipywidgets7(served, name, view):
    root, base, browser = served
    path = EXECUTED / name
    if not path.is_file():
        pytest.fail(f"{name} was not run by `make colab`", pytrace=False)
    nb = json.loads(path.read_text(encoding="utf-8"))
    state = nb["metadata"].get("widgets", {}).get(STATE_MIME)
    assert state, f"{name}: the Colab-image run stored no widget state"
    models = {m["model_module_version"] for m in state["state"].values()
              if m["model_module"] == "@jupyter-widgets/controls"}
    assert models == {"1.5.0"}, f"{name}: expected ipywidgets 7 models (controls 1.5.0), got {models}"
    (root / f"{path.stem}.html").write_text(page_html(nb), encoding="utf-8")

    context = browser.new_context(**VIEWPORTS[view])
    page = context.new_page()
    log = PageLog(page, context)
    problems: list[str] = []
    try:
        page.goto(f"{base}{path.stem}.html", wait_until="load")
        wait(page, problems, JS_WIDGETS_DONE, "widgets did not finish rendering")
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(SHOTS / f"{view}-{path.stem}.png"), full_page=True)
        # Colab draws its own widgets: the site's 24 px handles (site.css) are not asked of it
        check_widgets(page, problems, labels=widget_labels(state), phone=view == "phone",
                      min_handle=None)
    finally:
        context.close()
    # The 7.x manager asks unpkg.com for Font Awesome's fonts (no widget here uses an icon).
    report = [p for p in log.report() if not ("unpkg.com" in p and "fontawesome" in p.lower())]
    problems = report + problems
    assert not problems, f"{name} at {view} width under ipywidgets 7:\n  " + "\n  ".join(problems)

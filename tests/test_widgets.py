"""tinyk3.widgets: pictures switched by labelled sliders, with what ipywidgets 7.7 and 8 share.

How they render and respond is checked in a browser: tests/test_site.py (ipywidgets 8, the
website) and tests/test_widgets_ipywidgets7.py (ipywidgets 7.7, the Colab-image run)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import ipywidgets as W  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from tinyk3 import widgets  # noqa: E402


def _png(title: str, width_in: float = 2.0) -> bytes:
    fig, ax = plt.subplots(figsize=(width_in, 1.5), dpi=100)
    ax.plot([0, 1], [0, 1])
    ax.set_title(title)
    return widgets.figure_png(fig)


def _walk(w):
    yield w
    for child in getattr(w, "children", ()):
        yield from _walk(child)


def test_figure_png_is_drawn_at_twice_its_display_size_and_closes_the_figure():
    fig, _ = plt.subplots(figsize=(3.0, 2.0), dpi=100)
    n_before = len(plt.get_fignums())
    png = widgets.figure_png(fig, scale=2)
    assert len(plt.get_fignums()) == n_before - 1
    w, h = widgets.png_size(png)
    # 3 in x 2 in at 200 pixels per inch, give or take what bbox_inches="tight" trims or adds.
    assert 0.8 * 600 < w <= 1.1 * 600 and 0.8 * 400 < h <= 1.1 * 400


def test_a_palette_makes_flat_plots_smaller():
    fig, ax = plt.subplots(figsize=(3, 2), dpi=100)
    ax.imshow([[0, 1], [1, 0]], cmap="Blues")
    full = widgets.figure_png(fig)
    fig, ax = plt.subplots(figsize=(3, 2), dpi=100)
    ax.imshow([[0, 1], [1, 0]], cmap="Blues")
    small = widgets.figure_png(fig, colors=16)
    assert widgets.png_size(small) == widgets.png_size(full)
    assert len(small) < len(full)


def test_png_size_rejects_other_bytes():
    with pytest.raises(ValueError, match="not PNG"):
        widgets.png_size(b"GIF89a....")


def test_grid_explorer_links_labelled_sliders_to_stacks_without_stack_or_intslider(monkeypatch):
    links = []
    jslink = W.jslink
    monkeypatch.setattr(W, "jslink", lambda a, b: links.append((a, b)) or jslink(a, b))
    pngs = [[_png(f"{r}{c}") for c in range(3)] for r in range(2)]
    box = widgets.image_grid_explorer(pngs, "view", "C", title="t",
                                      row_labels=["a", "b"], col_labels=[1, 4, 16])
    found = list(_walk(box))
    sliders = [w for w in found if isinstance(w, W.SelectionSlider)]
    assert [s.description for s in sliders] == ["view", "C"]
    assert [list(s._options_labels) for s in sliders] == [["a", "b"], ["1", "4", "16"]]
    assert not any(isinstance(w, W.IntSlider) for w in found)
    assert not any(type(w).__name__ == "Stack" for w in found)  # ipywidgets 8 only
    tabs = [w for w in found if isinstance(w, W.Tab)]
    assert len(tabs) == 1 + 2 and all(widgets.STACK_CLASS in t._dom_classes for t in tabs)
    # Every stack is driven by a slider's index, in the browser (jslink, no kernel).
    driven = {(a[0].model_id, b[0].model_id) for a, b in links
              if a[1] == "index" and b[1] == "selected_index"}
    outer = tabs[0]
    assert (sliders[0].model_id, outer.model_id) in driven
    for inner in outer.children:
        assert (sliders[1].model_id, inner.model_id) in driven
    # Pictures ask for their display size: half their pixels, never wider than the screen.
    image = outer.children[0].children[0]
    assert image.layout.width == f"{widgets.png_size(pngs[0][0])[0] // 2}px"
    assert image.layout.max_width == "100%"


def test_a_dimension_of_size_one_gets_no_slider():
    box = widgets.image_grid_explorer([[_png("a"), _png("b")]], "row", "col")
    sliders = [w for w in _walk(box) if isinstance(w, W.SelectionSlider)]
    assert [s.description for s in sliders] == ["col"]
    assert list(sliders[0]._options_labels) == ["0", "1"]


@pytest.mark.parametrize("pngs", [[], [[]], [[b"x"], [b"y", b"z"]], "nope"])
def test_bad_grids_are_refused(pngs):
    with pytest.raises(ValueError, match="rectangular"):
        widgets.image_grid_explorer(pngs, "r", "c")


def test_labels_must_match_and_differ():
    pngs = [[_png("a"), _png("b")]]
    with pytest.raises(ValueError, match="2 pictures"):
        widgets.image_grid_explorer(pngs, "r", "c", col_labels=[1, 2, 3])
    with pytest.raises(ValueError, match="differ"):
        widgets.image_grid_explorer(pngs, "r", "c", col_labels=[1, 1])

"""Widgets that keep working on the static website, in Colab and in Jupyter.

A Python callback (``interact``) needs a running kernel, which the website does not have.
These widgets precompute every view and switch between them with ``jslink``, which runs in
the browser, so the sliders also work on the built site and in a notebook viewer.

They use only what ipywidgets 7.7 (Colab's runtime) and ipywidgets 8 both have: a
``SelectionSlider`` whose synced ``index`` is linked to the ``selected_index`` of a ``Tab``
whose tab bar is hidden by a style rule (ipywidgets 8's ``Stack`` does not exist in 7).
The sliders show values, not indices; the controls wrap onto separate lines on a phone;
pictures are drawn at twice their display size, so they stay sharp on high-density screens.
"""

from __future__ import annotations

import io
import struct

#: Pictures are rendered at this many device pixels per CSS pixel.
RETINA = 2

#: CSS class of the Tabs used as a stack of pictures: the rule in ``STACK_STYLE`` hides
#: their tab bar (ipywidgets 7 names it ``p-TabBar``, ipywidgets 8 ``lm-TabBar``).
STACK_CLASS = "tinyk3-stack"
STACK_STYLE = (
    f"<style>.{STACK_CLASS} > .p-TabBar, .{STACK_CLASS} > .lm-TabBar "
    "{display: none !important;}"
    f" .{STACK_CLASS} > .widget-tab-contents, .{STACK_CLASS} > .p-TabPanel-stackedPanel,"
    f" .{STACK_CLASS} > .lm-TabPanel-stackedPanel"
    " {border: none !important; padding: 0 !important;}</style>"
)


def figure_png(fig, *, scale: int = RETINA, colors: int | None = None) -> bytes:
    """Render a matplotlib figure to PNG bytes and close it.

    ``scale``: device pixels per CSS pixel (the figure's own dpi is one CSS pixel per dot).
    ``colors``: reduce to a palette of this many colours (a fraction of the bytes, the same
    look for flat-coloured plots); the widget pictures of a notebook are stored in it.
    """
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", dpi=fig.dpi * scale)
    plt.close(fig)
    png = buf.getvalue()
    if colors is None:
        return png
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors)
    buf = io.BytesIO()
    image.save(buf, format="png", optimize=True)
    return buf.getvalue()


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels, read from a PNG's header."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("not PNG bytes")
    return struct.unpack(">II", png[16:24])


def _labels(labels, n: int, what: str) -> list[str]:
    if labels is None:
        return [str(i) for i in range(n)]
    labels = [str(x) for x in labels]
    if len(labels) != n:
        raise ValueError(f"{what}: {len(labels)} labels for {n} pictures")
    if len(set(labels)) != n:
        raise ValueError(f"{what}: labels must differ from each other, got {labels}")
    return labels


def _slider(W, name: str, labels: list[str]):
    return W.SelectionSlider(
        options=[(label, i) for i, label in enumerate(labels)], value=0, description=name,
        continuous_update=True, readout=True, style={"description_width": "initial"},
        layout=W.Layout(width="100%", min_width="14em", max_width="26em"))


def _stack(W, children):
    tab = W.Tab(children=children)
    tab.selected_index = 0
    tab.add_class(STACK_CLASS)
    return tab


def image_grid_explorer(pngs: list[list[bytes]], row_name: str, col_name: str,
                        title: str = "", row_labels=None, col_labels=None,
                        scale: int = RETINA):
    """Two sliders choose one picture from a grid ``pngs[row][col]`` (all precomputed).

    ``row_labels`` / ``col_labels``: what each slider shows for each position (the values
    the pictures were drawn for, e.g. ``[1, 2, 4, 8]``); default ``0, 1, 2, ...``. A
    dimension of size one gets no slider. ``scale``: the pictures' device pixels per CSS
    pixel (``figure_png``'s ``scale``).
    """
    import ipywidgets as W

    if (not pngs or not isinstance(pngs, list) or not all(isinstance(r, list) for r in pngs)
            or not pngs[0] or not all(len(row) == len(pngs[0]) for row in pngs)):
        raise ValueError("pngs must be a non-empty rectangular list of lists of PNG bytes")
    n_rows, n_cols = len(pngs), len(pngs[0])
    rows = _labels(row_labels, n_rows, row_name)
    cols = _labels(col_labels, n_cols, col_name)

    def image(png):
        width = png_size(png)[0] // scale
        return W.Image(value=png, format="png", layout=W.Layout(
            width=f"{width}px", max_width="100%", height="auto"))

    col_slider = _slider(W, col_name, cols) if n_cols > 1 else None
    inner = []
    for row in pngs:
        stack = _stack(W, [image(png) for png in row])
        if col_slider is not None:
            W.jslink((col_slider, "index"), (stack, "selected_index"))
        inner.append(stack)
    outer = _stack(W, inner)
    row_slider = _slider(W, row_name, rows) if n_rows > 1 else None
    if row_slider is not None:
        W.jslink((row_slider, "index"), (outer, "selected_index"))

    sliders = [s for s in (row_slider, col_slider) if s is not None]
    parts = [W.HTML(STACK_STYLE + (f"<b>{title}</b>" if title else ""))]
    if sliders:
        parts.append(W.HBox(sliders, layout=W.Layout(flex_flow="row wrap", width="100%")))
    return W.VBox(parts + [outer], layout=W.Layout(max_width="100%"))

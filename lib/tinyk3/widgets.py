"""Widgets that keep working on the static website.

A Python callback (``interact``) needs a running kernel, which the website does not have.
These widgets precompute every view and switch between them with ``jslink``, which runs in
the browser, so the sliders also work on the built site and in a notebook viewer.
"""

from __future__ import annotations

import io


def figure_png(fig) -> bytes:
    """Render a matplotlib figure to PNG bytes and close it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def image_grid_explorer(pngs: list[list[bytes]], row_name: str, col_name: str,
                        title: str = ""):
    """Two sliders choose one image from a grid ``pngs[row][col]`` (all precomputed)."""
    import ipywidgets as W

    if not pngs or not all(len(row) == len(pngs[0]) for row in pngs) or not pngs[0]:
        raise ValueError("pngs must be a non-empty rectangular list of lists of PNG bytes")
    n_rows, n_cols = len(pngs), len(pngs[0])
    row_slider = W.IntSlider(value=0, min=0, max=n_rows - 1, description=row_name)
    col_slider = W.IntSlider(value=0, min=0, max=n_cols - 1, description=col_name)
    inner = []
    for row in pngs:
        stack = W.Stack([W.Image(value=png, format="png") for png in row], selected_index=0)
        W.jslink((col_slider, "value"), (stack, "selected_index"))
        inner.append(stack)
    outer = W.Stack(inner, selected_index=0)
    W.jslink((row_slider, "value"), (outer, "selected_index"))
    parts = [W.HTML(f"<b>{title}</b>")] if title else []
    return W.VBox(parts + [W.HBox([row_slider, col_slider]), outer])

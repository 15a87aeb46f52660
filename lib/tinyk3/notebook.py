"""What every chapter's first cell calls: threads, seeds, plot style, and a version line."""

from __future__ import annotations

import os
import random


def in_colab() -> bool:
    import sys

    return "google.colab" in sys.modules


#: Default figure size in inches: at the figure dpi of 100, 680 CSS pixels, what the website's
#: text column shows without shrinking (tests/test_site.py measures the column).
FIGSIZE = (6.8, 3.5)


def _retina_figures() -> None:
    """Inline figures at twice the pixels, displayed at their size (only inside IPython)."""
    try:
        from IPython import get_ipython

        if get_ipython() is None:
            return
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:  # pragma: no cover - plain Python, or a very old IPython
        return
    set_matplotlib_formats("retina")


def _colab_widgets() -> None:
    try:
        import ipywidgets

        if int(ipywidgets.__version__.split(".")[0]) >= 8:
            from google.colab import output

            output.enable_custom_widget_manager()
    except Exception as exc:  # pragma: no cover - only in Colab
        print(f"note: could not enable Colab's widget manager ({exc}); widgets may not show")


def setup(seed: int = 0, threads: int | None = None, quiet: bool = False) -> None:
    """Make a notebook run the same way everywhere.

    * threads: ``OMP_NUM_THREADS`` if set, else 1. The course's tensors are small; on a laptop
      CPU one thread avoids the cost of waking the others for every small matmul (measured 7×
      faster on a 2-core machine).
    * seeds Python's and PyTorch's generators;
    * a plain matplotlib style with readable sizes; figures 6.8 inches (680 CSS pixels) wide
      by default, the width of the website's text column, so they are shown unscaled there;
    * in a notebook, figures drawn at twice their size ("retina"), sharp on high-density
      screens and still shown at their size;
    * in Colab with ipywidgets 8 or newer, Colab's custom widget manager, without which
      ipywidgets 8 does not render there (Colab ships ipywidgets 7.7, which needs nothing).
    """
    import torch

    if threads is None:
        threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import matplotlib as mpl

        mpl.rcParams.update({
            "figure.figsize": FIGSIZE, "figure.dpi": 100, "axes.grid": True,
            "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
        })
    except ImportError:  # pragma: no cover
        pass
    _retina_figures()
    if in_colab():
        _colab_widgets()
    if not quiet:
        from . import __version__

        where = "Colab" if in_colab() else "local"
        print(f"tinyk3 {__version__} · torch {torch.__version__} · {threads} thread(s) · "
              f"seed {seed} · {where}")


def show_source(obj) -> None:
    """Display the source of a ``tinyk3`` function or class in the notebook (one copy: lib's)."""
    import inspect

    from IPython.display import Code, display

    display(Code(inspect.getsource(obj), language="python"))


def plain_doc(obj) -> str:
    """``obj``'s docstring as a reader sees it printed: reStructuredText markup removed
    (``code`` and :role:`target` become their text; a ``~`` path keeps its last part)."""
    import inspect
    import re

    doc = inspect.getdoc(obj) or ""
    doc = re.sub(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`",
                 lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1),
                 doc)
    return re.sub(r"``([^`]+)``", r"\1", doc)


def source_diff(old, new, old_name: str, new_name: str) -> str:
    """The changed lines between the sources of two functions: ``-`` lines are ``old``'s,
    ``+`` lines ``new``'s, unchanged lines left out, after a count of each.

    The chapters use it to show what a new rule changes in an older one (chapter 10's chunk
    step against chapter 8's, the gated kernels against chapter 9's). ``old`` or ``new`` may be
    a tuple of functions, whose sources are read one after the other (a kernel and the helper
    it moved part of its body into)."""
    import difflib
    import inspect

    def source(f):
        parts = f if isinstance(f, tuple) else (f,)
        return [line for part in parts for line in inspect.getsource(part).splitlines()]

    a, b = source(old), source(new)
    lines = list(difflib.unified_diff(a, b, old_name, new_name, n=0, lineterm=""))
    body = [x for x in lines[2:] if not x.startswith("@@")]
    plus = sum(x.startswith("+") for x in body)
    minus = sum(x.startswith("-") for x in body)
    head = (f"{new_name}: {len(b)} lines, {plus} added, {minus} removed "
            f"({old_name}: {len(a)} lines)")
    return "\n".join([head, *body])

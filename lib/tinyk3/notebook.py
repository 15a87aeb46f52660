"""What every chapter's first cell calls: threads, seeds, plot style, and a version line."""

from __future__ import annotations

import os
import random


def in_colab() -> bool:
    import sys

    return "google.colab" in sys.modules


def setup(seed: int = 0, threads: int | None = None, quiet: bool = False) -> None:
    """Make a notebook run the same way everywhere.

    * threads: ``OMP_NUM_THREADS`` if set, else 1. The course's tensors are small; on a laptop
      CPU one thread avoids the cost of waking the others for every small matmul (measured 7×
      faster on a 2-core machine).
    * seeds Python's and PyTorch's generators;
    * a plain matplotlib style with readable sizes.
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
            "figure.figsize": (7.0, 3.6), "figure.dpi": 100, "axes.grid": True,
            "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
        })
    except ImportError:  # pragma: no cover
        pass
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

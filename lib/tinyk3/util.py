"""Small helpers every chapter uses."""

from __future__ import annotations

import torch

__all__ = ["max_diff", "moving_mean"]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute entry of ``a - b``, computed in float64 (so bfloat16 or float16 inputs
    are compared exactly), as a Python float. Shapes must broadcast."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise TypeError(f"max_diff takes two tensors, got {type(a).__name__} and {type(b).__name__}")
    d = a.detach().to(torch.float64) - b.detach().to(device=a.device, dtype=torch.float64)
    return d.abs().max().item() if d.numel() else 0.0


def moving_mean(values, window: int = 10) -> list[float]:
    """The mean of each value and the ``window − 1`` before it (fewer at the start): a
    training curve smoothed for a plot, as long as ``values``."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"moving_mean: window must be a positive int, got {window!r}")
    values = [float(v) for v in values]
    return [sum(values[max(0, i - window + 1): i + 1]) / min(window, i + 1)
            for i in range(len(values))]


def import_without_fla(name: str):
    """Import ``transformers``' modelling module ``name`` afresh with fla and causal_conv1d
    hidden, and return it.

    With fla installed, ``transformers``' Qwen3-Next and Kimi Linear modules bind fla's Triton
    kernels when they are imported, and their forward passes then fail on a CPU ("0 active
    drivers"); hidden, they use their own PyTorch forms. ``sys.modules`` is put back as it was
    afterwards, except for ``name`` itself, which stays imported. Raises ``ImportError`` if
    ``transformers`` (or that module) is missing: the chapters catch it and say so.
    """
    import importlib
    import sys

    hidden = ("fla", "causal_conv1d", name)
    saved = {m: sys.modules.get(m, "absent") for m in hidden}
    sys.modules["fla"] = sys.modules["causal_conv1d"] = None  # `import fla` raises ImportError
    sys.modules.pop(name, None)  # a copy imported earlier may have bound fla's kernels
    try:
        return importlib.import_module(name)
    finally:
        for m, mod in saved.items():
            if mod == "absent":
                if m != name:
                    sys.modules.pop(m, None)
            else:
                sys.modules[m] = mod

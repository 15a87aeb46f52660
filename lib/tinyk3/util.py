"""Small helpers every chapter uses."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["max_diff", "moving_mean", "random_value", "randomise_"]


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


def random_value(name: str, shape, generator: torch.Generator, *,
                 decay: tuple[float, float] = (0.01, 16.0), dt_shift: float = -3.0,
                 norm_centre: float = 1.0) -> torch.Tensor:
    """A float32 value for a parameter called ``name`` of ``shape``, drawn from ``generator``
    by the rules :func:`randomise_` applies (one tensor, for code that holds names and shapes
    rather than a module)."""
    if name.endswith("A_log"):  # exp(A_log): decay rates spread over ``decay``
        return torch.empty(shape).uniform_(*decay, generator=generator).log()
    if name.endswith("dt_bias"):  # dt = softplus(… + dt_bias): small steps, spread
        return torch.randn(shape, generator=generator) + dt_shift
    if "norm" in name:  # norm weights near their centre, not all equal
        return norm_centre + 0.2 * torch.randn(shape, generator=generator)
    return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])  # N(0, 1/fan_in)


def randomise_(module: torch.nn.Module, seed: int = 0, *,
               decay: tuple[float, float] = (0.01, 16.0), dt_shift: float = -3.0,
               norm_centre: float | Callable[[str], float] = 1.0,
               bias_std: float | None = None) -> torch.nn.Module:
    """Give every parameter of ``module`` a random value, in place, and return the module.

    Comparing two implementations at their initialisation proves little (gates that all decay
    alike, norm weights of exactly 1, zero biases hide whole classes of mistakes), so the
    chapters and the oracle tests draw every parameter, in ``named_parameters`` order from one
    generator seeded with ``seed``:

    * ``…A_log``: the log of a uniform draw over ``decay`` (decays from weak to strong);
    * ``…dt_bias``: ``N(dt_shift, 1)``;
    * a name containing ``norm``: ``N(norm_centre, 0.2²)`` (``norm_centre`` may be a function
      of the name, for models whose norms store ``1 + w``);
    * anything else: ``N(0, 1/fan_in)`` with ``fan_in = shape[-1]``.

    With ``bias_std``, the routers' ``e_score_correction_bias`` buffers are drawn afterwards
    from ``N(0, bias_std²)``; other buffers are left alone.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"randomise_ takes a torch.nn.Module, got {type(module).__name__}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            centre = norm_centre(name) if callable(norm_centre) else norm_centre
            p.copy_(random_value(name, tuple(p.shape), gen, decay=decay, dt_shift=dt_shift,
                                 norm_centre=centre))
        if bias_std is not None:
            for name, b in module.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(bias_std * torch.randn(b.shape, generator=gen))
    return module


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

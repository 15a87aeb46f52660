"""Small helpers every chapter uses."""

from __future__ import annotations

import torch

__all__ = ["max_diff"]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute entry of ``a - b``, computed in float64 (so bfloat16 or float16 inputs
    are compared exactly), as a Python float. Shapes must broadcast."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise TypeError(f"max_diff takes two tensors, got {type(a).__name__} and {type(b).__name__}")
    d = a.detach().to(torch.float64) - b.detach().to(device=a.device, dtype=torch.float64)
    return d.abs().max().item() if d.numel() else 0.0

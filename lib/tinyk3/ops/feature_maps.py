"""Feature maps φ for linear attention (chapter 3): ``exp(q·k)`` is replaced by ``φ(q)·φ(k)``.

Each maps ``[..., D] -> [..., D']``. Non-negative maps keep every score ``φ(q)·φ(k) ≥ 0``, so
the normalised output stays a weighted average of values, as softmax attention's is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["elu_plus_one", "relu", "softplus", "identity", "taylor2", "FEATURE_MAPS", "get"]


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """``ELU(x) + 1`` (Katharopoulos et al., 2020): positive, ``≈ 1 + x`` near 0, ``→ 0`` for x → −∞.

    Written as ``exp(min(x, 0)) + max(x, 0)``, the same function: ``F.elu(x) + 1`` computes
    ``1 + (eˣ − 1)``, which rounds to exactly 0 below x ≈ −17 in float32.
    """
    return torch.exp(x.clamp(max=0)) + x.clamp(min=0)


def relu(x: torch.Tensor) -> torch.Tensor:
    """``max(x, 0)``: non-negative, but a query can score exactly 0 against every key."""
    return F.relu(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + eˣ)``: a smooth, strictly positive ReLU."""
    return F.softplus(x)


def identity(x: torch.Tensor) -> torch.Tensor:
    """No map: scores ``q·k`` can be negative, so the normaliser can vanish or change sign."""
    return x


def taylor2(x: torch.Tensor) -> torch.Tensor:
    """Second-order Taylor features: ``φ(q)·φ(k) = 1 + q·k + (q·k)²/2 ≈ exp(q·k)``.

    ``[..., D] -> [..., 1 + D + D²]`` (the map used by the Based architecture); ``1 + s + s²/2``
    is positive for every ``s``, so the normaliser is safe. Scale q and k by ``D^{-1/4}`` first
    to approximate ``exp(q·k/√D)``.
    """
    ones = torch.ones_like(x[..., :1])
    outer = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2.0)  # [..., D²]
    return torch.cat([ones, x, outer], dim=-1)


FEATURE_MAPS = {
    "elu+1": elu_plus_one,
    "relu": relu,
    "softplus": softplus,
    "identity": identity,
    "taylor2": taylor2,
}


def get(name: str):
    """The feature map called ``name`` (one of ``FEATURE_MAPS``)."""
    try:
        return FEATURE_MAPS[name]
    except KeyError:
        raise ValueError(f"unknown feature map {name!r}; choose one of {sorted(FEATURE_MAPS)}") from None

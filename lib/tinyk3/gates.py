"""Forget gates as real models parametrise them (chapters 10 to 12): from a pre-activation ``x``
(a projection of the token) to the log decay ``g ≤ 0`` that :mod:`tinyk3.ops.gated_delta_rule`
and :mod:`tinyk3.ops.kda` take.

* :func:`softplus_gate`, Mamba-2's and Gated DeltaNet's form (also Kimi Linear's KDA, per
  channel): ``g = −exp(A_log) · softplus(x + dt_bias)``. ``softplus(x + dt_bias)`` plays the role
  of a time step ``dt > 0`` and ``exp(A_log) > 0`` of a decay rate; ``g`` is unbounded below.
* :func:`lower_bound_gate`, Kimi K3's KDA form: ``g = lower_bound · sigmoid(exp(A_log) · (x +
  dt_bias))`` with ``lower_bound = −5``: ``g ∈ [−5, 0]``, so ``exp(−Σg)`` over a 16-token
  sub-chunk stays below ``e^80`` and float32 kernels can factorise it (chapter 11).

Initialisation as fla's layers do it (``fla/layers/gated_deltanet.py``, ``fla/layers/kda.py``,
fla 0.6.0): ``A = exp(A_log)`` uniform in ``(0, 16)`` for Gated DeltaNet (``(1, 16)`` for KDA), and
``dt_bias = softplus⁻¹(dt)`` with ``dt`` log-uniform in ``[1e-3, 1e-1]``, so at ``x = 0`` the
gate is ``g = −A · dt``. Shapes: ``x`` is ``[B, H, T]`` (one gate per head) or ``[B, H, T, Dk]``
(one per channel); ``A_log [H]``; ``dt_bias [H]`` or ``[H, Dk]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._validate import positive_int

__all__ = ["softplus_gate", "lower_bound_gate", "init_A_log", "init_dt_bias", "half_life",
           "LOWER_BOUND"]

LOWER_BOUND = -5.0  # Kimi K3's KDA gate: the released config's gate_lower_bound


def _per_head(p: torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    """``p [H]`` or ``[H, Dk]`` viewed to broadcast against ``x [B, H, T]`` or ``[B, H, T, Dk]``."""
    if x.dim() not in (3, 4):
        raise ValueError(f"gates: x must be [B, H, T] or [B, H, T, Dk], got {tuple(x.shape)}")
    H = x.shape[1]
    if p.dim() == 1 and p.shape[0] == H:
        return p.view(H, 1) if x.dim() == 3 else p.view(H, 1, 1)
    if p.dim() == 2 and x.dim() == 4 and tuple(p.shape) == (H, x.shape[-1]):
        return p.view(H, 1, x.shape[-1])
    want = "[H]" if x.dim() == 3 else "[H] or [H, Dk]"
    raise ValueError(f"gates: {name} must be {want} for x of shape {tuple(x.shape)}, got "
                     f"{tuple(p.shape)}")


def _work(x: torch.Tensor) -> torch.dtype:
    """The dtype a gate is computed in: float32 at least (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def softplus_gate(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """``g = −exp(A_log) · softplus(x + dt_bias)`` (computed in float32 at least, returned in
    ``x``'s dtype). Always ``< 0``; no lower bound."""
    w = _work(x)
    dt = F.softplus((x + _per_head(dt_bias, x, "dt_bias")).to(w))
    A = _per_head(A_log, x, "A_log").to(w).exp()
    return (-A * dt).to(x.dtype)


def lower_bound_gate(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                     lower_bound: float = LOWER_BOUND) -> torch.Tensor:
    """``g = lower_bound · sigmoid(exp(A_log) · (x + dt_bias))``, in ``(lower_bound, 0)``
    mathematically; in float32 the sigmoid rounds to exactly 1 (or 0) for large ``|z|``, so
    ``g`` lies in ``[lower_bound, 0]`` (computed in float32 at least)."""
    if not lower_bound < 0:
        raise ValueError(f"gates: lower_bound must be negative, got {lower_bound}")
    w = _work(x)
    z = _per_head(A_log, x, "A_log").to(w).exp() * (x + _per_head(dt_bias, x, "dt_bias")).to(w)
    return (lower_bound * torch.sigmoid(z)).to(x.dtype)


def init_A_log(n_heads: int, *, low: float = 0.0, high: float = 16.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """``log A`` with ``A ~ U(low, high)``, one per head: fla's Gated DeltaNet uses ``(0, 16)``,
    its KDA ``(1, 16)``. float32 ``[n_heads]``."""
    n = positive_int(n_heads, "n_heads", "init_A_log")
    if not 0 <= low < high:
        raise ValueError(f"init_A_log: need 0 <= low < high, got low={low}, high={high}")
    A = torch.empty(n).uniform_(low, high, generator=generator)
    return A.clamp_min(torch.finfo(torch.float32).tiny).log()


def init_dt_bias(*shape: int, dt_min: float = 1e-3, dt_max: float = 1e-1,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """``dt_bias = softplus⁻¹(dt)`` with ``dt`` log-uniform in ``[dt_min, dt_max]``, so that
    ``softplus(0 + dt_bias) = dt``. ``softplus⁻¹(y) = y + log(−expm1(−y))`` (stable for small y).
    float32 of ``shape`` (``[H]`` for Gated DeltaNet, ``[H, Dk]`` for KDA)."""
    if not shape:
        raise ValueError("init_dt_bias: give a shape, e.g. init_dt_bias(H) or init_dt_bias(H, Dk)")
    for s in shape:
        positive_int(s, "shape", "init_dt_bias")
    if not 0 < dt_min < dt_max:
        raise ValueError(f"init_dt_bias: need 0 < dt_min < dt_max, got {dt_min}, {dt_max}")
    u = torch.rand(*shape, generator=generator)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return dt + torch.log(-torch.expm1(-dt))


def half_life(g: torch.Tensor | float) -> torch.Tensor:
    """Tokens until a memory decays to half under a constant log decay ``g < 0`` per token:
    ``exp(g · n) = ½  ⇔  n = ln 2 / (−g)`` (``inf`` for ``g = 0``)."""
    g = torch.as_tensor(g, dtype=torch.float64)
    return math.log(2.0) / (-g)

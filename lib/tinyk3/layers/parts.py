"""The parts several layers share, in one neutral place (no mixer module imports another):
RMSNorm, the norm of every model after GPT-2; the gated RMSNorm and the l2 normalisation of the
delta-rule layers (KDA, Gated DeltaNet); and rotary position embedding (RoPE; Su et al.,
*RoFormer*, arXiv 2104.09864), in both channel layouts the course meets.

RoPE rotates each pair of channels of a query or key by an angle proportional to the token's
position, ``θ_i · t`` with ``θ_i = theta^(−2i/D)``, so the score ``q_s · k_t`` depends on the
positions only through ``s − t``. Which channels form a pair is a layout choice:

* ``interleaved=False`` (rotate-half; Llama, Qwen, and ``transformers``' ``rotate_half``): channel
  ``i`` pairs with ``i + D/2``;
* ``interleaved=True`` (DeepSeek-V2/V3's checkpoints): channel ``2i`` pairs with ``2i + 1``.

The two are the same rotation after a fixed permutation of channels, applied to q and k alike,
so scores agree and rotated tensors do not. ``transformers``' DeepSeek-V3 code
(``apply_rotary_pos_emb_interleave``) returns its rotated q and k de-interleaved, evens first;
:func:`rope` with ``interleaved=True`` keeps the input's interleaved layout.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._validate import positive_int

__all__ = ["rope", "rope_frequencies", "RMSNorm", "GatedRMSNorm", "l2_normalize", "L2_EPS",
           "work_dtype"]

L2_EPS = 1e-6  # fla's l2norm (and transformers' copies of it)


def rope_frequencies(dim: int, theta: float = 10000.0, *, device=None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``dim / 2`` angular frequencies ``theta^(−2i/dim)`` (float32: ``transformers``' ``inv_freq``)."""
    dim = positive_int(dim, "dim", "rope_frequencies")
    if dim % 2:
        raise ValueError(f"rope_frequencies: dim must be even, got {dim}")
    if not theta > 0:
        raise ValueError(f"rope_frequencies: theta must be positive, got {theta!r}")
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim))


def rope(x: torch.Tensor, positions: torch.Tensor, *, theta: float = 10000.0,
         interleaved: bool = False) -> torch.Tensor:
    """``x [..., T, D]`` rotated by its tokens' ``positions [T]`` (see the module docstring).

    The angles are computed in float32 and cast to ``x``'s dtype before the rotation, as
    ``transformers`` does, so the two agree to rounding; float64 inputs get float64 angles.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError("rope: x must be a tensor [..., T, D]")
    T, D = x.shape[-2], x.shape[-1]
    if D % 2:
        raise ValueError(f"rope: the rotated width must be even, got {D}")
    if not isinstance(positions, torch.Tensor) or positions.shape != (T,):
        raise ValueError(f"rope: positions must be a tensor [T={T}], got "
                         f"{getattr(positions, 'shape', positions)!r}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    freqs = positions.to(dt)[:, None] * rope_frequencies(D, theta, device=x.device, dtype=dt)
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)  # [T, D/2]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]  # pairs (2i, 2i+1)
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.flatten(-2)  # back to the interleaved layout
    x1, x2 = x[..., : D // 2], x[..., D // 2:]  # pairs (i, i + D/2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    """``x / √(mean(x²) + eps)`` times a weight, over the last dimension (Zhang & Sennrich 2019).

    ``centred=False``: the weight starts at ones and multiplies as is (DeepSeek-V3, Kimi);
    ``centred=True``: it starts at zeros and multiplies as ``1 + w`` (Qwen3-Next, "zero-centred",
    so weight decay pulls it towards the identity). Normalised in float32 (float64 for float64
    inputs); as in ``transformers``, the plain form casts back before the weight and the centred
    form after it.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, centred: bool = False):
        super().__init__()
        self.dim = positive_int(dim, "dim", "RMSNorm")
        if not eps > 0:
            raise ValueError(f"RMSNorm: eps must be positive, got {eps!r}")
        self.eps, self.centred = float(eps), bool(centred)
        self.weight = nn.Parameter(torch.zeros(dim) if centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: expected last dimension {self.dim}, got {tuple(x.shape)}")
        dt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        w = x.to(dt)
        y = w * torch.rsqrt(w.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.centred:
            return (y * (1.0 + self.weight.to(dt))).to(x.dtype)
        return self.weight * y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, centred={self.centred}"


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs, else the input's own dtype (as the fused kernels do)."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / √(Σ x² + eps)`` over the last dimension, fla's ``l2norm`` (``F.normalize`` takes
    ``max(‖x‖, eps)`` instead: the two differ by ``O(eps/‖x‖²)``). Computed in float32 at least."""
    w = x.to(work_dtype(x))
    return (w * torch.rsqrt((w * w).sum(-1, keepdim=True) + eps)).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``weight ⊙ x / rms(x) ⊙ act(gate)`` over the last dimension (one head), ``rms(x) =
    √(mean(x²) + eps)``; ``act`` is ``"sigmoid"`` (Kimi Linear's ``o_norm``) or ``"silu"``
    (Qwen3-Next's ``norm``). The weight starts at ones and multiplies as is (not ``1 + w``):
    ``transformers``' ``KimiLinearRMSNormGated`` and ``Qwen3NextRMSNormGated``. Computed in float32
    at least, returned in ``x``'s dtype."""

    _ACTS = {"sigmoid": torch.sigmoid, "silu": F.silu}

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "sigmoid"):
        super().__init__()
        self.dim = positive_int(dim, "dim", "GatedRMSNorm")
        if activation not in self._ACTS:
            raise ValueError(f"GatedRMSNorm: activation must be one of {sorted(self._ACTS)}, "
                             f"got {activation!r}")
        if not eps > 0:
            raise ValueError(f"GatedRMSNorm: eps must be positive, got {eps!r}")
        self.eps, self.activation = float(eps), activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.shape != gate.shape or x.shape[-1] != self.dim:
            raise ValueError(f"GatedRMSNorm: x and gate must share a shape [..., {self.dim}], got "
                             f"{tuple(x.shape)} and {tuple(gate.shape)}")
        dt = work_dtype(x)
        w = x.to(dt)
        y = w * torch.rsqrt(w.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(dt)
        return (y * self._ACTS[self.activation](gate.to(dt))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, activation={self.activation!r}"

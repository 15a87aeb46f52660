"""Conditioning and rounding error of the triangular solve in chunked DeltaNet (chapter 7).

A chunk of ``C`` tokens needs ``T = A⁻¹ diag(β)`` with the unit lower-triangular
``A = I + tril(diag(β) K Kᵀ, −1)`` (:mod:`tinyk3.ops.wy`). How hard that solve is depends on
the keys and the write strengths; these helpers measure it:

* :func:`chunk_keys`: test keys of a chunk, ``"unit"`` (L2-normalised, random directions),
  ``"correlated"`` (unit keys sharing one direction, pairwise cosine ≈ ``cos``) or ``"raw"``
  (unnormalised Gaussian, ``‖k‖² ≈ D``);
* :func:`condition_number`: the 2-norm condition number of each matrix, in float64;
* :func:`max_relative_error`: ``max |approx − exact| / max |exact|`` per matrix;
* :func:`ut_precision`: ``κ(A)``, ``max |T|`` and the relative error of ``T`` computed from keys
  stored in a low precision, against ``T`` in float64 from the exact keys.

Shapes: ``k [..., C, D]``, ``beta [..., C]``, matrices ``[..., C, C]``; results have the batch
shape ``[...]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._validate import positive_int
from .ops import wy

__all__ = ["chunk_keys", "condition_number", "max_relative_error", "ut_precision", "UTPrecision"]

KEY_KINDS = ("unit", "correlated", "raw")


def chunk_keys(
    kind: str,
    n: int,
    C: int,
    D: int,
    *,
    cos: float = 0.9,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``n`` chunks of ``C`` keys in ``D`` dimensions, ``[n, C, D]``.

    * ``"unit"``: random directions, ``‖k‖ = 1`` (what DeltaNet's L2 normalisation gives);
    * ``"correlated"``: ``k = normalise(√cos · m + √(1 − cos) · z)`` with one random unit ``m``
      per chunk and random unit ``z`` per key, so any two keys have cosine ≈ ``cos``;
    * ``"raw"``: standard Gaussian entries, not normalised (``‖k‖² ≈ D``).
    """
    if kind not in KEY_KINDS:
        raise ValueError(f"kind must be one of {KEY_KINDS}, got {kind!r}")
    n, C, D = (positive_int(x, name, "chunk_keys") for x, name in ((n, "n"), (C, "C"), (D, "D")))
    if not 0.0 <= cos < 1.0:
        raise ValueError(f"cos must be in [0, 1), got {cos}")
    z = torch.randn(n, C, D, generator=generator, dtype=dtype)
    if kind == "raw":
        return z
    z = F.normalize(z, dim=-1)
    if kind == "unit":
        return z
    m = F.normalize(torch.randn(n, 1, D, generator=generator, dtype=dtype), dim=-1)
    return F.normalize(cos**0.5 * m + (1.0 - cos) ** 0.5 * z, dim=-1)


def condition_number(A: torch.Tensor) -> torch.Tensor:
    """``κ₂(A) = σ_max / σ_min`` of each matrix ``[..., n, n]``, computed in float64."""
    return torch.linalg.cond(A.double())


def max_relative_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``max |approx − exact| / max |exact|`` over the last two dimensions, in float64.

    Non-finite entries in ``approx`` give ``inf`` (or ``nan``): an overflow is an error.
    """
    a, e = approx.double(), exact.double()
    return (a - e).abs().amax(dim=(-2, -1)) / e.abs().amax(dim=(-2, -1))


class UTPrecision(NamedTuple):
    cond: torch.Tensor  # κ₂(A) of each chunk, from the exact keys          [...]
    t_max: torch.Tensor  # max |T_ij| of each chunk, float64                 [...]
    error: torch.Tensor  # max relative error of the low-precision T         [...]


def ut_precision(
    k: torch.Tensor,
    beta: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    input_dtype: torch.dtype | None = None,
    method: str = "solve",
) -> UTPrecision:
    """How accurately ``T = (I + tril(diag(β) K Kᵀ, −1))⁻¹ diag(β)`` comes out in ``dtype``.

    The reference is ``T`` in float64 from the keys as given. The low-precision ``T`` stores
    ``k`` and ``β`` in ``input_dtype`` (default: ``dtype``; kernels read bfloat16 keys) and
    computes everything in ``dtype`` with :func:`tinyk3.ops.wy.ut_transform` (``method``:
    ``"solve"``, ``"forward"`` or ``"block"``). The error is :func:`max_relative_error`.
    """
    k64, b64 = k.double(), beta.double()
    T_ref = wy.ut_transform(k64, b64)
    stored = input_dtype or dtype
    T_low = wy.ut_transform(k.to(stored).to(dtype), beta.to(stored).to(dtype), method)
    return UTPrecision(
        cond=condition_number(wy.ut_matrix(k64, b64)),
        t_max=T_ref.abs().amax(dim=(-2, -1)),
        error=max_relative_error(T_low, T_ref),
    )

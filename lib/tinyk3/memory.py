"""Associative memory (chapter 4): the linear-attention state as a key→value store.

Write N pairs into one ``[Dk, Dv]`` matrix by adding outer products, read with a key:

    S = Σ_j k_jᵀ v_j = Kᵀ V                                   (write)
    k_i S = Σ_j (k_i·k_j) v_j = ‖k_i‖² v_i + Σ_{j≠i} (k_i·k_j) v_j   (read: value + crosstalk)

This is the correlation-matrix memory of Kohonen (1972) and Anderson (1972), and exactly the
additive state ``S_t = S_{t-1} + k_tᵀ v_t`` of :func:`tinyk3.ops.linear_attention.recurrent`.
Papers write the transpose (``S = Σ v_j k_jᵀ``, read ``S k_i``); see the notation page.

Shapes: ``keys [..., N, Dk]``, ``values [..., N, Dv]``, ``S [..., Dk, Dv]`` (leading batch
dimensions are allowed everywhere). The crosstalk formulas assume values whose coordinates are
independent, zero-mean and of unit variance, and independent of the keys.

* :func:`write_loop` (reference, one pair at a time) and :func:`write` (one matrix product);
* :func:`read`, :func:`relative_error`, :func:`recall_accuracy`: reading back and scoring;
* :func:`crosstalk_std` (given the keys), :func:`random_key_crosstalk_std` (random unit keys),
  :func:`min_crosstalk_std` (the best unit keys: the Welch bound);
* key sets: :func:`random_unit_keys`, :func:`orthonormal_keys`, :func:`harmonic_frame`;
* :func:`two_time_scales`: chapter 11's task, long- and short-lived facts in one head.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._validate import is_int, positive_int

__all__ = [
    "write_loop",
    "write",
    "read",
    "relative_error",
    "recall_accuracy",
    "crosstalk_std",
    "random_key_crosstalk_std",
    "min_crosstalk_std",
    "random_unit_keys",
    "orthonormal_keys",
    "harmonic_frame",
    "TwoScaleTask",
    "two_time_scales",
]


def _check_pairs(keys: torch.Tensor, values: torch.Tensor, op: str) -> None:
    if keys.dim() < 2 or values.dim() < 2:
        raise ValueError(f"{op}: keys and values need at least 2 dimensions [..., N, D], got "
                         f"{list(keys.shape)} and {list(values.shape)}")
    if keys.shape[:-1] != values.shape[:-1]:
        raise ValueError(f"{op}: keys {list(keys.shape)} and values {list(values.shape)} must "
                         "agree in every dimension but the last ([..., N, Dk] and [..., N, Dv])")
    if keys.dtype != values.dtype:
        raise TypeError(f"{op}: keys are {keys.dtype}, values {values.dtype}; use one dtype")


def _check_state(S: torch.Tensor, keys: torch.Tensor, op: str) -> None:
    if S.dim() < 2 or S.shape[-2] != keys.shape[-1]:
        raise ValueError(f"{op}: the state must be [..., Dk, Dv] with Dk = {keys.shape[-1]} "
                         f"(the keys' last dimension), got {list(S.shape)}")


# -- writing and reading ------------------------------------------------------------------------

def write_loop(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Reference: start from zero and add one outer product ``k_jᵀ v_j`` per pair."""
    _check_pairs(keys, values, "memory.write_loop")
    *batch, N, Dk = keys.shape
    S = keys.new_zeros(*batch, Dk, values.shape[-1])  # [..., Dk, Dv]
    for j in range(N):
        S = S + keys[..., j, :, None] * values[..., j, None, :]  # S += k_jᵀ v_j
    return S


def write(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``S = Kᵀ V = Σ_j k_jᵀ v_j``: all pairs in one matrix product. ``[..., Dk, Dv]``."""
    _check_pairs(keys, values, "memory.write")
    return keys.transpose(-1, -2) @ values


def read(S: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``o_i = q_i S`` for every query row: ``[..., N, Dk] @ [..., Dk, Dv] -> [..., N, Dv]``."""
    _check_state(S, queries, "memory.read")
    return queries @ S


def relative_error(S: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> float:
    """Relative RMS error of reading every stored pair back: ``√(Σ‖k_i S − v_i‖² / Σ‖v_i‖²)``.

    0 is exact recall; 1 means the error is as large as the values themselves. For random unit
    keys its expectation (squared) is ``(N − 1) / Dk``: see :func:`random_key_crosstalk_std`.
    """
    _check_pairs(keys, values, "memory.relative_error")
    err = read(S, keys) - values
    return math.sqrt(err.double().pow(2).sum().item() / values.double().pow(2).sum().item())


def recall_accuracy(S: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> float:
    """Fraction of keys whose read-out is closest to their own value among all stored values.

    For each key ``k_i`` the read-out ``r_i = k_i S`` is compared with every stored value ``v_j``
    (of the same batch element) by cosine similarity ``r_i·v_j / (‖r_i‖ ‖v_j‖)``; the recall is
    correct when the largest similarity is at ``j = i``. Returns a float in [0, 1], averaged over
    all keys (and batch elements). The comparison is scale-free, so it ignores ``‖k_i‖²``.
    """
    _check_pairs(keys, values, "memory.recall_accuracy")
    _check_state(S, keys, "memory.recall_accuracy")
    reads = read(S, keys)  # [..., N, Dv]
    unit = values / values.norm(dim=-1, keepdim=True)  # v_j / ‖v_j‖
    sim = reads @ unit.transpose(-1, -2)  # [..., N reads, N values]; ‖r_i‖ does not change argmax
    N = keys.shape[-2]
    hits = sim.argmax(dim=-1) == torch.arange(N, device=keys.device)  # [..., N]
    return hits.double().mean().item()


# -- crosstalk ------------------------------------------------------------------------------------

def crosstalk_std(keys: torch.Tensor) -> torch.Tensor:
    """Per key, the standard deviation of one coordinate of its crosstalk, given the keys.

    The crosstalk of key i is ``Σ_{j≠i} (k_i·k_j) v_j``; with independent unit-variance value
    coordinates its variance is ``Σ_{j≠i} (k_i·k_j)²``. Returns ``[..., N]``.
    """
    if keys.dim() < 2:
        raise ValueError(f"memory.crosstalk_std: keys must be [..., N, Dk], got {list(keys.shape)}")
    gram = keys @ keys.transpose(-1, -2)  # k_i·k_j   [..., N, N]
    N = keys.shape[-2]
    off = gram.masked_fill(torch.eye(N, dtype=torch.bool, device=keys.device), 0.0)  # j ≠ i
    return off.pow(2).sum(dim=-1).sqrt()


def random_key_crosstalk_std(n_pairs: int, dim: int) -> float:
    """``√((N − 1) / D)``: the crosstalk standard deviation per value coordinate for N keys drawn
    uniformly on the unit sphere of R^D (each ``(k_i·k_j)²`` has mean ``1/D``)."""
    _check_sizes(n_pairs, dim, "memory.random_key_crosstalk_std")
    return math.sqrt((n_pairs - 1) / dim)


def min_crosstalk_std(n_pairs: int, dim: int) -> float:
    """``√(max(0, N/D − 1))``: the smallest RMS crosstalk (over keys) any N unit keys in R^D can
    have (the Welch bound). Reached by orthonormal keys when N ≤ D, by tight frames beyond."""
    _check_sizes(n_pairs, dim, "memory.min_crosstalk_std")
    return math.sqrt(max(0.0, n_pairs / dim - 1.0))


def _check_sizes(n_pairs, dim, op):
    if not (is_int(n_pairs) and is_int(dim) and n_pairs >= 1 and dim >= 1):
        raise ValueError(f"{op}: N and D must be positive ints, got {n_pairs!r}, {dim!r}")


# -- key sets -------------------------------------------------------------------------------------

def _check_batch(batch, op):
    if batch is not None:
        positive_int(batch, "batch", op)


def random_unit_keys(n_pairs: int, dim: int, *, batch: int | None = None,
                     generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """N keys uniform on the unit sphere of R^D (normalised Gaussians): ``[N, D]``, or
    ``[batch, N, D]`` (``batch`` independent memories) when ``batch`` is given."""
    _check_sizes(n_pairs, dim, "memory.random_unit_keys")
    _check_batch(batch, "memory.random_unit_keys")
    shape = (n_pairs, dim) if batch is None else (batch, n_pairs, dim)
    k = torch.randn(shape, generator=generator, dtype=dtype)
    return k / k.norm(dim=-1, keepdim=True)


def orthonormal_keys(n_pairs: int, dim: int, *, batch: int | None = None,
                     generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """N random orthonormal keys in R^D (rows of a QR factor), ``K Kᵀ = I``: ``[N, D]``, or
    ``[batch, N, D]`` when ``batch`` is given (each memory its own random basis). Needs N ≤ D."""
    _check_sizes(n_pairs, dim, "memory.orthonormal_keys")
    _check_batch(batch, "memory.orthonormal_keys")
    if n_pairs > dim:
        raise ValueError(f"memory.orthonormal_keys: at most D = {dim} vectors of R^{dim} can be "
                         f"orthonormal, asked for N = {n_pairs}")
    if batch is not None:
        return torch.stack([orthonormal_keys(n_pairs, dim, generator=generator, dtype=dtype)
                            for _ in range(batch)])
    a = torch.randn(dim, n_pairs, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)  # q: [D, N] with orthonormal columns
    q = q * torch.sign(torch.diagonal(r))  # a unique, uniformly random choice of signs
    return q.T.contiguous().to(dtype)  # [N, D]


def harmonic_frame(n_pairs: int, dim: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """N unit keys in R^D with ``KᵀK = (N/D) I`` (an equal-norm tight frame), for N > D, D even.

    Key n is ``√(2/D) [cos(2π n m/N), sin(2π n m/N)]`` for frequencies m = 1..D/2. Every key has
    the same crosstalk, ``Σ_{j≠i} (k_i·k_j)² = N/D − 1``: the Welch bound, the least possible.
    """
    _check_sizes(n_pairs, dim, "memory.harmonic_frame")
    if dim % 2 or n_pairs <= dim:
        raise ValueError(f"memory.harmonic_frame: needs an even D and N > D, got N = {n_pairs}, "
                         f"D = {dim}")
    n = torch.arange(n_pairs, dtype=torch.float64)[:, None]
    m = torch.arange(1, dim // 2 + 1, dtype=torch.float64)[None, :]
    angle = 2 * math.pi * n * m / n_pairs  # [N, D/2]
    k = torch.cat([angle.cos(), angle.sin()], dim=-1) * math.sqrt(2 / dim)  # [N, D]
    return k.to(dtype)


# -- chapter 11: two time scales in one head ----------------------------------------------------

class TwoScaleTask(NamedTuple):
    """``q, k, v [B, 1, T, D]`` (one head, ``T = n_long + n_stream``); query ``i`` of
    ``at`` asks for the value of token ``src[i]``; the first ``n_long`` tokens are the long facts,
    written into key channels ``0 .. n_long-1``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    src: torch.Tensor
    at: torch.Tensor
    n_long: int


def two_time_scales(batch: int, n_stream: int, *, seed: int, n_long: int = 16, Dk: int = 32,
                    Dv: int = 16, max_lag: int = 4,
                    dtype: torch.dtype = torch.float64) -> TwoScaleTask:
    """Long- and short-lived facts in one head (chapter 11's experiment).

    ``n_long`` long facts come first, with orthonormal keys in key channels ``0 .. n_long-1``
    (recalled from the final state, not by a query). Then ``n_stream`` short facts, random unit
    keys in the other channels; at stream token ``t`` the query is the key of stream token
    ``t − ℓ_t``, ``ℓ_t`` uniform in ``1 .. max_lag``, while token ``t`` writes its own pair.
    Queries that would reach before the stream (the first tokens of it) are not scored: they
    are left out of ``src``/``at``. Values are random unit vectors. Deterministic in ``seed``."""
    op = "memory.two_time_scales"
    batch, n_stream = positive_int(batch, "batch", op), positive_int(n_stream, "n_stream", op)
    n_long, Dk = positive_int(n_long, "n_long", op), positive_int(Dk, "Dk", op)
    Dv, max_lag = positive_int(Dv, "Dv", op), positive_int(max_lag, "max_lag", op)
    if n_long >= Dk:
        raise ValueError(f"{op}: the long facts need fewer channels than Dk = {Dk}, "
                         f"got n_long = {n_long}")
    gen = torch.Generator().manual_seed(seed)
    T = n_long + n_stream
    k = torch.zeros(batch, T, Dk, dtype=dtype)
    k[:, :n_long, :n_long] = orthonormal_keys(n_long, n_long, batch=batch, generator=gen,
                                              dtype=dtype)
    stream = torch.randn(batch, n_stream, Dk - n_long, generator=gen, dtype=dtype)
    k[:, n_long:, n_long:] = torch.nn.functional.normalize(stream, dim=-1)
    v = torch.randn(batch, T, Dv, generator=gen, dtype=dtype)
    v = torch.nn.functional.normalize(v, dim=-1)
    lag = torch.randint(1, max_lag + 1, (n_stream,), generator=gen)
    t = torch.arange(n_stream)
    src = n_long + (t - lag).clamp_min(0)  # the token whose key is asked for
    q = torch.zeros_like(k)
    q[:, n_long:] = k[:, src]
    asked = t >= lag  # queries that reach back into the stream
    return TwoScaleTask(*(x.unsqueeze(1) for x in (q, k, v)), src[asked], n_long + t[asked],
                        n_long)

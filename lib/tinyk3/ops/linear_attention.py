"""Linear attention (chapter 3): attention whose scores are a dot product of feature maps.

With non-negative features ``φ(q), φ(k)`` in place of ``exp(q·k)``, the causal sum
``o_t = Σ_{j≤t} (φ(q_t)·φ(k_j)) v_j`` can be re-associated as ``φ(q_t) S_t`` with a state
``S_t = Σ_{j≤t} φ(k_j)ᵀ v_j`` of fixed size ``[Dk, Dv]``. These functions take the features
already applied (``q`` here means ``φ(q)``): no feature map, scaling or normalisation of q and
k happens inside; layers do that (see :mod:`tinyk3.ops.feature_maps`).

Forms, all with one contract (``tests/test_linear_attention.py`` checks them equal):

* :func:`recurrent`: the token loop, ``S_t = S_{t-1} + k_tᵀ v_t``, ``o_t = q_t S_t``;
* :func:`parallel`: the masked quadratic form ``o = (q kᵀ ⊙ M) v`` (plus ``q S_0``).

With ``normalize=True`` the output is divided by ``q_t · z_t``, ``z_t = Σ_{j≤t} k_j`` (the
original linear transformer's normaliser), and the state is the pair ``(S, z)``.

Shapes: ``q, k: [B, H, T, Dk]``, ``v: [B, H, T, Dv]``, ``S: [B, H, Dk, Dv]``, ``z: [B, H, Dk]``.
"""

from __future__ import annotations

import torch

from .._validate import check_qkv
from .chunks import chunk_size as check_chunk_size
from .chunks import exclusive_scan_, from_chunks, to_chunks
from .chunks import initial_state as initial_state_

__all__ = ["recurrent", "parallel", "chunked"]


def _initial(initial_state, normalize, B, H, Dk, Dv, like, op):
    """Zero state, or the given one checked and cast to float32+ for accumulation: ``(S, z)``,
    ``z`` None without the normaliser."""
    if initial_state is None or not normalize:
        if isinstance(initial_state, (tuple, list)):
            raise TypeError(f"{op}: with normalize=False, initial_state is S alone, not a pair")
        S = initial_state_(initial_state, (B, H, Dk, Dv), like, op, "initial_state S")
        z = initial_state_(None, (B, H, Dk), like, op) if normalize else None
        return S, z
    if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
        raise TypeError(f"{op}: with normalize=True, initial_state must be the pair (S, z)")
    S, z = initial_state
    for name, x in (("initial_state S", S), ("initial z", z)):
        if x is None:  # None would mean "zeros" to initial_state_; in a pair it is a mistake
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got NoneType")
    z = initial_state_(z, (B, H, Dk), like, op, "initial z")
    return initial_state_(S, (B, H, Dk, Dv), like, op, "initial_state S"), z


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    normalize: bool = False,
    initial_state=None,
    eps: float = 1e-6,
):
    """Reference token loop. Returns ``(o [B, H, T, Dv], final_state)``.

    ``final_state`` is ``S`` or, with ``normalize=True``, ``(S, z)``; pass it back as
    ``initial_state`` to continue (prefill, then decode one token at a time).
    """
    B, H, T, Dk, Dv = check_qkv(q, k, v, "linear_attention.recurrent")
    S, z = _initial(initial_state, normalize, B, H, Dk, Dv, q, "linear_attention.recurrent")
    acc = S.dtype
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, :, t].to(acc), k[:, :, t].to(acc), v[:, :, t].to(acc)  # [B, H, D]
        S = S + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)  # S_t = S_{t-1} + k_tᵀ v_t   [B, H, Dk, Dv]
        o_t = torch.einsum("bhk,bhkv->bhv", q_t, S)  # o_t = q_t S_t              [B, H, Dv]
        if normalize:
            z = z + k_t  # z_t = z_{t-1} + k_t                                    [B, H, Dk]
            o_t = o_t / ((q_t * z).sum(-1, keepdim=True) + eps)  # ÷ q_t · z_t
        outs.append(o_t)
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, Dv, dtype=acc)
    return o.to(v.dtype), ((S, z) if normalize else S)


def parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    normalize: bool = False,
    initial_state=None,
    eps: float = 1e-6,
):
    """Masked quadratic form: ``o = (q kᵀ ⊙ M) v + q S_0``. Same contract as :func:`recurrent`.

    ``O(T² D)`` work and a ``[T, T]`` score matrix, like softmax attention, but no softmax.
    """
    B, H, T, Dk, Dv = check_qkv(q, k, v, "linear_attention.parallel")
    S0, z0 = _initial(initial_state, normalize, B, H, Dk, Dv, q, "linear_attention.parallel")
    acc, out_dtype = S0.dtype, v.dtype
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # M: j <= i
    scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, 0.0)  # (q kᵀ ⊙ M)   [B, H, T, T]
    o = scores @ v + q @ S0  # [B, H, T, Dv]
    S = S0 + k.transpose(-1, -2) @ v  # S_T = S_0 + Kᵀ V                     [B, H, Dk, Dv]
    if normalize:
        denom = scores.sum(-1, keepdim=True) + (q @ z0.unsqueeze(-1))  # q_t · z_t  [B, H, T, 1]
        o = o / (denom + eps)
        z = z0 + k.sum(dim=2)
        return o.to(out_dtype), (S, z)
    return o.to(out_dtype), S


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int = 64,
    normalize: bool = False,
    initial_state=None,
    eps: float = 1e-6,
):
    """Chunkwise form (chapter 6): quadratic attention inside chunks of ``C`` tokens, the state
    across them. Same contract as :func:`recurrent`; any ``T`` (the last chunk may be short).

    For chunk ``c`` with rows ``Q_[c], K_[c], V_[c]`` and the state ``S_[c]`` left by the chunks
    before:

        O_[c]   = Q_[c] S_[c] + (Q_[c] K_[c]ᵀ ⊙ M) V_[c]        (inter-chunk + intra-chunk)
        S_[c+1] = S_[c] + K_[c]ᵀ V_[c]

    The states ``S_[c]`` are an exclusive prefix sum of the per-chunk ``K_[c]ᵀ V_[c]``: every
    product is computed at once (one batched product), the sum runs over the chunks in place
    (:func:`tinyk3.ops.chunks.exclusive_scan_`, one ``Dk × Dv`` addition per chunk), and every
    chunk's output is again computed at once. ``O(T C D + T D²)`` work in matrix products.
    ``C = 1`` is the recurrence, ``C ≥ T`` the parallel form.
    """
    op = "linear_attention.chunked"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    C = check_chunk_size(chunk_size, op)
    S0, z0 = _initial(initial_state, normalize, B, H, Dk, Dv, q, op)
    acc, out_dtype = S0.dtype, v.dtype
    Qc, Kc, Vc = (to_chunks(t.to(acc), C) for t in (q, k, v))  # [B, H, N, C, D]
    states = Kc.transpose(-1, -2) @ Vc  # every K_[c]ᵀ V_[c] at once        [B, H, N, Dk, Dv]
    S = exclusive_scan_(states, S0)  # now states[:, :, c] = S_[c]; S = S_[N], the final state
    # in place where a copy would cost a pass over memory: at large C the N score blocks are
    # large, and at small C the N states are
    scores = (Qc @ Kc.transpose(-1, -2)).tril_()  # Q_[c] K_[c]ᵀ ⊙ M          [B, H, N, C, C]
    o = Qc @ states  # Q_[c] S_[c]: the earlier chunks                     [B, H, N, C, Dv]
    o += scores @ Vc  # + (Q_[c] K_[c]ᵀ ⊙ M) V_[c]: this chunk
    if normalize:
        zs = Kc.sum(dim=3)  # 1ᵀ K_[c], the sum of each chunk's keys           [B, H, N, Dk]
        z = exclusive_scan_(zs, z0)  # zs[:, :, c] = z_[c]
        denom = (Qc @ zs.unsqueeze(-1)) + scores.sum(-1, keepdim=True)  # q_t · z_t [B, H, N, C, 1]
        o = o / (denom + eps)
    o = from_chunks(o, T)  # drop the padding                                [B, H, T, Dv]
    if normalize:
        return o.to(out_dtype), (S, z)
    return o.to(out_dtype), S

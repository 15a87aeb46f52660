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

from ._checks import check_qkv, check_state

__all__ = ["recurrent", "parallel", "chunked"]


def _initial(initial_state, normalize, B, H, Dk, Dv, like, op):
    """Zero state, or the given one checked and cast to float32+ for accumulation."""
    acc = torch.promote_types(like.dtype, torch.float32)
    if initial_state is None:
        S = like.new_zeros(B, H, Dk, Dv, dtype=acc)
        z = like.new_zeros(B, H, Dk, dtype=acc) if normalize else None
        return S, z
    if normalize:
        if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
            raise TypeError(f"{op}: with normalize=True, initial_state must be the pair (S, z)")
        S, z = initial_state
        check_state(z, (B, H, Dk), like, op, "initial z")
    else:
        if isinstance(initial_state, (tuple, list)):
            raise TypeError(f"{op}: with normalize=False, initial_state is S alone, not a pair")
        S, z = initial_state, None
    check_state(S, (B, H, Dk, Dv), like, op, "initial_state S")
    return S.to(acc), None if z is None else z.to(acc)


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


def _check_chunk_size(chunk_size, op: str) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """``[B, H, T, D]`` → ``[B, H, N, C, D]``, zero-padding the last chunk (``N = ⌈T / C⌉``)."""
    B, H, T, D = x.shape
    pad = (-T) % C
    if pad:
        x = torch.cat([x, x.new_zeros(B, H, pad, D)], dim=2)
    return x.view(B, H, (T + pad) // C, C, D)


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

    For chunk ``c`` with rows ``Q_c, K_c, V_c`` and the state ``S_c`` left by the chunks before:

        O_c     = Q_c S_c + (Q_c K_cᵀ ⊙ M) V_c        (inter-chunk + intra-chunk)
        S_{c+1} = S_c + K_cᵀ V_c

    The states ``S_c`` are an exclusive prefix sum of the per-chunk ``K_cᵀ V_c``, so every chunk
    is computed at once: ``O(T C D + T D²)`` work in matrix products. ``C = 1`` is the
    recurrence, ``C ≥ T`` the parallel form.
    """
    op = "linear_attention.chunked"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    C = _check_chunk_size(chunk_size, op)
    S0, z0 = _initial(initial_state, normalize, B, H, Dk, Dv, q, op)
    acc, out_dtype = S0.dtype, v.dtype
    Qc, Kc, Vc = (_to_chunks(t.to(acc), C) for t in (q, k, v))  # [B, H, N, C, D]
    kv = Kc.transpose(-1, -2) @ Vc  # K_cᵀ V_c per chunk                 [B, H, N, Dk, Dv]
    S_all = torch.cat([S0.unsqueeze(2), S0.unsqueeze(2) + kv.cumsum(dim=2)], dim=2)  # [B, H, N+1, Dk, Dv]
    S_before = S_all[:, :, :-1]  # the state each chunk starts from        [B, H, N, Dk, Dv]
    mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # M: j ≤ i
    scores = (Qc @ Kc.transpose(-1, -2)).masked_fill(~mask, 0.0)  # Q_c K_cᵀ ⊙ M  [B, H, N, C, C]
    o = Qc @ S_before + scores @ Vc  # [B, H, N, C, Dv]
    S = S_all[:, :, -1]  # [B, H, Dk, Dv]
    if normalize:
        kz = Kc.sum(dim=3)  # Σ of each chunk's keys                         [B, H, N, Dk]
        z_all = torch.cat([z0.unsqueeze(2), z0.unsqueeze(2) + kz.cumsum(dim=2)], dim=2)
        z_before = z_all[:, :, :-1]  # [B, H, N, Dk]
        denom = (Qc @ z_before.unsqueeze(-1)) + scores.sum(-1, keepdim=True)  # q_t · z_t [B, H, N, C, 1]
        o = o / (denom + eps)
    o = o.reshape(B, H, -1, Dv)[:, :, :T]  # drop the padding              [B, H, T, Dv]
    if normalize:
        return o.to(out_dtype), (S, z_all[:, :, -1])
    return o.to(out_dtype), S

"""The delta rule (chapter 5): DeltaNet's state update, one token at a time.

Each token first reads what the state currently stores at its key, then writes back only the
difference, scaled by a write strength ``β_t ∈ [0, 1]``:

    v_old_t = k_t S_{t-1}
    S_t     = S_{t-1} + k_tᵀ β_t (v_t − v_old_t)   =  (I − β_t k_tᵀ k_t) S_{t-1} + β_t k_tᵀ v_t
    o_t     = q_t S_t

(rows are tokens; papers write the transpose, ``S_t = S_{t-1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ``).
With ‖k_t‖ = 1 this is one step of gradient descent on ``½‖k_t S − v_t‖²`` with learning rate
β_t. The function does not normalise k; layers do.

Contract, kept by every form (``parallel`` below, chunked in chapter 8, Triton in chapter 9,
gated ones):

    recurrent(q, k, v, beta, *, initial_state=None) -> (o, final_state)
    parallel(q, k, v, beta, *, initial_state=None) -> (o, final_state)
    q, k: [B, H, T, Dk]   v: [B, H, T, Dv]   beta: [B, H, T]   state: [B, H, Dk, Dv]
"""

from __future__ import annotations

import torch

from .._validate import check_beta, check_qkv
from .chunks import chunk_size as check_chunk_size
from .chunks import from_chunks, to_chunks
from .chunks import initial_state as initial_state_

__all__ = ["recurrent", "parallel", "chunked", "wy_stage", "ut_transform", "state_pass"]


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference token loop. Returns ``(o [B, H, T, Dv], S_T [B, H, Dk, Dv])``.

    The state is accumulated in float32 (or float64 for float64 inputs); ``o`` has the inputs'
    dtype. Differentiable (autograd through the loop).
    """
    op = "delta_rule.recurrent"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    S = initial_state_(initial_state, (B, H, Dk, Dv), q, op)
    acc = S.dtype
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, :, t].to(acc), k[:, :, t].to(acc), v[:, :, t].to(acc)  # [B, H, D]
        b_t = beta[:, :, t].to(acc).unsqueeze(-1)  # [B, H, 1]
        v_old = torch.einsum("bhk,bhkv->bhv", k_t, S)  # what the state holds at k_t  [B, H, Dv]
        u_t = b_t * (v_t - v_old)  # the delta, scaled by the write strength              [B, H, Dv]
        S = S + k_t.unsqueeze(-1) * u_t.unsqueeze(-2)  # S_t = S_{t-1} + k_tᵀ u_t   [B, H, Dk, Dv]
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))  # o_t = q_t S_t         [B, H, Dv]
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, Dv, dtype=acc)
    return o.to(v.dtype), S


def parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence as one block: a triangular solve instead of a token loop.

    Unrolling the recurrence, ``S_{t-1} = S_0 + Σ_{j<t} k_jᵀ u_j``, so the deltas
    ``u_t = β_t (v_t − k_t S_{t-1})`` satisfy one lower-triangular linear system::

        (I + diag(β) tril(K Kᵀ, −1)) U = diag(β) (V − K S_0)
        O   = Q S_0 + (Q Kᵀ ⊙ M) U          (M: j ≤ i)
        S_T = S_0 + Kᵀ U

    ``O(T² D)`` work with no loop over tokens (the products with ``T × T`` matrices, and the
    triangular solve, which costs ``T²`` per right-hand-side column, ``T² Dv`` in all): fast for
    short sequences, and what a chunked form does inside each chunk (chapters 7 and 8 derive it).
    Same contract as :func:`recurrent`, checked equal in ``tests/test_delta_rule.py``;
    differentiable.
    """
    op = "delta_rule.parallel"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    S0 = initial_state_(initial_state, (B, H, Dk, Dv), q, op)
    acc, out_dtype = S0.dtype, v.dtype
    q, k, v, b = q.to(acc), k.to(acc), v.to(acc), beta.to(acc).unsqueeze(-1)  # b: [B, H, T, 1]
    eye = torch.eye(T, dtype=acc, device=q.device)
    A = eye + b * (k @ k.transpose(-1, -2)).tril(-1)  # I + diag(β) tril(K Kᵀ, −1)  [B, H, T, T]
    rhs = b * (v - k @ S0)  # diag(β) (V − K S_0)                                    [B, H, T, Dv]
    U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [B, H, T, Dv]
    scores = (q @ k.transpose(-1, -2)).tril()  # Q Kᵀ ⊙ M                            [B, H, T, T]
    o = q @ S0 + scores @ U  # [B, H, T, Dv]
    S = S0 + k.transpose(-1, -2) @ U  # [B, H, Dk, Dv]
    return o.to(out_dtype), S


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise DeltaNet (chapter 8; Yang et al., 2024). Same contract as :func:`recurrent`.

    Per chunk of ``C`` tokens (rows ``Q_[c], K_[c], V_[c]``, write strengths ``β_[c]``):

        𝒯_[c]   = (I + tril(diag(β_[c]) K_[c] K_[c]ᵀ, −1))⁻¹ diag(β_[c])   (the UT transform, ch. 7)
        W_[c]   = 𝒯_[c] K_[c],   U_[c] = 𝒯_[c] V_[c]                       (the WY factors)
        U'_[c]  = U_[c] − W_[c] S_[c]          (the deltas the tokens write, given the state)
        O_[c]   = Q_[c] S_[c] + Ω_[c] U'_[c],   Ω_[c] = Q_[c] K_[c]ᵀ ⊙ M   (M: j ≤ i)
        S_[c+1] = S_[c] + K_[c]ᵀ U'_[c]

    Four stages, as GPU kernels split the work (chapter 9): (1) ``𝒯``, ``W``, ``U``
    (:func:`wy_stage`) and (2) the scores ``Ω_[c]`` of every chunk at once; (3) the sequential
    state pass, which keeps only ``U'_[c]`` and ``S_[c]`` (two matrix products per chunk,
    :func:`state_pass`); (4) every chunk's output at once from the recorded ``S_[c]`` and ``U'_[c]``.
    ``C = T`` is :func:`parallel`, ``C = 1`` the recurrence. Any ``T`` (the last chunk is
    zero-padded: padded tokens have ``k = 0, β = 0`` and change nothing). Differentiable.
    """
    op = "delta_rule.chunked"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    C = check_chunk_size(chunk_size, op)
    S = initial_state_(initial_state, (B, H, Dk, Dv), q, op).reshape(B * H, Dk, Dv)
    acc, out_dtype = S.dtype, v.dtype
    if T == 0:
        return v.new_zeros(B, H, 0, Dv), S.view(B, H, Dk, Dv).clone()
    # [B, H, T, D] -> [B·H, N, C, D]: N = ⌈T / C⌉ chunks of C tokens, heads side by side
    Q, K, V = (to_chunks(t.to(acc), C).flatten(0, 1) for t in (q, k, v))
    b = to_chunks(beta.to(acc).unsqueeze(-1), C).flatten(0, 1)  # β_[c] as a column [BH, N, C, 1]
    Kt = K.transpose(-1, -2)  # K_[c]ᵀ                                              [BH, N, Dk, C]

    # (1) W_[c] = 𝒯_[c] K_[c], U_[c] = 𝒯_[c] V_[c], every chunk at once  [BH, N, C, Dk], [BH, N, C, Dv]
    W, U = wy_stage(K, V, b)
    # (2) the scores inside every chunk
    causal = torch.ones(C, C, dtype=acc, device=q.device).tril()  # M: j ≤ i
    scores = (Q @ Kt) * causal  # Ω_[c] = Q_[c] K_[c]ᵀ ⊙ M                        [BH, N, C, C]
    # (3) the sequential pass: every chunk's starting state S_[c] and deltas U'_[c]
    S_all, U_new, S = state_pass(W, U, Kt, S)  # [BH, N, Dk, Dv], [BH, N, C, Dv], [BH, Dk, Dv]
    # (4) O_[c] = Q_[c] S_[c] + Ω_[c] U'_[c], every chunk at once
    o = Q @ S_all + scores @ U_new  # [BH, N, C, Dv]
    o = from_chunks(o.view(B, H, *o.shape[1:]), T)  # [B, H, T, Dv]
    return o.to(out_dtype), S.view(B, H, Dk, Dv)


def wy_stage(K: torch.Tensor, V: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 of :func:`chunked`, for every chunk at once: the UT transform and the WY factors

        𝒯 = (I + tril(diag(β) K Kᵀ, −1))⁻¹ diag(β),   W = 𝒯 K,   U = 𝒯 V      (one chunk)

    ``K [..., C, Dk]``, ``V [..., C, Dv]``, ``b [..., C, 1]`` (β as a column); returns
    ``W [..., C, Dk]`` and ``U [..., C, Dv]``. The triangular solve reads only the strictly lower
    triangle of its matrix and takes its diagonal as ones (``unitriangular``), so
    ``diag(β) K Kᵀ`` goes in unmasked, and the right-hand side ``diag(β)`` gives
    ``A⁻¹ diag(β)`` directly. :func:`tinyk3.ops.wy.wy_factors` computes the same (chapter 7).
    """
    T = ut_transform(K @ K.transpose(-1, -2), b)  # T here is the UT matrix 𝒯 (not the length)
    return T @ K, T @ V


def ut_transform(A: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The UT matrix ``𝒯 = (I + tril(diag(β) A, −1))⁻¹ diag(β)`` of each chunk, from its key scores.

    ``A [..., C, C]``: ``K Kᵀ`` for the delta rule, the decayed scores of the gated rules
    (chapters 10 and 11); only its strictly lower triangle is read (the triangular solve takes the
    diagonal as ones), so it may go in unmasked. ``b [..., C, 1]``: β as a column.
    """
    return torch.linalg.solve_triangular(b * A, torch.diag_embed(b.squeeze(-1)), upper=False,
                                         unitriangular=True)


def state_pass(
    W: torch.Tensor, U: torch.Tensor, Kt: torch.Tensor, S: torch.Tensor,
    decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 3 of :func:`chunked`, the sequential one: for ``c = 0 .. N−1``

        U'_[c]  = U_[c] − W_[c] S_[c]
        S_[c+1] = S_[c] + K_[c]ᵀ U'_[c]              (decay=None: the delta rule)
        S_[c+1] = decay_[c] ⊙ S_[c] + K_[c]ᵀ U'_[c]  (the gated rules, chapters 10 and 11)

    Two batched matrix products per chunk (``torch.baddbmm``: ``input + α · batch1 @ batch2``).
    ``W [BH, N, C, Dk]``, ``U [BH, N, C, Dv]``, ``Kt [BH, N, Dk, C]`` (``K_[c]ᵀ``, already decayed
    to the chunk's end by the gated rules), ``S [BH, Dk, Dv]`` (``S_[0]``), ``decay``
    ``[BH, N, 1, 1]`` (one factor per chunk and head) or ``[BH, N, Dk, 1]`` (one per key row).
    Returns every ``S_[c]`` ``[BH, N, Dk, Dv]``, every ``U'_[c]`` ``[BH, N, C, Dv]`` and the final
    state ``S_[N]`` ``[BH, Dk, Dv]``.
    """
    states, deltas = [], []
    for c in range(W.shape[1]):
        states.append(S)  # S_[c]
        u = torch.baddbmm(U[:, c], W[:, c], S, alpha=-1)  # U'_[c] = U_[c] − W_[c] S_[c]  [BH, C, Dv]
        deltas.append(u)
        kept = S if decay is None else decay[:, c] * S  # what survives the chunk's decay
        S = torch.baddbmm(kept, Kt[:, c], u)  # S_[c+1] = kept + K_[c]ᵀ U'_[c]          [BH, Dk, Dv]
    return torch.stack(states, dim=1), torch.stack(deltas, dim=1), S

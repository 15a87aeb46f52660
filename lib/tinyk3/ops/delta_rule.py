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

from ._checks import check_beta, check_qkv, check_state

__all__ = ["recurrent", "parallel"]


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
    acc = torch.promote_types(q.dtype, torch.float32)
    if initial_state is None:
        S = q.new_zeros(B, H, Dk, Dv, dtype=acc)
    else:
        check_state(initial_state, (B, H, Dk, Dv), q, op, "initial_state")
        S = initial_state.to(acc)
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

    ``O(T² D + T³)`` work with no loop over tokens: fast for short sequences, and what a chunked
    form does inside each chunk (chapters 7 and 8 derive it). Same contract as
    :func:`recurrent`, checked equal in ``tests/test_delta_rule.py``; differentiable.
    """
    op = "delta_rule.parallel"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    acc = torch.promote_types(q.dtype, torch.float32)
    if initial_state is None:
        S0 = q.new_zeros(B, H, Dk, Dv, dtype=acc)
    else:
        check_state(initial_state, (B, H, Dk, Dv), q, op, "initial_state")
        S0 = initial_state.to(acc)
    out_dtype = v.dtype
    q, k, v, b = q.to(acc), k.to(acc), v.to(acc), beta.to(acc).unsqueeze(-1)  # b: [B, H, T, 1]
    eye = torch.eye(T, dtype=acc, device=q.device)
    A = eye + b * (k @ k.transpose(-1, -2)).tril(-1)  # I + diag(β) tril(K Kᵀ, −1)  [B, H, T, T]
    rhs = b * (v - k @ S0)  # diag(β) (V − K S_0)                                    [B, H, T, Dv]
    U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [B, H, T, Dv]
    scores = (q @ k.transpose(-1, -2)).tril()  # Q Kᵀ ⊙ M                            [B, H, T, T]
    o = q @ S0 + scores @ U  # [B, H, T, Dv]
    S = S0 + k.transpose(-1, -2) @ U  # [B, H, Dk, Dv]
    return o.to(out_dtype), S

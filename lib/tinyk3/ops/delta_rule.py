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

The backward pass (chapter 19): :func:`recurrent_backward` runs the adjoint state backward in
time, one token at a time (the reference); :func:`chunked_backward` runs it backward over
chunks, recomputing each chunk's intermediates from its boundary state. Both return
:class:`Grads` ``(dq, dk, dv, dbeta, d_initial_state)`` given ``d_o = ∂L/∂o`` and
``d_state = ∂L/∂S_T``; ``chunked`` is differentiable through :func:`chunked_backward`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._validate import check_beta, check_qkv
from .chunks import (
    check_backward_mode,
    check_cotangents,
    from_chunks,
    needs_grad,
    to_chunks,
    with_derived_backward,
)
from .chunks import chunk_size as check_chunk_size
from .chunks import initial_state as initial_state_

__all__ = ["recurrent", "parallel", "chunked", "wy_stage", "ut_transform", "state_pass",
           "Grads", "recurrent_backward", "chunked_backward", "ut_parts", "ut_transform_backward",
           "adjoint_state_pass"]


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
    backward: str | None = None,
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
    zero-padded: padded tokens have ``k = 0, β = 0`` and change nothing).

    Differentiable. ``backward="derived"`` (the default; see
    :func:`tinyk3.ops.chunks.backward_mode`): between forward and backward it keeps
    only the inputs and the chunk-boundary states ``S_[c]``, and the backward is
    :func:`chunked_backward` (chapter 19). ``backward="autograd"``: autograd through the
    PyTorch operations above, which keeps every chunk's intermediates (for comparison).
    """
    op = "delta_rule.chunked"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    C = check_chunk_size(chunk_size, op)
    S0 = initial_state_(initial_state, (B, H, Dk, Dv), q, op)
    if check_backward_mode(backward, op) == "derived" and needs_grad(q, k, v, beta, initial_state):
        return with_derived_backward(_chunked_forward, chunked_backward, (q, k, v, beta),
                                     None if initial_state is None else S0, C)
    return _chunked_forward(q, k, v, beta, C, S0)[:2]


def _chunked_forward(q, k, v, beta, C: int, S0: torch.Tensor):
    """The four stages of :func:`chunked`, inputs already checked. ``S0 [B, H, Dk, Dv]`` in the
    accumulation dtype. Returns ``o``, ``S_T`` and every chunk's starting state ``S_[c]``
    ``[B·H, N, Dk, Dv]``."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    S = S0.reshape(B * H, Dk, Dv)
    acc, out_dtype = S.dtype, v.dtype
    if T == 0:
        return v.new_zeros(B, H, 0, Dv), S.view(B, H, Dk, Dv).clone(), S.new_zeros(B * H, 0, Dk, Dv)
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
    return o.to(out_dtype), S.view(B, H, Dk, Dv), S_all


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


# -- the backward pass (chapter 19) ------------------------------------------------------------

class Grads(NamedTuple):
    """The gradients of a loss with respect to each input of the delta rule."""

    dq: torch.Tensor  # [B, H, T, Dk]
    dk: torch.Tensor  # [B, H, T, Dk]
    dv: torch.Tensor  # [B, H, T, Dv]
    dbeta: torch.Tensor  # [B, H, T]
    d_initial_state: torch.Tensor | None  # [B, H, Dk, Dv]; None when there was no initial state


def _check_backward_inputs(q, k, v, beta, d_o, d_state, initial_state, op):
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    check_cotangents(d_o, d_state, (B, H, T, Dv), (B, H, Dk, Dv), q, op)
    S0 = initial_state_(initial_state, (B, H, Dk, Dv), q, op)
    return B, H, T, Dk, Dv, S0


def _grads(dq, dk, dv, dbeta, dS0, q, v, beta, initial_state) -> Grads:
    """Each gradient in its input's dtype (the computation ran in the accumulation dtype)."""
    d0 = None if initial_state is None else dS0.to(initial_state.dtype)
    return Grads(dq.to(q.dtype), dk.to(q.dtype), dv.to(v.dtype), dbeta.to(beta.dtype), d0)


def recurrent_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    d_o: torch.Tensor,
    d_state: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
) -> Grads:
    """The reference backward: the token loop's adjoint, run backward in time.

    The forward of :func:`recurrent` is run first, keeping every state ``S_t`` (the reference
    spends memory freely). Then, with ``dS`` the gradient of the loss with respect to the state
    ``S_t`` as a whole (through ``o_t`` and every later token), for ``t = T .. 1``::

        dS    += q_tᵀ do_t                    (o_t = q_t S_t)
        dq_t   = do_t S_tᵀ
        dk_t   = dS u_tᵀ,   du_t = k_t dS     (S_t = S_{t-1} + k_tᵀ u_t)
        dv_t   = β_t du_t,  dβ_t = du_t · (v_t − k_t S_{t-1})
        dk_t  −= S_{t-1} (β_t du_t)ᵀ,  dS −= k_tᵀ (β_t du_t)       (u_t = β_t (v_t − k_t S_{t-1}))

    after which ``dS`` is ``∂L/∂S_{t-1}``; at the end it is ``∂L/∂S_0``. ``d_state = ∂L/∂S_T``
    (None: the final state is not used by the loss). Returns :class:`Grads`.
    """
    op = "delta_rule.recurrent_backward"
    B, H, T, Dk, Dv, S = _check_backward_inputs(q, k, v, beta, d_o, d_state, initial_state, op)
    acc = S.dtype
    Q, K, V, b, dO = (t.to(acc) for t in (q, k, v, beta, d_o))
    states = [S]  # S_0 .. S_T, and the deltas u_1 .. u_T
    deltas = []
    for t in range(T):
        u = b[:, :, t, None] * (V[:, :, t] - torch.einsum("bhk,bhkv->bhv", K[:, :, t], S))
        S = S + K[:, :, t, :, None] * u[:, :, None, :]
        states.append(S)
        deltas.append(u)
    dS = S.new_zeros(B, H, Dk, Dv) if d_state is None else d_state.to(acc).clone()
    dq, dk = torch.zeros_like(Q), torch.zeros_like(K)
    dv, db = torch.zeros_like(V), torch.zeros_like(b)
    for t in reversed(range(T)):
        q_t, k_t, u_t, do_t = Q[:, :, t], K[:, :, t], deltas[t], dO[:, :, t]
        S_t, S_prev = states[t + 1], states[t]
        dS = dS + q_t[..., :, None] * do_t[..., None, :]  # through o_t = q_t S_t
        dq[:, :, t] = torch.einsum("bhv,bhkv->bhk", do_t, S_t)
        du = torch.einsum("bhk,bhkv->bhv", k_t, dS)  # through S_t = S_{t-1} + k_tᵀ u_t
        dk_t = torch.einsum("bhkv,bhv->bhk", dS, u_t)
        v_old = torch.einsum("bhk,bhkv->bhv", k_t, S_prev)
        dv[:, :, t] = b[:, :, t, None] * du
        db[:, :, t] = (du * (V[:, :, t] - v_old)).sum(-1)
        d_old = -b[:, :, t, None] * du  # through v_old = k_t S_{t-1}
        dk[:, :, t] = dk_t + torch.einsum("bhkv,bhv->bhk", S_prev, d_old)
        dS = dS + k_t[..., :, None] * d_old[..., None, :]
    return _grads(dq, dk, dv, db, dS, q, v, beta, initial_state)


def chunked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    d_o: torch.Tensor,
    d_state: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    boundary_states: torch.Tensor | None = None,
) -> Grads:
    """The backward of :func:`chunked`, from the derived formulas (chapter 19), no autograd.

    Per chunk (notation of :func:`chunked`; ``dS_[c+1] = ∂L/∂S_[c+1]`` from the chunks after)::

        dU'_[c]  = Ω_[c]ᵀ dO_[c] + K_[c] dS_[c+1]
        dS_[c]   = dS_[c+1] + Q_[c]ᵀ dO_[c] − W_[c]ᵀ dU'_[c]         (the adjoint state pass)
        dQ_[c]   = dO_[c] S_[c]ᵀ + dΩ_[c] K_[c],    dΩ_[c] = (dO_[c] U'_[c]ᵀ) ⊙ M
        dK_[c]   = dΩ_[c]ᵀ Q_[c] + U'_[c] dS_[c+1]ᵀ + 𝒯_[c]ᵀ dW_[c] + (dA + dAᵀ) K_[c]
        dW_[c]   = −dU'_[c] S_[c]ᵀ,   dV_[c] = 𝒯_[c]ᵀ dU'_[c]
        d𝒯_[c]   = dW_[c] K_[c]ᵀ + dU'_[c] V_[c]ᵀ  →  dA, dβ   (:func:`ut_transform_backward`)

    Five stages, mirroring the forward's: (1) the UT transform and WY factors of every chunk
    recomputed from the inputs; (2) the scores; (3) ``U'_[c]`` from the boundary states (given
    as ``boundary_states [B·H, N, Dk, Dv]``, as :func:`chunked` keeps them, or recomputed by
    :func:`state_pass`); (4) the adjoint state pass backward over chunks
    (:func:`adjoint_state_pass`, the only sequential stage); (5) every chunk's gradients at
    once. ``d_o [B, H, T, Dv]``, ``d_state [B, H, Dk, Dv]`` or None (zero). Returns
    :class:`Grads`; ``d_initial_state`` is None when ``initial_state`` is None.
    """
    op = "delta_rule.chunked_backward"
    B, H, T, Dk, Dv, S0 = _check_backward_inputs(q, k, v, beta, d_o, d_state, initial_state, op)
    C = check_chunk_size(chunk_size, op)
    acc = S0.dtype
    dS = (S0.new_zeros(B * H, Dk, Dv) if d_state is None
          else d_state.to(acc).reshape(B * H, Dk, Dv))
    if T == 0:
        z = q.new_zeros(B, H, 0, Dk, dtype=acc)
        return _grads(z, z, z.new_zeros(B, H, 0, Dv), z.new_zeros(B, H, 0), dS.view(B, H, Dk, Dv),
                      q, v, beta, initial_state)
    Q, K, V, dO = (to_chunks(t.to(acc), C).flatten(0, 1) for t in (q, k, v, d_o))
    b = to_chunks(beta.to(acc).unsqueeze(-1), C).flatten(0, 1)  # [BH, N, C, 1]
    Kt, Qt = K.transpose(-1, -2), Q.transpose(-1, -2)

    # (1) 𝒯 = X diag(β) with X = (I + tril(diag(β) K Kᵀ, −1))⁻¹; W = 𝒯 K, U = 𝒯 V
    A = K @ Kt  # [BH, N, C, C]
    X, Tm = ut_parts(A, b)  # [BH, N, C, C] each
    W, U = Tm @ K, Tm @ V
    # (2) the scores
    causal = torch.ones(C, C, dtype=acc, device=q.device).tril()
    scores = (Q @ Kt) * causal  # Ω = Q Kᵀ ⊙ M
    # (3) U'_[c] = U_[c] − W_[c] S_[c], from the boundary states
    if boundary_states is None:
        S_all = state_pass(W, U, Kt, S0.reshape(B * H, Dk, Dv))[0]
    else:
        S_all = boundary_states.to(acc)
    U_new = U - W @ S_all  # [BH, N, C, Dv]
    # (4) the adjoint state pass: dU'_[c] and dS_[c+1] of every chunk, and dS_[0]
    dU_new, dS_next, dS0 = adjoint_state_pass(scores.transpose(-1, -2) @ dO, Qt @ dO, W, K, dS)
    # (5) every chunk's gradients at once
    d_scores = (dO @ U_new.transpose(-1, -2)) * causal  # dΩ = (dO U'ᵀ) ⊙ M
    dQ = dO @ S_all.transpose(-1, -2) + d_scores @ K
    dW = -(dU_new @ S_all.transpose(-1, -2))  # through U' = U − W S
    dT = dW @ Kt + dU_new @ V.transpose(-1, -2)  # through W = 𝒯 K and U = 𝒯 V
    dA, db = ut_transform_backward(A, b, X, Tm, dT)
    dK = (d_scores.transpose(-1, -2) @ Q + U_new @ dS_next.transpose(-1, -2)
          + Tm.transpose(-1, -2) @ dW + (dA + dA.transpose(-1, -2)) @ K)
    dV = Tm.transpose(-1, -2) @ dU_new

    def back(x):  # [BH, N, C, ...] -> [B, H, T, ...]
        return from_chunks(x.view(B, H, *x.shape[1:]), T)

    return _grads(back(dQ), back(dK), back(dV), back(db).squeeze(-1), dS0.view(B, H, Dk, Dv),
                  q, v, beta, initial_state)


def ut_parts(A: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``X = (I + tril(diag(β) A, −1))⁻¹`` and ``𝒯 = X diag(β)`` (:func:`ut_transform`), both
    kept: the backward needs ``X`` itself, and ``𝒯 / β`` would divide by the zero ``β`` of padded
    tokens. One triangular solve against the identity; ``A [..., C, C]``, ``b [..., C, 1]``."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    X = torch.linalg.solve_triangular(b * A, eye, upper=False, unitriangular=True)
    return X, X * b.transpose(-1, -2)  # X diag(β): column j scaled by β_j


def ut_transform_backward(A: torch.Tensor, b: torch.Tensor, X: torch.Tensor, Tm: torch.Tensor,
                          dT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of :func:`ut_transform`, ``𝒯 = X diag(β)``, ``X = (I + A_<)⁻¹``,
    ``A_< = tril(diag(β) A, −1)``, given ``d𝒯``; ``A`` is the key-score matrix
    :func:`ut_transform` reads (``K Kᵀ``, or the gated rules' decayed scores).

    The inverse's gradient: from ``X (I + A_<) = I``, ``δX (I + A_<) + X δA_< = 0``, so a loss's
    gradient flows to ``A_<`` as ``−Xᵀ dX Xᵀ``, and with ``dX = d𝒯 diag(β)`` and
    ``diag(β) Xᵀ = 𝒯ᵀ``, as ``−Xᵀ d𝒯 𝒯ᵀ``, kept on the strict lower triangle (where ``A_<``
    lives). Then ``β`` enters twice, as the column scaling of ``𝒯`` and the row scaling of
    ``A_<``::

        G   = tril(−Xᵀ d𝒯 𝒯ᵀ, −1)
        dA  = diag(β) G                          (only A's strict lower triangle is read)
        dβ  = diag(Xᵀ d𝒯) + rowsum(G ⊙ A)

    ``A, X, Tm, dT [..., C, C]``, ``b [..., C, 1]``. Returns ``dA [..., C, C]`` (zero on and
    above the diagonal) and ``dβ [..., C, 1]``.
    """
    XtdT = X.transpose(-1, -2) @ dT
    G = (-(XtdT @ Tm.transpose(-1, -2))).tril(-1)
    db = XtdT.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) + (G * A).sum(-1, keepdim=True)
    return b * G, db


def adjoint_state_pass(
    P: torch.Tensor, R: torch.Tensor, W: torch.Tensor, K: torch.Tensor, dS: torch.Tensor,
    decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 4 of :func:`chunked_backward`, the sequential one: :func:`state_pass` run backward.
    For ``c = N−1 .. 0``, from ``dS = dS_[N]`` (the final state's gradient)::

        dU'_[c] = P_[c] + K_[c] dS_[c+1]
        dS_[c]  = dS_[c+1] + R_[c] − W_[c]ᵀ dU'_[c]              (decay=None: the delta rule)
        dS_[c]  = decay_[c] ⊙ dS_[c+1] + R_[c] − W_[c]ᵀ dU'_[c]  (the gated rules)

    with ``P_[c] = Ω_[c]ᵀ dO_[c]`` and ``R_[c] = Q_[c]ᵀ dO_[c]`` computed for every chunk at once
    beforehand (the gated rules pass their decayed ``Q``, ``K``). Two batched matrix products per
    chunk, as in the forward. ``P [BH, N, C, Dv]``, ``R [BH, N, Dk, Dv]``, ``W, K [BH, N, C, Dk]``,
    ``dS [BH, Dk, Dv]``, ``decay`` as in :func:`state_pass`. Returns every ``dU'_[c]``
    ``[BH, N, C, Dv]``, every ``dS_[c+1]`` ``[BH, N, Dk, Dv]`` and ``dS_[0]`` ``[BH, Dk, Dv]``.
    """
    N = W.shape[1]
    d_deltas, d_next = [None] * N, [None] * N
    for c in reversed(range(N)):
        d_next[c] = dS  # dS_[c+1]
        du = torch.baddbmm(P[:, c], K[:, c], dS)  # dU'_[c] = P_[c] + K_[c] dS_[c+1]
        d_deltas[c] = du
        kept = dS if decay is None else decay[:, c] * dS
        dS = torch.baddbmm(kept + R[:, c], W[:, c].transpose(-1, -2), du, alpha=-1)
    return torch.stack(d_deltas, dim=1), torch.stack(d_next, dim=1), dS

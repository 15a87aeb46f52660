"""Gated DeltaNet (chapter 10; Yang, Kautz and Hatamizadeh, ICLR 2025): the delta rule with a
forget gate, one decay factor per token and head.

Before a token reads its key, the whole state decays by ``α_t = exp(g_t) ∈ (0, 1]``; then the
delta rule writes as before ("forget before error", the paper's design, fla issue 885)::

    S'_t  = α_t S_{t−1}                              (forget)
    S_t   = S'_t + k_tᵀ β_t (v_t − k_t S'_t)         (error-correcting write into what is left)
          = α_t (I − β_t k_tᵀ k_t) S_{t−1} + β_t k_tᵀ v_t
    o_t   = q_t S_t

``g_t = log α_t ≤ 0`` is the log decay, as models produce it (:mod:`tinyk3.gates`). ``g = 0``
is the delta rule; dropping the read-back (``S_t = α_t S_{t−1} + k_tᵀ v_t``) would give Mamba-2's
decaying linear-attention state instead.

The public signatures (the course's ops contract; chapters, exercises and readers call them)::

    recurrent(q, k, v, beta, g, *, initial_state=None) -> (o, S_T)
    chunked(q, k, v, beta, g, *, chunk_size=64, initial_state=None) -> (o, S_T)
    q, k: [B, H, T, Dk]   v: [B, H, T, Dv]   beta, g: [B, H, T]   state: [B, H, Dk, Dv]

Mind the argument order: ``beta`` before ``g`` everywhere in this course, as in fla's
``naive_recurrent_gated_delta_rule``; fla's ``chunk_gated_delta_rule`` and
``naive_chunk_gated_delta_rule`` (fla 0.6.0) take ``g, beta``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._validate import check_beta, check_gate, check_qkv
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
from .delta_rule import adjoint_state_pass, state_pass, ut_parts, ut_transform, ut_transform_backward

__all__ = ["recurrent", "chunked", "decay_mask", "token_loop", "suffix_sum", "Grads",
           "recurrent_backward", "chunked_backward", "token_loop_backward"]


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference token loop. Returns ``(o [B, H, T, Dv], S_T [B, H, Dk, Dv])``; the state is
    accumulated in float32 (float64 for float64 inputs), ``o`` has the inputs' dtype.
    Differentiable (autograd through the loop)."""
    op = "gated_delta_rule.recurrent"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    check_gate(g, B, H, T, None, q, op)
    S = initial_state_(initial_state, (B, H, Dk, Dv), q, op)
    return token_loop(q, k, v, beta, g.unsqueeze(-1), S)


def token_loop(q, k, v, beta, g_rows, S):
    """The loop both gated rules share (inputs already checked). ``g_rows [B, H, T, 1]`` (one
    decay per head: Gated DeltaNet) or ``[B, H, T, Dk]`` (one per key channel, i.e. per row of
    the state: KDA, chapter 11). ``S`` is the initial state in the accumulation dtype."""
    acc = S.dtype
    outs = []
    for t in range(q.shape[2]):
        q_t, k_t, v_t = q[:, :, t].to(acc), k[:, :, t].to(acc), v[:, :, t].to(acc)  # [B, H, D]
        b_t = beta[:, :, t].to(acc).unsqueeze(-1)  # [B, H, 1]
        S = torch.exp(g_rows[:, :, t].to(acc)).unsqueeze(-1) * S  # forget: α_t S (row by row)
        v_old = torch.einsum("bhk,bhkv->bhv", k_t, S)  # what the decayed state holds at k_t
        u_t = b_t * (v_t - v_old)  # the delta, scaled by the write strength  [B, H, Dv]
        S = S + k_t.unsqueeze(-1) * u_t.unsqueeze(-2)  # S_t = α_t S_{t−1} + k_tᵀ u_t
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))  # o_t = q_t S_t
    B, H, _, Dv = v.shape
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, Dv, dtype=acc)
    return o.to(v.dtype), S


def decay_mask(G: torch.Tensor, *, strict: bool = False) -> torch.Tensor:
    """``Γ_ij = γ_i / γ_j = exp(G_i − G_j)`` on ``j ≤ i`` (``j < i`` if ``strict``), 0 above.

    ``G [..., C]``: the cumulative log decay inside a chunk, ``G_i = Σ_{s ≤ i} g_s``. The ratio is
    taken in log space, elementwise: ``exp(G_i − G_j) ≤ 1`` below the diagonal for any gates,
    where ``γ_i · (1 / γ_j)`` would overflow float32 once ``−G_j`` passes about 88. The entries
    above the diagonal are set to ``−inf`` *before* the exponential (their ``exp(G_i − G_j)``
    would be ≥ 1 and may overflow; a mask applied afterwards would multiply ``inf`` by 0).
    """
    C = G.shape[-1]
    i = torch.arange(C, device=G.device)
    keep = (i[:, None] > i[None, :]) if strict else (i[:, None] >= i[None, :])
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)  # G_i − G_j   [..., C, C]
    return torch.exp(torch.where(keep, diff, torch.full_like(diff, -torch.inf)))


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    backward: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise Gated DeltaNet. Same contract as :func:`recurrent`.

    Inside chunk ``c`` let ``G_i = Σ_{s ≤ i} g_s`` (``γ_i = exp(G_i)``, the decay from the chunk's
    start to token ``i``) and ``Γ_ij = γ_i / γ_j`` on ``j ≤ i`` (:func:`decay_mask`). Chapter 8's
    equations gain one decay factor wherever a term crosses tokens (derived in chapter 10)::

        𝒯_Γ     = (I + tril(diag(β) (K Kᵀ ⊙ Γ), −1))⁻¹ diag(β)
        W       = 𝒯_Γ diag(γ) K,    U = 𝒯_Γ V
        U'      = U − W S_[c]
        O_[c]   = diag(γ) Q S_[c] + (Q Kᵀ ⊙ Γ) U'
        S_[c+1] = γ_C S_[c] + (diag(γ_C / γ) K)ᵀ U'

    Since ``K Kᵀ ⊙ Γ = diag(γ) K Kᵀ diag(γ)⁻¹``, ``𝒯_Γ = diag(γ) 𝒯 diag(γ)⁻¹`` is the plain UT
    matrix rescaled; the code nevertheless forms ``K Kᵀ ⊙ Γ`` from ``exp(G_i − G_j)``, because
    ``diag(γ)⁻¹`` overflows float32 for strong gates. Every factor here is ``≤ 1``, so the form is
    finite and accurate in float32 for any ``g ≤ 0``. Zero-padded tokens have ``g = 0`` (no decay),
    ``k = 0``, ``β = 0``: they change nothing. Any ``chunk_size ≥ 1``.

    Differentiable: by :func:`chunked_backward` (``backward="derived"``, the default, chapter
    20; autograd keeps the inputs and the chunk-boundary states only) or by autograd through the
    operations above (``backward="autograd"``; :func:`tinyk3.ops.chunks.backward_mode`).
    """
    op = "gated_delta_rule.chunked"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    check_gate(g, B, H, T, None, q, op)
    C = check_chunk_size(chunk_size, op)
    S0 = initial_state_(initial_state, (B, H, Dk, Dv), q, op)
    if check_backward_mode(backward, op) == "derived" and needs_grad(q, k, v, beta, g,
                                                                     initial_state):
        return with_derived_backward(_chunked_forward, chunked_backward, (q, k, v, beta, g),
                                     None if initial_state is None else S0, C)
    return _chunked_forward(q, k, v, beta, g, C, S0)[:2]


def _gates(g: torch.Tensor, C: int):
    """A chunk's gate sums, ``g [B, H, T]`` → ``G`` (from the chunk's start, inclusive) and
    ``G_rest`` (to the chunk's end, exclusive), both ``[B·H, N, C]``."""
    gc = to_chunks(g, C).flatten(0, 1)
    return gc.cumsum(-1), suffix_sum(gc)


def _chunked_forward(q, k, v, beta, g, C: int, S0: torch.Tensor):
    """:func:`chunked`'s stages, inputs checked; returns ``o``, ``S_T`` and every ``S_[c]``."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    S = S0.reshape(B * H, Dk, Dv)
    acc, out_dtype = S.dtype, v.dtype
    if T == 0:
        return v.new_zeros(B, H, 0, Dv), S.view(B, H, Dk, Dv).clone(), S.new_zeros(B * H, 0, Dk, Dv)
    Q, K, V = (to_chunks(t.to(acc), C).flatten(0, 1) for t in (q, k, v))  # [BH, N, C, D]
    b = to_chunks(beta.to(acc).unsqueeze(-1), C).flatten(0, 1)  # β as a column   [BH, N, C, 1]
    G = to_chunks(g.to(acc), C).flatten(0, 1).cumsum(-1)  # G_i inside each chunk    [BH, N, C]
    # G_C − G_i = Σ_{s > i} g_s, summed from the end (not G_C − G_i: no cancellation)
    G_rest = suffix_sum(to_chunks(g.to(acc), C).flatten(0, 1))
    gamma = torch.exp(G).unsqueeze(-1)  # γ_i as a column                          [BH, N, C, 1]

    Gam = decay_mask(G)  # Γ (j ≤ i), one C × C matrix per chunk                      [BH, N, C, C]
    # (1) the gated UT transform and WY factors (ut_transform reads only j < i of K Kᵀ ⊙ Γ)
    Tg = ut_transform((K @ K.transpose(-1, -2)) * Gam, b)  # 𝒯_Γ
    W, U = Tg @ (gamma * K), Tg @ V  # W = 𝒯_Γ diag(γ) K,  U = 𝒯_Γ V
    # (2) the decayed scores inside every chunk
    scores = (Q @ K.transpose(-1, -2)) * Gam  # Q Kᵀ ⊙ Γ
    # (3) the state pass: S_[c+1] = γ_C S_[c] + (diag(γ_C / γ) K)ᵀ U'
    Kt = (torch.exp(G_rest).unsqueeze(-1) * K).transpose(-1, -2)  # [BH, N, Dk, C]
    decay = torch.exp(G[..., -1])[..., None, None]  # γ_C per chunk                  [BH, N, 1, 1]
    S_all, U_new, S = state_pass(W, U, Kt, S, decay)
    # (4) O_[c] = diag(γ) Q S_[c] + (Q Kᵀ ⊙ Γ) U'
    o = (gamma * Q) @ S_all + scores @ U_new
    o = from_chunks(o.view(B, H, *o.shape[1:]), T)
    return o.to(out_dtype), S.view(B, H, Dk, Dv), S_all


def suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """``y_i = Σ_{s > i} x_s`` along the chunk's token axis (dim 2 of ``[BH, N, C, ...]``), summed
    from the chunk's end, so each ``y_i`` carries the rounding of its own terms only (``G_C − G_i``
    would lose digits to cancellation when ``G`` is large)."""
    rev = x.flip(2).cumsum(2).flip(2)  # Σ_{s ≥ i}
    return torch.cat([rev[:, :, 1:], torch.zeros_like(rev[:, :, :1])], dim=2)


# -- the backward pass (chapter 20) ------------------------------------------------------------

class Grads(NamedTuple):
    """The gradients of a loss with respect to each input of a gated rule."""

    dq: torch.Tensor  # [B, H, T, Dk]
    dk: torch.Tensor  # [B, H, T, Dk]
    dv: torch.Tensor  # [B, H, T, Dv]
    dbeta: torch.Tensor  # [B, H, T]
    dg: torch.Tensor  # [B, H, T] (Gated DeltaNet) or [B, H, T, Dk] (KDA)
    d_initial_state: torch.Tensor | None  # [B, H, Dk, Dv]; None when there was no initial state


def check_backward_inputs(q, k, v, beta, g, d_o, d_state, initial_state, per_channel: bool,
                          op: str):
    """The inputs of a gated rule's backward, checked; returns ``B, H, T, Dk, Dv`` and ``S_0``."""
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    check_gate(g, B, H, T, Dk if per_channel else None, q, op)
    check_cotangents(d_o, d_state, (B, H, T, Dv), (B, H, Dk, Dv), q, op)
    return B, H, T, Dk, Dv, initial_state_(initial_state, (B, H, Dk, Dv), q, op)


def grads(dq, dk, dv, db, dg, dS0, q, v, beta, g, initial_state) -> Grads:
    """Each gradient in its input's dtype (the computation ran in the accumulation dtype)."""
    d0 = None if initial_state is None else dS0.to(initial_state.dtype)
    return Grads(dq.to(q.dtype), dk.to(q.dtype), dv.to(v.dtype), db.to(beta.dtype),
                 dg.to(g.dtype), d0)


def token_loop_backward(q, k, v, beta, g_rows, S, d_o, d_state):
    """The adjoint of :func:`token_loop`, backward in time (inputs checked, ``S`` the initial
    state in the accumulation dtype). With ``S'_t = α_t ⊙ S_{t−1}`` (row by row) and ``dS`` the
    gradient with respect to ``S_t``, for ``t = T .. 1``::

        dS    += q_tᵀ do_t,      dq_t = do_t S_tᵀ
        du_t   = k_t dS,         dk_t = dS u_tᵀ + S'_t d_old,   d_old = −β_t du_t
        dv_t   = β_t du_t,       dβ_t = du_t · (v_t − k_t S'_t)
        dS'    = dS + k_tᵀ d_old                         (the gradient with respect to S'_t)
        dg_t   = α_t ⊙ rowsum(dS' ⊙ S_{t−1})             (α_t = exp(g_t): dα/dg = α)
        dS     = α_t ⊙ dS'                               (now the gradient with respect to S_{t−1})

    ``g_rows [B, H, T, 1]`` (Gated DeltaNet) or ``[B, H, T, Dk]`` (KDA). Returns the gradients in
    the accumulation dtype: ``dq, dk, dv, dβ, dg_rows, dS_0``.
    """
    acc = S.dtype
    Q, K, V, b, dO = (t.to(acc) for t in (q, k, v, beta, d_o))
    alpha = torch.exp(g_rows.to(acc))  # [B, H, T, 1 or Dk]
    before, deltas = [], []  # S_{t-1} and u_t of every token
    for t in range(q.shape[2]):
        before.append(S)
        S_dec = alpha[:, :, t, :, None] * S
        u = b[:, :, t, None] * (V[:, :, t] - torch.einsum("bhk,bhkv->bhv", K[:, :, t], S_dec))
        S = S_dec + K[:, :, t, :, None] * u[:, :, None, :]
        deltas.append(u)
    dS = torch.zeros_like(S) if d_state is None else d_state.to(acc).clone()
    dq, dk, dv = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    db, dg = torch.zeros_like(b), torch.zeros_like(alpha)
    for t in reversed(range(q.shape[2])):
        k_t, u_t, a_t = K[:, :, t], deltas[t], alpha[:, :, t, :, None]
        S_prev = before[t]
        S_dec = a_t * S_prev
        S_t = S_dec + k_t[..., :, None] * u_t[..., None, :]
        dS = dS + Q[:, :, t, :, None] * dO[:, :, t, None, :]  # through o_t = q_t S_t
        dq[:, :, t] = torch.einsum("bhv,bhkv->bhk", dO[:, :, t], S_t)
        du = torch.einsum("bhk,bhkv->bhv", k_t, dS)
        d_old = -b[:, :, t, None] * du
        dv[:, :, t] = b[:, :, t, None] * du
        db[:, :, t] = (du * (V[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, S_dec))).sum(-1)
        dk[:, :, t] = (torch.einsum("bhkv,bhv->bhk", dS, u_t)
                       + torch.einsum("bhkv,bhv->bhk", S_dec, d_old))
        dS = dS + k_t[..., :, None] * d_old[..., None, :]  # dS' (with respect to S'_t)
        rows = (dS * S_prev).sum(-1)  # Σ_v dS'[d, v] S_{t−1}[d, v], one per row   [B, H, Dk]
        if g_rows.shape[-1] == 1:  # one gate for all rows
            rows = rows.sum(-1, keepdim=True)
        dg[:, :, t] = a_t.squeeze(-1) * rows
        dS = a_t * dS
    return dq, dk, dv, db, dg, dS


def recurrent_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    d_o: torch.Tensor,
    d_state: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
) -> Grads:
    """The reference backward of :func:`recurrent`: the adjoint state run backward in time
    (:func:`token_loop_backward`). ``d_o = ∂L/∂o``, ``d_state = ∂L/∂S_T`` (None: zero).
    Returns :class:`Grads`."""
    op = "gated_delta_rule.recurrent_backward"
    *_, S0 = check_backward_inputs(q, k, v, beta, g, d_o, d_state, initial_state, False, op)
    dq, dk, dv, db, dg, dS = token_loop_backward(q, k, v, beta, g.unsqueeze(-1), S0, d_o, d_state)
    return grads(dq, dk, dv, db, dg.squeeze(-1), dS, q, v, beta, g, initial_state)


def chunked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    d_o: torch.Tensor,
    d_state: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    boundary_states: torch.Tensor | None = None,
) -> Grads:
    """The backward of :func:`chunked` from the derived formulas (chapter 20), no autograd.

    Chapter 19's stages (:func:`tinyk3.ops.delta_rule.chunked_backward`) with the decay marked.
    The terms of the forward that carry the gate are ``γ_i = e^{G_i}`` (the queries' and the WY
    keys' rows), ``Γ_ij = e^{G_i − G_j}`` (the scores and the UT transform), ``ρ_i = e^{G_C − G_i}``
    (the keys written into the next state) and ``γ_C`` (the state's decay over the chunk). Each
    gives the log decay a gradient of the form *(factor) × (the gradient of the term it
    multiplies, summed against what it multiplies)*::

        dG_i  += γ_i (q_i · dq̃_i + k_i · dk̃_i)                 (through γ ⊙ Q and γ ⊙ K)
        dG_i  += Σ_j Z_ij − Σ_j Z_ji,   Z = dΓ ⊙ Γ              (through Γ: + for i, − for j)
        dG_C  += γ_C Σ dS_[c+1] ⊙ S_[c],  dG_i −= ρ_i (k_i · dk̄_i)  for the state's terms

    and since ``G_i = Σ_{s ≤ i} g_s``, ``dg_s = Σ_{i ≥ s} dG_i``: a reverse cumulative sum over
    the chunk. Every factor is ``≤ 1``, as in the forward. Returns :class:`Grads`.
    """
    op = "gated_delta_rule.chunked_backward"
    B, H, T, Dk, Dv, S0 = check_backward_inputs(q, k, v, beta, g, d_o, d_state, initial_state,
                                                False, op)
    C = check_chunk_size(chunk_size, op)
    acc = S0.dtype
    dS = (S0.new_zeros(B * H, Dk, Dv) if d_state is None
          else d_state.to(acc).reshape(B * H, Dk, Dv))
    if T == 0:
        z = q.new_zeros(B, H, 0, Dk, dtype=acc)
        return grads(z, z, z.new_zeros(B, H, 0, Dv), z.new_zeros(B, H, 0), z.new_zeros(B, H, 0),
                     dS.view(B, H, Dk, Dv), q, v, beta, g, initial_state)
    Q, K, V, dO = (to_chunks(t.to(acc), C).flatten(0, 1) for t in (q, k, v, d_o))
    b = to_chunks(beta.to(acc).unsqueeze(-1), C).flatten(0, 1)  # [BH, N, C, 1]
    G, G_rest = _gates(g.to(acc), C)  # [BH, N, C]
    gamma, rho = torch.exp(G).unsqueeze(-1), torch.exp(G_rest).unsqueeze(-1)  # γ_i, ρ_i columns
    decay = torch.exp(G[..., -1])[..., None, None]  # γ_C                          [BH, N, 1, 1]
    Gam = decay_mask(G)  # Γ, zero above the diagonal
    Kt = K.transpose(-1, -2)

    # (1) the gated UT transform and WY factors, recomputed
    KK = K @ Kt
    A = KK * Gam
    X, Tg = ut_parts(A, b)
    Kg, Qg, Kr = gamma * K, gamma * Q, rho * K  # γ ⊙ K, γ ⊙ Q, ρ ⊙ K
    W, U = Tg @ Kg, Tg @ V
    # (2) the decayed scores
    QK = Q @ Kt
    scores = QK * Gam
    # (3) U'_[c] from the boundary states
    S_all = (state_pass(W, U, Kr.transpose(-1, -2), S0.reshape(B * H, Dk, Dv), decay)[0]
             if boundary_states is None else boundary_states.to(acc))
    U_new = U - W @ S_all
    # (4) the adjoint state pass, decaying by γ_C
    dU_new, dS_next, dS0 = adjoint_state_pass(scores.transpose(-1, -2) @ dO,
                                              Qg.transpose(-1, -2) @ dO, W, Kr, dS, decay)
    # (5) every chunk's gradients at once
    dQg = dO @ S_all.transpose(-1, -2)  # through (γ ⊙ Q) S_[c]
    d_raw = dO @ U_new.transpose(-1, -2)  # through (Q Kᵀ ⊙ Γ) U'
    dKr = U_new @ dS_next.transpose(-1, -2)  # through (ρ ⊙ K)ᵀ U'
    dW = -(dU_new @ S_all.transpose(-1, -2))
    dKg = Tg.transpose(-1, -2) @ dW  # through W = 𝒯_Γ (γ ⊙ K)
    dT = dW @ Kg.transpose(-1, -2) + dU_new @ V.transpose(-1, -2)
    dA, db = ut_transform_backward(A, b, X, Tg, dT)
    dSc, dAc = d_raw * Gam, dA * Gam  # the gradients of Q Kᵀ and K Kᵀ
    dQ = gamma * dQg + dSc @ K
    dK = (dSc.transpose(-1, -2) @ Q + rho * dKr + gamma * dKg + (dAc + dAc.transpose(-1, -2)) @ K)
    dV = Tg.transpose(-1, -2) @ dU_new
    # the log decay: every term that carries a factor of the gate, then the reverse cumsum
    # dΓ ⊙ Γ on j < i: Γ_ii = 1 has no gradient, and its two shares below would cancel only up to
    # rounding, which can exceed the true gradient at strong gates (attention-gym PR 461)
    Z = ((d_raw * QK + dA * KK) * Gam).tril(-1)  # [BH, N, C, C]
    dG = (gamma.squeeze(-1) * ((dQg * Q).sum(-1) + (dKg * K).sum(-1))
          + Z.sum(-1) - Z.sum(-2))
    dG[..., -1] += decay[..., 0, 0] * (dS_next * S_all).sum((-1, -2))  # through γ_C S_[c]
    d_rest = rho.squeeze(-1) * (dKr * K).sum(-1)  # through ρ_i = e^{G_C − G_i}, G_C − G_i = Σ_{s>i} g_s
    dg = dG.flip(-1).cumsum(-1).flip(-1)  # dg_s = Σ_{i ≥ s} dG_i
    dg = dg + torch.cat([torch.zeros_like(d_rest[..., :1]), d_rest[..., :-1].cumsum(-1)], -1)

    def back(x):  # [BH, N, C, ...] -> [B, H, T, ...]
        return from_chunks(x.view(B, H, *x.shape[1:]), T)

    return grads(back(dQ), back(dK), back(dV), back(db).squeeze(-1), back(dg),
                 dS0.view(B, H, Dk, Dv), q, v, beta, g, initial_state)

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

import torch

from .._validate import check_beta, check_gate, check_qkv
from .chunks import chunk_size as check_chunk_size
from .chunks import from_chunks, to_chunks
from .chunks import initial_state as initial_state_
from .delta_rule import state_pass, ut_transform

__all__ = ["recurrent", "chunked", "decay_mask", "token_loop", "suffix_sum"]


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
    ``k = 0``, ``β = 0``: they change nothing. Any ``chunk_size ≥ 1``; differentiable.
    """
    op = "gated_delta_rule.chunked"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    check_gate(g, B, H, T, None, q, op)
    C = check_chunk_size(chunk_size, op)
    S = initial_state_(initial_state, (B, H, Dk, Dv), q, op).reshape(B * H, Dk, Dv)
    acc, out_dtype = S.dtype, v.dtype
    if T == 0:
        return v.new_zeros(B, H, 0, Dv), S.view(B, H, Dk, Dv).clone()
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
    return o.to(out_dtype), S.view(B, H, Dk, Dv)


def suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """``y_i = Σ_{s > i} x_s`` along the chunk's token axis (dim 2 of ``[BH, N, C, ...]``), summed
    from the chunk's end, so each ``y_i`` carries the rounding of its own terms only (``G_C − G_i``
    would lose digits to cancellation when ``G`` is large)."""
    rev = x.flip(2).cumsum(2).flip(2)  # Σ_{s ≥ i}
    return torch.cat([rev[:, :, 1:], torch.zeros_like(rev[:, :, :1])], dim=2)

"""The backward pass of the three chunked rules as Triton kernels (chapter 21).

One code path for the delta rule, Gated DeltaNet and KDA, the rule a constexpr ``GATE`` (``0`` no
gate, ``1`` one log decay per token and head, ``2`` one per token and key channel), as in
:mod:`tinyk3.kernels.gated`. The public entry points are the ``chunked`` functions of
:mod:`tinyk3.kernels.delta_rule`, :mod:`tinyk3.kernels.gated_delta_rule` and
:mod:`tinyk3.kernels.kda`: autograd functions whose forward launches the forward kernels and
keeps the inputs, the chunk-boundary states ``S_[c]`` and (gated rules) the inverses ``X``,
and whose backward calls
:func:`backward` here, which launches these kernels (under the Triton interpreter for CPU
tensors; no PyTorch computation inside but the sum of per-block partial gradients).

The equations are chapters 19 and 20's (:func:`tinyk3.ops.delta_rule.chunked_backward`,
:func:`tinyk3.ops.gated_delta_rule.chunked_backward`, :func:`tinyk3.ops.kda.chunked_backward`),
per chunk, with ``Q̃ = γ ⊙ Q``, ``K̃ = γ ⊙ K`` (the WY keys), ``K̄ = ρ ⊙ K`` (the keys written
to the next state, ``ρ_i = e^{G_C − G_i}``) and ``Ω`` the decayed scores (``j ≤ i``)::

    dU'_[c] = Ωᵀ dO + K̄ dS_[c+1]                          } stage 3, sequential over chunks
    dS_[c]  = γ_C ⊙ dS_[c+1] + Q̃ᵀ dO − Wᵀ dU'_[c]          }
    dW      = −dU' S_[c]ᵀ,   d𝒯 = dW K̃ᵀ + dU' Vᵀ,  dV = 𝒯ᵀ dU'
    Gm      = tril(−Xᵀ d𝒯 𝒯ᵀ, −1),   dβ = diag(Xᵀ d𝒯) + rowsum(Gm ⊙ A),   dA = diag(β) Gm
    dQ      = γ ⊙ (dO S_[c]ᵀ) + (dΩ ⊙ Γ) K
    dK      = γ ⊙ (𝒯ᵀ dW) + ρ ⊙ (U' dS_[c+1]ᵀ) + (dΩ ⊙ Γ)ᵀ Q + (dA ⊙ Γ + (dA ⊙ Γ)ᵀ) K
    dg_s    = Σ_{i ≥ s} dG_i + Σ_{i < s} d̄G_i               (the reverse cumulative sum)

with ``dΩ = dO U'ᵀ`` on ``j ≤ i`` (KDA: ``Γ`` per channel, the products formed sub-chunk by
sub-chunk as in the forward). Five launches:

1. ``_wy_kernel`` of :mod:`tinyk3.kernels.gated` (the forward's stage 1): ``W`` and ``U``
   recomputed, parallel over chunks and heads, from the inverses ``X = (I + L)⁻¹`` the
   forward kept (``LOAD_X``: no ``K Kᵀ`` and no solve), or with ``X`` solved again and stored
   (``STORE_X``) when it was not kept (chapter 9's delta-rule forward keeps none). ``𝒯`` is
   ``X diag(β)``; ``X`` is what is kept because ``β`` may be zero (padded tokens). (fla:
   ``recompute_w_u_fwd``, from its kept ``A``, our ``X``.)
2. :func:`_dv_local_kernel`: ``P = Ωᵀ dO`` (what ``dU'`` gets from the chunk's own outputs),
   parallel over Dv blocks, chunks and heads: the forward's output pass with ``Ω`` transposed.
   (fla: ``chunk_bwd_dv_local``.)
3. :func:`_adjoint_kernel`, the only sequential stage: a loop over the chunks from the last to the
   first, carrying ``dS`` (float32, ``[Dk, BV]`` in registers) as the forward's state pass
   carries ``S``. It recomputes ``U' = U − W S_[c]`` from the kept boundary state, and stores
   ``U'``, ``dU'`` and ``dS_[c+1]``. Why sequential: ``dS_[c]`` needs ``dS_[c+1]``, the state's
   gradient flows backward through every chunk, as the state flows forward. (fla:
   ``chunk_gated_delta_rule_bwd_dhu``.)
4. :func:`_ut_backward_kernel`, parallel over chunks and heads: ``d𝒯`` (a reduction over Dk and
   Dv: one program holds the whole ``C × C``), the UT transform's backward (``Gm``, the diagonal
   part of ``dβ``) and ``dV``. (fla: ``prepare_wy_repr_bwd``.)
5. :func:`_dqk_kernel`, parallel over Dk blocks, chunks and heads: ``dQ``, ``dK``, the rest of
   ``dβ`` and the gate's gradient, with the reverse cumulative sum inside the chunk. (fla:
   ``chunk_bwd_dqkwg`` and the rest of ``prepare_wy_repr_bwd``, then ``chunk_local_cumsum``.)
   Gated DeltaNet's gate and ``β`` are sums over Dk: each Dk block writes its partial sum and
   the host adds the blocks (as fla sums its blocks' ``dg``).

The decay pairs ``i = j`` (``Γ_ii = 1``) have no gate gradient: the kernels leave them out of the
gate's terms and add their share of ``dQ`` and ``dK`` directly, as the PyTorch backward does
(chapter 20). KDA's diagonal blocks take the reference point ``m = L_0 − EXP_LIMIT / 2`` from the
block's first token (every factor within ``e^{±40}``), the blocks below the diagonal the forward's
``r_a`` (every factor ``≤ 1``).

Modes: the forward's. ``"float32"`` (``input_precision`` ``"ieee"``, ``"tf32"``, ``"tf32x3"``), or
``"bfloat16"``: bf16 operands into every ``tl.dot``, float32 accumulators, ``W``, ``U``, ``U'``,
``dU'``, ``P`` and ``dS_[c+1]`` stored in bfloat16; ``X`` and ``Gm`` (the triangular matrices) and
the carried ``dS`` stay float32. The gradients are returned in the inputs' dtypes.
"""

from __future__ import annotations

import torch

from . import gated, runtime
from .gated import SUB_CHUNK, _channel_gates, _decayed_scores  # noqa: F401 (helpers, jitted here)
from .runtime import AVAILABLE, KernelSet, tile_size, to_operand  # noqa: F401

if AVAILABLE:
    import triton
    import triton.language as tl
else:  # the kernels below are plain functions until jitted; nothing here touches triton
    triton = tl = None

__all__ = ["backward", "launch_config", "compile_for_gpu", "KERNELS", "STAGES"]

KERNELS = KernelSet("tinyk3.kernels.backward", uses=(gated.KERNELS,))
_kernel = KERNELS.kernel
STAGES = ("wy", "dv_local", "adjoint", "ut_backward", "dqk")


def _kernels(interpret: bool):
    return KERNELS.get(interpret)


# ---------------------------------------------------------------------------------------------
# Helpers: a chunk's gates
# ---------------------------------------------------------------------------------------------

@KERNELS.helper
def _head_gates(g, i_bh, o_t, m_t, T, BC: tl.constexpr):
    """Gated DeltaNet, one chunk: ``G_i`` (from the chunk's start), ``G_C − G_i = Σ_{s > i} g_s``
    (a reverse scan of the gates loaded one token later: no cancellation) and ``G_C``, all
    float32, ``[C]``, ``[C]``, scalar."""
    o_i = tl.arange(0, BC)
    m_n = (o_i + 1 < BC) & (o_t + 1 < T)
    b_g = tl.load(g + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_gn = tl.load(g + i_bh * T + o_t + 1, mask=m_n, other=0.0).to(tl.float32)
    b_G = tl.associative_scan(b_g, 0, tl.standard._sum_combine)
    b_rest = tl.associative_scan(b_gn, 0, tl.standard._sum_combine, reverse=True)
    return b_G, b_rest, tl.reduce(b_g, 0, tl.standard._sum_combine)


@KERNELS.helper
def _channel_tiles(g, i_bh, o_t, m_t, T, Dk, o_k, m_k, BC: tl.constexpr):
    """KDA, one chunk and block of channels: the gates ``[C, BK]``, ``Σ_{s > i} g_s`` (reverse
    scan of the gates one token later) and ``G_C`` ``[BK]``, float32."""
    o_i = tl.arange(0, BC)
    m_n = (o_i + 1 < BC) & (o_t + 1 < T)
    p_g = g + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
    b_g = tl.load(p_g, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    b_gn = tl.load(p_g + Dk, mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    b_rest = tl.associative_scan(b_gn, 0, tl.standard._sum_combine, reverse=True)
    return b_g, b_rest, tl.reduce(b_g, 0, tl.standard._sum_combine)


# ---------------------------------------------------------------------------------------------
# Stage 2: P = Ωᵀ dO, parallel (the forward's output pass, Ω transposed)
# ---------------------------------------------------------------------------------------------

@_kernel
def _dv_local_kernel(
    q, k, g, do,  # q, k [BH, T, Dk]; g; dO [BH, T, Dv]
    p,  # output P = Ωᵀ dO [BH, T, Dv]
    T, Dk, Dv,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BS: tl.constexpr, GATE: tl.constexpr,
    PRECISION: tl.constexpr, BF16: tl.constexpr, EMULATE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.cast(tl.program_id(2), tl.int64)
    o_i = tl.arange(0, BC)
    o_t = i_c * BC + o_i
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v[None, :] < Dv)

    # -- Ω_[c] = Q Kᵀ ⊙ Γ on j ≤ i, as in the forward's output pass --------------------------------
    b_sc = tl.full([BC, BC], 0.0, tl.float32)
    for i_k in range(0, (Dk + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < Dk)
        b_q = tl.load(q + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)
        b_k = tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)
        if GATE == 2:
            p_g = g + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
            b_Gc, b_Ls, b_R = _channel_gates(tl.load(p_g, mask=m_tk, other=0.0).to(tl.float32),
                                             BC, BK, BS)
            b_sc += _decayed_scores(b_q, b_k, b_Ls, b_R, BC, BS, PRECISION, BF16, EMULATE)
        else:
            b_sc += tl.dot(to_operand(b_q, BF16, EMULATE), tl.trans(to_operand(b_k, BF16, EMULATE)),
                           input_precision=PRECISION)
    if GATE == 1:
        b_G = tl.associative_scan(tl.load(g + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32),
                                  0, tl.standard._sum_combine)
        b_sc = b_sc * tl.exp(tl.where(o_i[:, None] >= o_i[None, :], b_G[:, None] - b_G[None, :],
                                      float("-inf")))
    b_sc = to_operand(tl.where(o_i[:, None] >= o_i[None, :], b_sc, 0.0), BF16, EMULATE)

    # -- P = Ωᵀ dO: the forward's Ω U' with Ω transposed and dO for U' ------------------------------
    b_do = tl.load(do + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
    b_p = tl.dot(tl.trans(b_sc), to_operand(b_do.to(tl.float32), BF16, EMULATE),
                 input_precision=PRECISION)
    tl.store(p + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :],
             to_operand(b_p, BF16, EMULATE).to(p.dtype.element_ty), mask=m_tv)


# ---------------------------------------------------------------------------------------------
# Stage 3: the adjoint state pass, sequential over chunks (last to first)
# ---------------------------------------------------------------------------------------------

@_kernel
def _adjoint_kernel(
    q, k, g, w, u, states, p, do, ds_T,  # inputs; ds_T = ∂L/∂S_T [BH, Dk, Dv] (float32)
    u_new, du_new, ds_next, ds0,  # outputs: U', dU' [BH, T, Dv]; dS_[c+1] [BH, NT, Dk, Dv]; dS_0
    T, Dk, Dv, NT,
    BC: tl.constexpr,
    BK: tl.constexpr,  # all of Dk, padded (dS's rows stay in registers, as S's in the forward)
    BV: tl.constexpr,  # this program's block of dS's columns
    GATE: tl.constexpr, HAS_DS: tl.constexpr,
    PRECISION: tl.constexpr, BF16: tl.constexpr, EMULATE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.cast(tl.program_id(1), tl.int64)
    o_i = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < Dk
    m_v = o_v < Dv
    m_kv = m_k[:, None] & m_v[None, :]

    b_dS = tl.full([BK, BV], 0.0, tl.float32)  # dS_[N] = ∂L/∂S_T (zero if not given)
    if HAS_DS:
        b_dS += tl.load(ds_T + i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :], mask=m_kv,
                        other=0.0).to(tl.float32)

    for i_r in range(0, NT):  # the sequential loop, backward: chunk c needs dS_[c+1]
        i_c = NT - 1 - i_r
        o_t = i_c * BC + o_i
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_dSop = to_operand(b_dS, BF16, EMULATE)
        p_dh = ds_next + (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        tl.store(p_dh, b_dSop.to(ds_next.dtype.element_ty), mask=m_kv)  # kept for stage 5

        # -- U'_[c] = U_[c] − W_[c] S_[c], from the kept boundary state (the forward's line) -------
        p_h = states + (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        b_h = to_operand(tl.load(p_h, mask=m_kv, other=0.0).to(tl.float32), BF16, EMULATE)
        b_w = tl.load(w + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk, other=0.0)
        b_w = to_operand(b_w.to(tl.float32), BF16, EMULATE)
        b_u = tl.load(u + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
        b_un = to_operand(b_u.to(tl.float32) - tl.dot(b_w, b_h, input_precision=PRECISION),
                          BF16, EMULATE)
        tl.store(u_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :],
                 b_un.to(u_new.dtype.element_ty), mask=m_tv)

        # -- the keys to the chunk's end (ρ ⊙ K), the queries from its start (γ ⊙ Q), γ_C --------
        b_k = tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)
        b_q = tl.load(q + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)
        if GATE == 1:
            b_G, b_rest, b_GC = _head_gates(g, i_bh, o_t, m_t, T, BC)
            b_k = b_k * tl.exp(b_rest)[:, None]
            b_q = b_q * tl.exp(b_G)[:, None]
        if GATE == 2:
            b_g, b_rest, b_GC = _channel_tiles(g, i_bh, o_t, m_t, T, Dk, o_k, m_k, BC)
            b_k = b_k * tl.exp(b_rest)
            b_q = b_q * tl.exp(tl.associative_scan(b_g, 0, tl.standard._sum_combine))

        # -- dU'_[c] = P_[c] + (ρ ⊙ K) dS_[c+1] ------------------------------------------------------
        b_p = tl.load(p + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
        b_du = b_p.to(tl.float32) + tl.dot(to_operand(b_k, BF16, EMULATE), b_dSop,
                                           input_precision=PRECISION)
        b_du = to_operand(b_du, BF16, EMULATE)
        tl.store(du_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :],
                 b_du.to(du_new.dtype.element_ty), mask=m_tv)

        # -- dS_[c] = γ_C ⊙ dS_[c+1] + (γ ⊙ Q)ᵀ dO_[c] − W_[c]ᵀ dU'_[c] -----------------------------
        if GATE == 1:
            b_dS = b_dS * tl.exp(b_GC)
        if GATE == 2:
            b_dS = b_dS * tl.exp(b_GC)[:, None]
        b_do = tl.load(do + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
        b_dS += tl.dot(tl.trans(to_operand(b_q, BF16, EMULATE)),
                       to_operand(b_do.to(tl.float32), BF16, EMULATE), input_precision=PRECISION)
        b_dS -= tl.dot(tl.trans(b_w), b_du, input_precision=PRECISION)

    tl.store(ds0 + i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :], b_dS, mask=m_kv)


# ---------------------------------------------------------------------------------------------
# Stage 4: d𝒯, the UT transform's backward and dV (parallel over chunks and heads)
# ---------------------------------------------------------------------------------------------

@_kernel
def _ut_backward_kernel(
    k, v, beta, g, x, states, du_new,  # inputs (X [BH, T, C] float32 from stage 1)
    dv, gm, db,  # outputs: dV [BH, T, Dv]; Gm [BH, T, C] (float32); diag(Xᵀ d𝒯) [BH, T]
    T, Dk, Dv, NT,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BS: tl.constexpr, GATE: tl.constexpr,
    PRECISION: tl.constexpr, BF16: tl.constexpr, EMULATE: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_bh = tl.cast(tl.program_id(1), tl.int64)
    o_i = tl.arange(0, BC)
    o_t = i_c * BC + o_i
    m_t = o_t < T
    if GATE == 1:
        b_G = tl.associative_scan(tl.load(g + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32),
                                  0, tl.standard._sum_combine)

    # -- d𝒯 = dW K̃ᵀ + dU' Vᵀ, dW = −dU' S_[c]ᵀ: Dk blocks outside, Dv blocks inside ---------------
    b_dT = tl.full([BC, BC], 0.0, tl.float32)
    for i_k in range(0, (Dk + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk
        m_tk = m_t[:, None] & m_k[None, :]
        b_kg = tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                       other=0.0).to(tl.float32)
        if GATE == 1:
            b_kg = b_kg * tl.exp(b_G)[:, None]  # γ ⊙ K, the keys W was made of
        if GATE == 2:
            p_g = g + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
            b_Gc, b_Ls, b_R = _channel_gates(tl.load(p_g, mask=m_tk, other=0.0).to(tl.float32),
                                             BC, BK, BS)
            b_kg = b_kg * tl.exp(b_Gc)
        b_dw = tl.full([BC, BK], 0.0, tl.float32)
        for i_v in range(0, (Dv + BV - 1) // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < Dv
            b_du = tl.load(du_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :],
                           mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            p_h = states + (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
            b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            b_dw -= tl.dot(to_operand(b_du, BF16, EMULATE), tl.trans(to_operand(b_h, BF16, EMULATE)),
                           input_precision=PRECISION)
        b_dT += tl.dot(to_operand(b_dw, BF16, EMULATE), tl.trans(to_operand(b_kg, BF16, EMULATE)),
                       input_precision=PRECISION)
    # 𝒯 = X diag(β), loaded only now (fewer C × C tiles live in the loops above)
    b_beta = tl.load(beta + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32)
    b_X = tl.load(x + i_bh * T * BC + o_t[:, None] * BC + o_i[None, :], mask=m_t[:, None], other=0.0)
    b_Top = to_operand(b_X * b_beta[None, :], BF16, EMULATE)
    for i_v in range(0, (Dv + BV - 1) // BV):  # + dU' Vᵀ, and dV = 𝒯ᵀ dU'
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < Dv)
        b_du = tl.load(du_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv,
                       other=0.0)
        b_du = to_operand(b_du.to(tl.float32), BF16, EMULATE)
        b_v = tl.load(v + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
        b_dT += tl.dot(b_du, tl.trans(to_operand(b_v.to(tl.float32), BF16, EMULATE)),
                       input_precision=PRECISION)
        b_dv = tl.dot(tl.trans(b_Top), b_du, input_precision=PRECISION)
        tl.store(dv + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], b_dv.to(dv.dtype.element_ty),
                 mask=m_tv)

    # -- the UT transform's backward: Xᵀ d𝒯, Gm = tril(−Xᵀ d𝒯 𝒯ᵀ, −1), diag(Xᵀ d𝒯) ----------------
    b_XtdT = tl.dot(tl.trans(to_operand(b_X, BF16, EMULATE)), to_operand(b_dT, BF16, EMULATE),
                    input_precision=PRECISION)
    b_Gm = -tl.dot(to_operand(b_XtdT, BF16, EMULATE), tl.trans(b_Top), input_precision=PRECISION)
    b_Gm = tl.where(o_i[:, None] > o_i[None, :], b_Gm, 0.0)
    tl.store(gm + i_bh * T * BC + o_t[:, None] * BC + o_i[None, :], b_Gm, mask=m_t[:, None])
    b_db = tl.reduce(tl.where(o_i[:, None] == o_i[None, :], b_XtdT, 0.0), 1, tl.standard._sum_combine)
    tl.store(db + i_bh * T + o_t, b_db, mask=m_t)


# ---------------------------------------------------------------------------------------------
# Stage 5: dQ, dK, the rest of dβ and the gate (parallel over Dk blocks, chunks and heads)
# ---------------------------------------------------------------------------------------------

@KERNELS.helper
def _kda_pairs_backward(b_q, b_k, b_beta, b_m1, b_gm, b_Ls, b_R,
                        BC: tl.constexpr, BS: tl.constexpr,
                        PRECISION: tl.constexpr, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """KDA's pair-score backward over one block of channels (:func:`tinyk3.ops.kda.
    pair_scores_backward`): with ``M1`` the gradient of ``Ω`` on ``j < i`` and ``Gm`` the UT
    transform's (``dA = diag(β) Gm``), returns ``[C, BK]`` tiles::

        dXq_i = Σ_{j<i} M1_ij k_j ⊙ e^{G_i − G_j}    dXk_i = Σ_{j<i} Gm_ij k_j ⊙ e^{G_i − G_j}
        dY_j  = Σ_{i>j} (M1_ij q_i + β_i Gm_ij k_i) ⊙ e^{G_i − G_j}

    Blocks below the diagonal (sub-chunk ``b < a``): one ``tl.dot`` per row sub-chunk ``a`` with
    the forward's factors ``e^{L_i}`` and ``e^{r_a − r_b − L_j}`` (both ``≤ 1``). The diagonal
    blocks all at once, each with the reference ``m = L_0 − 40`` of its own first token:
    ``e^{L_i − m} · e^{m − L_j}``, each within ``e^{±40}`` (a product with a gradient cannot
    overflow), and no factor depends on a later token's gate."""
    o_i = tl.arange(0, BC)
    o_a = o_i // BS
    b_n = b_gm * b_beta[:, None]  # dA = diag(β) Gm
    # -- the diagonal blocks: the reference of each sub-chunk's first token, shared by its rows ---
    b_m = b_Ls * 0.0  # m of each row's sub-chunk, [C, BK]
    for a in tl.static_range(BC // BS):
        b_first = tl.reduce(tl.where(o_i[:, None] == a * BS, b_Ls, 0.0), 0, tl.standard._sum_combine)
        b_m = tl.where(o_a[:, None] == a, b_first[None, :] - 40.0, b_m)  # EXP_LIMIT / 2
    b_rows = tl.exp(b_Ls - b_m)  # e^{L_i − m}
    b_cols = tl.exp(b_m - b_Ls)  # e^{m − L_j}
    same = o_a[:, None] == o_a[None, :]
    b_kc = to_operand(b_k * b_cols, BF16, EMULATE)
    b_md = to_operand(tl.where(same, b_m1, 0.0), BF16, EMULATE)
    b_gd = to_operand(tl.where(same, b_gm, 0.0), BF16, EMULATE)
    b_dxq = b_rows * tl.dot(b_md, b_kc, input_precision=PRECISION)
    b_dxk = b_rows * tl.dot(b_gd, b_kc, input_precision=PRECISION)
    b_dy = b_cols * (
        tl.dot(tl.trans(b_md), to_operand(b_q * b_rows, BF16, EMULATE), input_precision=PRECISION)
        + tl.dot(tl.trans(to_operand(tl.where(same, b_n, 0.0), BF16, EMULATE)),
                 to_operand(b_k * b_rows, BF16, EMULATE), input_precision=PRECISION))
    # -- the blocks below the diagonal, one row sub-chunk a (reference r_a) at a time -----------
    b_eL = tl.exp(b_Ls)  # e^{L_i} ≤ 1
    b_qr = to_operand(b_q * b_eL, BF16, EMULATE)
    b_kr = to_operand(b_k * b_eL, BF16, EMULATE)
    for a in tl.static_range(1, BC // BS):
        b_ra = tl.reduce(tl.where(o_i[:, None] == a * BS, b_R, 0.0), 0, tl.standard._sum_combine)
        b_ca = tl.exp(tl.where(o_a[:, None] < a, b_ra[None, :] - b_R - b_Ls, float("-inf")))
        blk = (o_a[:, None] == a) & (o_a[None, :] < a)  # rows of sub-chunk a, columns before it
        b_ma = to_operand(tl.where(blk, b_m1, 0.0), BF16, EMULATE)
        b_ga = to_operand(tl.where(blk, b_gm, 0.0), BF16, EMULATE)
        b_kc = to_operand(b_k * b_ca, BF16, EMULATE)
        b_dxq += b_eL * tl.dot(b_ma, b_kc, input_precision=PRECISION)
        b_dxk += b_eL * tl.dot(b_ga, b_kc, input_precision=PRECISION)
        b_dy += b_ca * (
            tl.dot(tl.trans(b_ma), b_qr, input_precision=PRECISION)
            + tl.dot(tl.trans(to_operand(tl.where(blk, b_n, 0.0), BF16, EMULATE)), b_kr,
                     input_precision=PRECISION))
    return b_dxq, b_dxk, b_dy


@_kernel
def _dqk_kernel(
    q, k, beta, g, do, x, gm, states, u_new, du_new, ds_next,  # inputs
    dq, dk, db, dg,  # outputs: dQ, dK [BH, T, Dk]; dβ's share [NK, BH, T]; dg (see below)
    T, Dk, Dv, NT,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BS: tl.constexpr, GATE: tl.constexpr,
    PRECISION: tl.constexpr, BF16: tl.constexpr, EMULATE: tl.constexpr,
):
    # dg: Gated DeltaNet [NK, BH, T] (this Dk block's share), KDA [BH, T, Dk]
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.cast(tl.program_id(2), tl.int64)
    BH = tl.num_programs(2)
    o_i = tl.arange(0, BC)
    o_t = i_c * BC + o_i
    m_t = o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < Dk
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk, other=0.0)
    b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
    b_beta = tl.load(beta + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32)

    # -- every product that contracts over Dv, block by block -------------------------------------
    b_dqg = tl.full([BC, BK], 0.0, tl.float32)  # dO S_[c]ᵀ      (the inter-chunk output term)
    b_dkr = tl.full([BC, BK], 0.0, tl.float32)  # U' dS_[c+1]ᵀ   (the keys written to the state)
    b_dw = tl.full([BC, BK], 0.0, tl.float32)  # −dU' S_[c]ᵀ    (W = 𝒯 K̃)
    b_draw = tl.full([BC, BC], 0.0, tl.float32)  # dO U'ᵀ       (the scores Ω)
    b_hs = tl.full([BK], 0.0, tl.float32)  # Σ_v dS_[c+1] ⊙ S_[c] per row (the state's decay)
    for i_v in range(0, (Dv + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < Dv
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_do = tl.load(do + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
        b_un = tl.load(u_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv,
                       other=0.0)
        b_du = tl.load(du_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv,
                       other=0.0)
        p_h = (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        b_h = tl.load(states + p_h, mask=m_kv, other=0.0).to(tl.float32)
        b_dh = tl.load(ds_next + p_h, mask=m_kv, other=0.0).to(tl.float32)
        b_do = to_operand(b_do.to(tl.float32), BF16, EMULATE)
        b_un = to_operand(b_un.to(tl.float32), BF16, EMULATE)
        b_du = to_operand(b_du.to(tl.float32), BF16, EMULATE)
        b_hop = tl.trans(to_operand(b_h, BF16, EMULATE))
        b_dqg += tl.dot(b_do, b_hop, input_precision=PRECISION)
        b_dkr += tl.dot(b_un, tl.trans(to_operand(b_dh, BF16, EMULATE)), input_precision=PRECISION)
        b_dw -= tl.dot(b_du, b_hop, input_precision=PRECISION)
        b_draw += tl.dot(b_do, tl.trans(b_un), input_precision=PRECISION)
        if GATE > 0:
            b_hs += tl.reduce(b_dh * b_h, 1, tl.standard._sum_combine)

    # -- 𝒯ᵀ dW: the WY keys' gradient --------------------------------------------------------------
    b_X = tl.load(x + i_bh * T * BC + o_t[:, None] * BC + o_i[None, :], mask=m_t[:, None], other=0.0)
    b_T = to_operand(b_X * b_beta[None, :], BF16, EMULATE)
    b_dkg = tl.dot(tl.trans(b_T), to_operand(b_dw, BF16, EMULATE), input_precision=PRECISION)

    # -- the scores' gradients: dΩ on j < i (M1) and i = j (its diagonal), the UT's Gm ------------
    b_m1 = tl.where(o_i[:, None] > o_i[None, :], b_draw, 0.0)
    b_dd = tl.reduce(tl.where(o_i[:, None] == o_i[None, :], b_draw, 0.0), 1, tl.standard._sum_combine)
    b_gm = tl.load(gm + i_bh * T * BC + o_t[:, None] * BC + o_i[None, :], mask=m_t[:, None], other=0.0)
    if GATE == 2:
        b_g, b_rest, b_GC = _channel_tiles(g, i_bh, o_t, m_t, T, Dk, o_k, m_k, BC)
        b_Gc, b_Ls, b_R = _channel_gates(b_g, BC, BK, BS)
        b_dxq, b_dxk, b_dy = _kda_pairs_backward(b_q, b_k, b_beta, b_m1, b_gm, b_Ls, b_R, BC, BS,
                                                 PRECISION, BF16, EMULATE)
    else:
        if GATE == 1:  # ⊙ Γ on j < i (the exponent masked before the exp)
            b_G, b_rest, b_GC = _head_gates(g, i_bh, o_t, m_t, T, BC)
            b_Gam = tl.exp(tl.where(o_i[:, None] > o_i[None, :], b_G[:, None] - b_G[None, :],
                                    float("-inf")))
            b_m1 = b_m1 * b_Gam
            b_gm = b_gm * b_Gam
        b_m1op = to_operand(b_m1, BF16, EMULATE)
        b_kop = to_operand(b_k, BF16, EMULATE)
        b_dxq = tl.dot(b_m1op, b_kop, input_precision=PRECISION)
        b_dxk = tl.dot(to_operand(b_gm, BF16, EMULATE), b_kop, input_precision=PRECISION)
        b_dy = (tl.dot(tl.trans(b_m1op), to_operand(b_q, BF16, EMULATE), input_precision=PRECISION)
                + tl.dot(tl.trans(to_operand(b_gm * b_beta[:, None], BF16, EMULATE)), b_kop,
                         input_precision=PRECISION))

    # -- dQ and dK: every term, the diagonal pairs i = j added directly ----------------------------
    b_dq = b_dxq + b_dd[:, None] * b_k
    b_dk = b_beta[:, None] * b_dxk + b_dy + b_dd[:, None] * b_q
    if GATE == 0:
        b_dq += b_dqg
        b_dk += b_dkg + b_dkr
    if GATE == 1:
        b_gam = tl.exp(b_G)
        b_rho = tl.exp(b_rest)
        b_dq += b_gam[:, None] * b_dqg
        b_dk += b_gam[:, None] * b_dkg + b_rho[:, None] * b_dkr
    if GATE == 2:
        b_gam = tl.exp(b_Gc)
        b_rho = tl.exp(b_rest)
        b_dq += b_gam * b_dqg
        b_dk += b_gam * b_dkg + b_rho * b_dkr
    p_out = i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
    tl.store(dq + p_out, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_out, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    # dβ's share through A = K Kᵀ ⊙ Γ: rowsum(Gm ⊙ A) = Σ_d k_id (Σ_j Gm_ij Γ_ij k_jd)
    b_dbk = tl.reduce(b_k * b_dxk, 1, tl.standard._sum_combine)
    tl.store(db + (i_k * BH + i_bh) * T + o_t, b_dbk, mask=m_t)

    # -- the gate: each factor's term (dG), then dg_s = Σ_{i ≥ s} dG_i + Σ_{i < s} d̄G_i -------------
    last = o_i[:, None] == BC - 1  # the state's decay γ_C = e^{G_C} sits on the chunk's last token
    if GATE == 1:
        b_dG = tl.reduce(b_gam[:, None] * (b_q * b_dqg + b_k * b_dkg)
                         + b_q * b_dxq + b_beta[:, None] * b_k * b_dxk - b_k * b_dy,
                         1, tl.standard._sum_combine)
        b_dG += tl.where(o_i == BC - 1, tl.exp(b_GC) * tl.reduce(b_hs, 0, tl.standard._sum_combine),
                         0.0)
        b_drest = b_rho * tl.reduce(b_dkr * b_k, 1, tl.standard._sum_combine)  # through ρ_i
        b_dg = (tl.associative_scan(b_dG, 0, tl.standard._sum_combine, reverse=True)
                + tl.associative_scan(b_drest, 0, tl.standard._sum_combine) - b_drest)
        tl.store(dg + (i_k * BH + i_bh) * T + o_t, b_dg, mask=m_t)
    if GATE == 2:
        b_dG = (b_gam * (b_q * b_dqg + b_k * b_dkg)
                + b_q * b_dxq + b_beta[:, None] * b_k * b_dxk - b_k * b_dy)
        b_dG += tl.where(last, (tl.exp(b_GC) * b_hs)[None, :], 0.0)
        b_drest = b_rho * b_dkr * b_k
        b_dg = (tl.associative_scan(b_dG, 0, tl.standard._sum_combine, reverse=True)
                + tl.associative_scan(b_drest, 0, tl.standard._sum_combine) - b_drest)
        tl.store(dg + p_out, b_dg.to(dg.dtype.element_ty), mask=m_tk)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------

def launch_config(chunk_size: int, Dk: int, Dv: int, gate: int) -> dict[str, dict]:
    """Tiles and launch options of the four backward kernels (stage 1 is the forward's
    ``wy``, :func:`tinyk3.kernels.gated.launch_config`). ``adjoint``: ``BK`` all of Dk (the
    carried ``dS``'s rows), as the forward's state pass. ``ut_backward`` and ``dqk`` walk Dk and
    Dv in blocks. Chosen from ptxas' reports for sm_80 and sm_90 (the record
    ``benchmarks/2026-12-03-ptxas-backward/``)."""
    fwd = gated.launch_config(chunk_size, Dk, Dv, max(gate, 1))
    BK_full, BV_full = tile_size(Dk), tile_size(Dv)
    warps = 8 if chunk_size * BK_full >= 2048 else 4
    big = warps == 8  # the large tiles: C · Dk ≥ 2048
    return {
        "wy": fwd["wy"],
        "dv_local": dict(BK=min(BK_full, 32 if gate == 2 else 64), BV=min(BV_full, 64),
                         num_warps=warps, num_stages=1),
        "adjoint": dict(BK=BK_full, BV=min(BV_full, 16 if big else 64), num_warps=warps,
                        num_stages=1),
        "ut_backward": dict(BK=min(BK_full, 32 if big else 64), BV=min(BV_full, 32 if big else 64),
                            num_warps=warps, num_stages=1),
        "dqk": dict(BK=16, BV=16, num_warps=warps, num_stages=1),  # its many tiles: the smallest
    }


def backward(q, k, v, beta, g, d_o, d_state, *, gate: int, chunk_size: int, initial_state=None,
             states=None, x=None, input_precision: str = "ieee", operands: str = "float32",
             config=None, return_stages: bool = False):
    """The gradients of the chunked rule ``gate`` (0 delta rule, 1 Gated DeltaNet, 2 KDA) by the
    backward kernels. Inputs as the forward's (validated by the caller; ``g`` is ignored for
    ``gate = 0``), ``d_o [B, H, T, Dv]``, ``d_state [B, H, Dk, Dv]`` or None, ``states`` the
    forward's chunk-boundary states ``[B, H, NT, Dk, Dv]`` (None: recomputed by the forward's
    stages 1 and 2 first, fla's choice), ``x`` the forward's inverses ``X [B, H, T, C]``
    (None: solved again in stage 1). Returns ``(dq, dk, dv, dβ, dg, dS_0)`` in float32
    (``dg`` None for ``gate = 0``), or with ``return_stages`` a dict of what every stage wrote.
    """
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    dev, f32 = q.device, torch.float32
    C, BH = chunk_size, B * H
    NT = -(-T // C)
    if T == 0 or BH == 0:
        dS0 = (torch.zeros(B, H, Dk, Dv, dtype=f32, device=dev) if d_state is None
               else d_state.to(f32).clone())
        z = q.new_zeros(B, H, T, Dk, dtype=f32)
        dg = None if gate == 0 else (z if gate == 2 else q.new_zeros(B, H, T, dtype=f32))
        return z, z.clone(), v.new_zeros(B, H, T, Dv, dtype=f32), q.new_zeros(B, H, T, dtype=f32), dg, dS0
    interpret = runtime.interpreting(dev)
    kern, fwd = _kernels(interpret), gated._kernels(interpret)
    bf16 = operands == "bfloat16"
    if g is None:
        g = beta  # never read when gate = 0 (a placeholder pointer)
    ins = [q, k, v, beta, g, d_o]
    if interpret:  # no bfloat16 in the interpreter: float32 tensors, bfloat16 emulated in-kernel
        ins = [t.to(f32) for t in ins]
    q, k, v, beta, g, d_o = (t.contiguous() for t in ins)
    mid = torch.bfloat16 if bf16 and not interpret else f32
    cfg = config or launch_config(C, Dk, Dv, gate)
    mode = dict(BC=C, GATE=gate, PRECISION=input_precision, BF16=bf16, EMULATE=interpret)
    out: dict[str, torch.Tensor] = {}

    # (1) W and U (and X unless kept), the forward's stage 1
    w = torch.empty(B, H, T, Dk, dtype=mid, device=dev)
    u = torch.empty(B, H, T, Dv, dtype=mid, device=dev)
    kept_x = x is not None
    x = x.contiguous() if kept_x else torch.empty(B, H, T, C, dtype=f32, device=dev)
    fwd._wy_kernel[(NT, BH)](k, v, beta, g, w, u, x, T, Dk, Dv, BS=SUB_CHUNK, STORE_X=not kept_x,
                             LOAD_X=kept_x, **mode, **cfg["wy"])
    if states is None:  # not kept by the forward: its state pass again (fla's choice)
        S0 = torch.zeros(B, H, Dk, Dv, dtype=f32, device=dev)
        if initial_state is not None:
            S0.copy_(initial_state.detach())
        states = torch.empty(B, H, NT, Dk, Dv, dtype=mid, device=dev)
        c2 = gated.launch_config(C, Dk, Dv, max(gate, 1))["state"]
        fwd._state_kernel[(triton.cdiv(Dv, c2["BV"]), BH)](
            k, g, w, u, S0, states, torch.empty_like(u), torch.empty_like(S0), T, Dk, Dv, NT,
            HAS_S0=initial_state is not None, **mode, **c2)
    states = states.to(mid).contiguous()

    # (2) P = Ωᵀ dO
    c = cfg["dv_local"]
    p = torch.empty(B, H, T, Dv, dtype=mid, device=dev)
    kern._dv_local_kernel[(triton.cdiv(Dv, c["BV"]), NT, BH)](q, k, g, d_o, p, T, Dk, Dv,
                                                              BS=SUB_CHUNK, **mode, **c)
    # (3) the adjoint state pass
    c = cfg["adjoint"]
    u_new, du_new = torch.empty_like(u), torch.empty_like(u)
    ds_next = torch.empty(B, H, NT, Dk, Dv, dtype=mid, device=dev)
    dS0 = torch.empty(B, H, Dk, Dv, dtype=f32, device=dev)
    ds_T = dS0 if d_state is None else d_state.to(f32).contiguous()
    kern._adjoint_kernel[(triton.cdiv(Dv, c["BV"]), BH)](
        q, k, g, w, u, states, p, d_o, ds_T, u_new, du_new, ds_next, dS0, T, Dk, Dv, NT,
        HAS_DS=d_state is not None, **mode, **c)
    # (4) d𝒯, the UT transform's backward, dV
    c = cfg["ut_backward"]
    dv = torch.empty(B, H, T, Dv, dtype=f32, device=dev)
    gm = torch.empty(B, H, T, C, dtype=f32, device=dev)
    db_diag = torch.empty(B, H, T, dtype=f32, device=dev)
    kern._ut_backward_kernel[(NT, BH)](k, v, beta, g, x, states, du_new, dv, gm, db_diag,
                                       T, Dk, Dv, NT, BS=SUB_CHUNK, **mode, **c)
    # (5) dQ, dK, dβ's share through A, the gate
    c = cfg["dqk"]
    NK = triton.cdiv(Dk, c["BK"])
    dq = torch.empty(B, H, T, Dk, dtype=f32, device=dev)
    dk = torch.empty_like(dq)
    db_parts = torch.empty(NK, B, H, T, dtype=f32, device=dev)
    dg = (torch.empty(NK, B, H, T, dtype=f32, device=dev) if gate == 1
          else torch.empty_like(dq) if gate == 2 else db_parts)  # gate 0: never written
    kern._dqk_kernel[(NK, NT, BH)](q, k, beta, g, d_o, x, gm, states, u_new, du_new, ds_next,
                                   dq, dk, db_parts, dg, T, Dk, Dv, NT, BS=SUB_CHUNK, **mode, **c)
    # the only host arithmetic: the Dk blocks' partial sums of dβ (and Gated DeltaNet's dg)
    dbeta = db_diag + db_parts.sum(0)
    dg = None if gate == 0 else (dg.sum(0) if gate == 1 else dg)
    if return_stages:
        out.update(w=w, u=u, x=x, states=states, p=p, u_new=u_new, du_new=du_new,
                   ds_next=ds_next, gm=gm, dq=dq, dk=dk, dv=dv, dbeta=dbeta, dg=dg, dS0=dS0)
        return out
    return dq, dk, dv, dbeta, dg, dS0


def compile_for_gpu(gate: int, arch: int = 90, *, chunk_size: int = 64, Dk: int = 128,
                    Dv: int = 128, dtype: torch.dtype = torch.bfloat16, has_final_grad: bool = True,
                    input_precision: str = "ieee", operands: str = "float32",
                    config: dict | None = None, only: tuple | None = None) -> dict:
    """Compile the four backward kernels (``only``: those named) for ``GPUTarget("cuda", arch,
    32)`` without a GPU (as :func:`tinyk3.kernels.gated.compile_for_gpu` does for the forward).
    Returns
    ``{name: compiled}``; registers and spills: :func:`tinyk3.kernels.runtime.ptxas_report`."""
    runtime.require_triton("tinyk3.kernels.backward.compile_for_gpu")
    if gate not in (0, 1, 2) or chunk_size not in gated.CHUNK_SIZES or operands not in gated.OPERANDS:
        raise ValueError("compile_for_gpu: unsupported gate, chunk_size or operands")
    kern = _kernels(False)
    cfg = config or launch_config(chunk_size, Dk, Dv, gate)
    bf16 = operands == "bfloat16"
    x = runtime.pointer_type(dtype)
    m = runtime.pointer_type(torch.bfloat16 if bf16 else torch.float32)
    f32 = "*fp32"
    mode = {"BC": chunk_size, "GATE": gate, "PRECISION": input_precision, "BF16": bf16,
            "EMULATE": False}
    dims = dict(T="i32", Dk="i32", Dv="i32")
    specs = {
        "_dv_local_kernel": (dict(q=x, k=x, g=x, do=x, p=m, **dims), dict(mode, BS=SUB_CHUNK),
                             cfg["dv_local"]),
        "_adjoint_kernel": (dict(q=x, k=x, g=x, w=m, u=m, states=m, p=m, do=x, ds_T=f32, u_new=m,
                                 du_new=m, ds_next=m, ds0=f32, **dims, NT="i32"),
                            dict(mode, HAS_DS=has_final_grad), cfg["adjoint"]),
        "_ut_backward_kernel": (dict(k=x, v=x, beta=x, g=x, x=f32, states=m, du_new=m, dv=f32,
                                     gm=f32, db=f32, **dims, NT="i32"), dict(mode, BS=SUB_CHUNK),
                                cfg["ut_backward"]),
        "_dqk_kernel": (dict(q=x, k=x, beta=x, g=x, do=x, x=f32, gm=f32, states=m, u_new=m,
                             du_new=m, ds_next=m, dq=f32, dk=f32, db=f32, dg=f32, **dims, NT="i32"),
                        dict(mode, BS=SUB_CHUNK), cfg["dqk"]),
    }
    out = {}
    for name, (sig, constexprs, launch) in specs.items():
        if only is not None and name not in only:
            continue
        constexprs = {**constexprs, "BK": launch["BK"], "BV": launch["BV"]}
        out[name] = runtime.compile_kernel(getattr(kern, name), sig, constexprs, arch=arch,
                                           num_warps=launch["num_warps"],
                                           num_stages=launch["num_stages"])
    return out

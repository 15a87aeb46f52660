"""The gated forms of chapter 9's three Triton stages, shared by Gated DeltaNet (chapter 10) and
KDA (chapter 11). The public entry points are :func:`tinyk3.kernels.gated_delta_rule.chunked`
and :func:`tinyk3.kernels.kda.chunked`; this module holds the kernels and the host code both use.

One constexpr ``GATE`` selects the rule: ``1`` one log decay per token and head (Gated DeltaNet,
``g [B, H, T]``), ``2`` one per token and key channel (KDA, ``g [B, H, T, Dk]``). The equations,
per chunk of ``C`` tokens (:func:`tinyk3.ops.gated_delta_rule.chunked`,
:func:`tinyk3.ops.kda.chunked`; ``G_i = Σ_{s ≤ i} g_s`` inside the chunk, ``γ_i = exp(G_i)``)::

    𝒯        = (I + tril(diag(β) (K Kᵀ ⊙ Γ), −1))⁻¹ diag(β),   Γ_ij = exp(G_i − G_j)
               (KDA: Σ_d k_id k_jd exp(G_id − G_jd) in place of (K Kᵀ ⊙ Γ)_ij)
    W        = 𝒯 (K ⊙ γ),   U = 𝒯 V
    U'       = U − W S_[c]
    O_[c]    = (Q ⊙ γ) S_[c] + (Q Kᵀ ⊙ Γ) U'                        (j ≤ i)
    S_[c+1]  = Diag(γ_C) S_[c] + (K ⊙ γ_C / γ)ᵀ U'

Where the gate enters each of chapter 9's stages (the rest of each kernel is chapter 9's, line by
line; chapter 11 shows the diffs):

1. :func:`_wy_kernel`: the decayed ``K Kᵀ`` and ``W = 𝒯 (K ⊙ γ)``. The triangular solve is
   unchanged. (fla: ``chunk_gated_delta_rule_fwd_intra``; ``chunk_kda_fwd_intra``.)
2. :func:`_state_kernel`: the state decays by ``γ_C`` (a scalar, or one factor per row of ``S``)
   and the keys are decayed to the chunk's end, ``exp(G_C − G_i) = exp(Σ_{s > i} g_s)``, summed
   from the chunk's end (a reverse scan of the gates loaded one token later: no cancellation).
   (fla: ``chunk_gated_delta_rule_fwd_h`` with ``g`` / ``gk``.)
3. :func:`_output_kernel`: ``Q ⊙ γ`` for the inter-chunk term and the decayed ``Q Kᵀ``.
   (fla: ``chunk_fwd_o`` with ``g``; ``chunk_gla_fwd_o_gk``.)

Every stage recomputes the cumulative gates of its chunk from ``g`` (``tl.associative_scan``), so
no gate tensor but the input goes through global memory.

Gated DeltaNet: ``Γ`` is one ``C × C`` matrix per chunk, applied to ``K Kᵀ`` and ``Q Kᵀ`` after
the products, with the exponent masked *before* ``exp`` (``exp(G_i − G_j) ≤ 1`` on ``j ≤ i``;
above the diagonal it could overflow). Finite and accurate for any ``g ≤ 0``.

KDA: ``Σ_d k_id k_jd exp(G_id − G_jd)`` is no rescaled ``K Kᵀ``, and the factorisation
``(K ⊙ γ)(K ⊘ γ)ᵀ`` over a whole chunk overflows float32 (``exp(320)`` over 64 tokens at
``g = −5``). The kernels use :func:`tinyk3.ops.kda.pair_scores`' stable form (with
``exact_diagonal=False``): the chunk is cut into 16-token sub-chunks with reference points
``r_a`` (the cumulative gate before sub-chunk ``a``; :func:`_channel_gates` computes ``L_i``,
the gate summed from the start of ``i``'s sub-chunk, and ``r``), and the rows of sub-chunk ``a``
are multiplied with the columns of sub-chunks ``b ≤ a`` as
``(x_i ⊙ exp(L_i)) · (k_j ⊙ exp(r_a − r_b − L_j))``: the row factor lies in ``[e^{−80}, 1]``
for gates ``≥ −5``, the column factor is ``≤ 1`` for ``b < a`` and ``≤ e^{80}`` (5.5e34) inside
the diagonal block. One ``tl.dot`` per reference point (``C / 16`` of them), the rows of the
other sub-chunks zeroed: simple, at the price of ``C / 16`` full ``C × C`` products where fla
forms ``16 × 16`` blocks (the gated ``K Kᵀ`` and ``Q Kᵀ`` then cost 4× chapter 9's at C = 64).

Below the guarantee: if the gates of some 16-token sub-chunk sum below ``−EXP_LIMIT`` (−80,
possible only for gates below −5 per step), ``e^{−L}`` would overflow; the host checks this
(:func:`check_sub_chunk_gates`, one reduction over ``g``, skipped when ``g.min() ≥ −5``) and
raises a ``ValueError`` pointing to :func:`tinyk3.ops.kda.chunked`, which computes those
diagonal blocks pair by pair. The kernels have no exact-diagonal path.

Modes, dtypes, limits, the interpreter and the bfloat16 emulation are chapter 9's
(:mod:`tinyk3.kernels.delta_rule`): ``operands`` ``"float32"`` (``input_precision`` ``"ieee"``,
``"tf32"``, ``"tf32x3"``) or ``"bfloat16"`` (bfloat16 operands into every ``tl.dot``, float32
accumulation, ``W``, ``U``, ``S_[c]``, ``U'`` stored in bfloat16; every gate factor is formed and
applied in float32 and the gated tile rounded to bfloat16 once, as the operand of its product,
as fla does for ``W`` and the state pass; fla forms KDA's sub-chunk scores from float32 operands
with TF32 products, these kernels from bf16 ones); float16, bfloat16, float32 inputs;
``chunk_size`` 16, 32, 64; ``Dk, Dv ≤ 128``; any ``T``; CPU tensors under the interpreter. The
gates are read in the inputs' dtype and summed in float32. Padded tokens load ``g = 0`` (no
decay), ``k = 0``, ``β = 0``. Not carried over: ``fuse_output`` (chapter 9's experiment): the
output always has its own parallel pass, as in fla.

Launch configuration: chapter 9's :func:`tinyk3.kernels.delta_rule.launch_config`, the one
function for all three rules; :func:`launch_config` here calls it and shrinks the tiles where
ptxas reported spills for the gated stages. The compile record
``benchmarks/2026-12-02-ptxas-gated/`` has the registers and spills of every gated stage.

Autograd: :class:`_ChunkedFunction` keeps the inputs and the chunk-boundary states and runs
the backward as Triton kernels (:mod:`tinyk3.kernels.backward`, chapter 21).
"""

from __future__ import annotations

import torch

from .._validate import check_beta, check_gate, check_qkv, check_state
from ..gates import LOWER_BOUND
from ..ops import kda as _ops_kda
from . import runtime
from .delta_rule import CHUNK_SIZES, INPUT_PRECISIONS, MAX_HEAD_DIM, OPERANDS
from .delta_rule import launch_config as _delta_rule_launch_config
from .runtime import AVAILABLE, KernelSet, require_triton, tile_size, to_operand  # noqa: F401

if AVAILABLE:
    import triton
    import triton.language as tl
else:  # the kernels below are plain functions until jitted; nothing here touches triton
    triton = tl = None

__all__ = ["chunked", "forward_stages", "compile_for_gpu", "launch_config", "check_sub_chunk_gates",
           "GATES", "SUB_CHUNK", "EXP_LIMIT", "LOWER_BOUND", "KERNELS", "CHUNK_SIZES", "MAX_HEAD_DIM",
           "INPUT_PRECISIONS", "OPERANDS"]

GATES = {"gated_delta_rule": 1, "kda": 2}  # the constexpr GATE of each rule
SUB_CHUNK = _ops_kda.SUB_CHUNK  # 16: KDA's sub-chunks (divides every allowed chunk size)
EXP_LIMIT = _ops_kda.EXP_LIMIT  # 80: the most negative sub-chunk gate sum the kernels accept
# LOWER_BOUND (−5, tinyk3.gates): gates ≥ −5 per step can never pass EXP_LIMIT over 16 tokens
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NAMES = {1: "gated_delta_rule", 2: "kda"}

KERNELS = KernelSet("tinyk3.kernels.gated")
_kernel = KERNELS.kernel


def _kernels(interpret: bool):
    return KERNELS.get(interpret)


def launch_config(chunk_size: int, Dk: int, Dv: int, gate: int = 1) -> dict[str, dict]:
    """Chapter 9's :func:`tinyk3.kernels.delta_rule.launch_config` (the one launch configuration
    of all three rules), with smaller tiles where the gate's extra tiles push a stage past 255
    registers. Only for the large tiles (eight warps, ``C · Dk ≥ 2048``); below that chapter 9's
    tiles hold as they are.

    * Both rules: at most 32 state columns per program in the state and output passes (the
      decay factors and the masked exponent of ``Γ`` are ``[C, C]`` and ``[C, BK]`` tiles more).
    * KDA (``gate=2``): ``BK = 32`` in stages 1 and 3 (each Dk block carries the gate tiles
      ``G``, ``L``, ``R`` and two factored operands), with ``BV = 64`` in stage 3 (fewer
      programs reloading the same tiles), and ``BV = 16`` in the state pass when ``Dk > 64``
      (the shifted gate tile is ``[C, Dk]``).

    Chosen, like chapter 9's, from ptxas' report for sm_80 and sm_90 (C = 32, 64; D = 64, 128;
    both operand modes), not by timing: nothing spills in the bf16-operand mode; the float32
    mode keeps a few spills (the record ``benchmarks/2026-12-02-ptxas-gated/``).
    """
    cfg = _delta_rule_launch_config(chunk_size, Dk, Dv)
    if cfg["state"]["num_warps"] < 8:
        return cfg
    cfg["output"] = dict(cfg["output"], BV=min(cfg["output"]["BV"], 32))
    cfg["state"] = dict(cfg["state"], BV=min(cfg["state"]["BV"], 32))
    if gate == 2:
        cfg["wy"] = dict(cfg["wy"], BK=min(cfg["wy"]["BK"], 32))
        cfg["output"] = dict(cfg["output"], BK=min(cfg["output"]["BK"], 32), BV=min(64, tile_size(Dv)))
        if cfg["state"]["BK"] > 64:
            cfg["state"] = dict(cfg["state"], BV=16)
    return cfg


# ---------------------------------------------------------------------------------------------
# KDA's gates inside a chunk, with one reference point per sub-chunk
# ---------------------------------------------------------------------------------------------

@KERNELS.helper
def _channel_gates(b_g, BC: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr):
    """``b_g [C, BK]``: the log decays of a chunk (float32). Returns three ``[C, BK]`` tiles:
    ``G_i = r_a + L_i`` (the cumulative gate from the chunk's start), ``L_i`` (summed from the
    start of ``i``'s sub-chunk ``a`` of ``BS`` tokens) and ``R_i = r_a`` (the sum of the earlier
    sub-chunks' gates, the reference point of ``a``), as :func:`tinyk3.ops.kda.chunked` forms
    them: ``L`` and ``r`` are sums of their own terms only (no differences of large sums)."""
    o_a = tl.arange(0, BC // BS)
    b_g3 = tl.reshape(b_g, [BC // BS, BS, BK])  # [sub-chunk, token, channel]
    b_L = tl.associative_scan(b_g3, 1, tl.standard._sum_combine)  # inside each sub-chunk
    b_tot = tl.reduce(b_g3, 1, tl.standard._sum_combine)  # each sub-chunk's sum    [C / BS, BK]
    b_r = tl.reduce(tl.where(o_a[:, None, None] > o_a[None, :, None], b_tot[None, :, :], 0.0), 1,
                    tl.standard._sum_combine)  # r_a = Σ_{b < a} tot_b
    b_R = tl.reshape(tl.broadcast_to(b_r[:, None, :], [BC // BS, BS, BK]), [BC, BK])
    b_L = tl.reshape(b_L, [BC, BK])
    return b_R + b_L, b_L, b_R


@KERNELS.helper
def _decayed_scores(b_x, b_k, b_Ls, b_R, BC: tl.constexpr, BS: tl.constexpr,
                    PRECISION: tl.constexpr, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """KDA's decayed scores over one block of channels, ``[C, C]`` float32:
    ``Σ_d x_id k_jd exp(G_id − G_jd)`` for ``j`` in the sub-chunks up to ``i``'s own (``b ≤ a``;
    zero for ``b > a``, and the caller masks inside the diagonal blocks). ``b_x, b_k, b_Ls, b_R``
    ``[C, BK]`` (``L`` and ``R`` from :func:`_channel_gates`). One ``tl.dot`` per reference point
    ``r_a``: the rows of sub-chunk ``a`` times ``exp(L_i)`` (in ``[e^{−80}, 1]``), every column
    ``j`` of the sub-chunks ``b ≤ a`` times ``exp(r_a − r_b − L_j)``, the rows of the other
    sub-chunks zeroed. Stages 1 and 3 (``x = k``, ``x = q``) and the backward's ``Ωᵀ dO``."""
    o_i = tl.arange(0, BC)
    o_a = o_i // BS  # sub-chunk of each position
    b_s = tl.full([BC, BC], 0.0, tl.float32)
    for a in tl.static_range(BC // BS):  # one reference point r_a at a time
        b_ra = tl.reduce(tl.where(o_i[:, None] == a * BS, b_R, 0.0), 0, tl.standard._sum_combine)
        b_xr = to_operand(tl.where(o_a[:, None] == a, b_x * tl.exp(b_Ls), 0.0), BF16, EMULATE)
        b_kc = b_k * tl.exp(tl.where(o_a[:, None] <= a, b_ra[None, :] - b_R - b_Ls, float("-inf")))
        b_s += tl.dot(b_xr, tl.trans(to_operand(b_kc, BF16, EMULATE)), input_precision=PRECISION)
    return b_s


# ---------------------------------------------------------------------------------------------
# Stage 1: WY factors of every chunk (parallel over chunks and heads)
# ---------------------------------------------------------------------------------------------

@KERNELS.helper
def _ut_inverse(k, g, b_beta, i_bh, o_t, m_t, T, Dk, BC: tl.constexpr, BK: tl.constexpr,
                BS: tl.constexpr, GATE: tl.constexpr, PRECISION: tl.constexpr,
                BF16: tl.constexpr, EMULATE: tl.constexpr):
    """Stage 1's first half for one chunk: the (decayed) ``K Kᵀ``, ``L = tril(diag(β) K Kᵀ, −1)``
    and ``X = (I + L)⁻¹`` by forward substitution, ``[C, C]`` float32."""
    o_i = tl.arange(0, BC)
    if GATE == 1:  # G_i = Σ_{s ≤ i} g_s inside the chunk (padding: g = 0)                 [C]
        b_G = tl.associative_scan(tl.load(g + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32), 0,
                                  tl.standard._sum_combine)

    # -- K Kᵀ, accumulated over Dk in blocks of BK: (K Kᵀ)_ij = k_i · k_j ---------------------------
    b_L = tl.full([BC, BC], 0.0, tl.float32)  # tl.zeros, spelled with a builtin (runtime docstring)
    for i_k in range(0, (Dk + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk  # columns past Dk load as 0 (padding to a power of two)
        p_k = k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
        b_k = tl.load(p_k, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [C, BK]
        if GATE == 2:  # Σ_d k_id k_jd exp(G_id − G_jd): rows of sub-chunk a against columns b ≤ a
            p_g = g + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
            b_Gc, b_Ls, b_R = _channel_gates(tl.load(p_g, mask=m_t[:, None] & m_k[None, :],
                                                     other=0.0).to(tl.float32), BC, BK, BS)
            b_L += _decayed_scores(b_k, b_k, b_Ls, b_R, BC, BS, PRECISION, BF16, EMULATE)
        else:
            b_k = to_operand(b_k, BF16, EMULATE)
            b_L += tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
    if GATE == 1:  # K Kᵀ ⊙ Γ, Γ_ij = exp(G_i − G_j) ≤ 1 on j < i (masked before the exp)
        b_L = b_L * tl.exp(tl.where(o_i[:, None] > o_i[None, :], b_G[:, None] - b_G[None, :], float("-inf")))

    # -- L = A − I = tril(diag(β) K Kᵀ, −1): scale row i by β_i, keep j < i -------------------------
    b_L = tl.where(o_i[:, None] > o_i[None, :], b_beta[:, None] * b_L, 0.0)

    # -- forward substitution for A⁻¹ = (I + L)⁻¹ = I + N, one row at a time, in registers --------
    # Row i of X = A⁻¹ solves Σ_j A_ij X_j = e_i:  X_i = e_i − Σ_{j<i} L_ij X_j,
    # so N_i = X_i − e_i = −L_i − Σ_{j<i} L_ij N_j. Start from N = −L (row i still holds −L_i
    # until step i overwrites it); rows j < i are final when row i is computed, and the terms
    # with j ≥ i vanish because L_ij = 0 there. Row 0 is already final (N_0 = 0).
    # (tl.reduce(x, 0, tl.standard._sum_combine) is tl.sum(x, 0), spelled with builtins.)
    b_N = -b_L
    for i in range(1, BC):
        b_a = tl.reduce(tl.where(o_i[:, None] == i, b_N, 0.0), 0, tl.standard._sum_combine)  # −L_i [C]
        b_a = b_a + tl.reduce(b_a[:, None] * b_N, 0, tl.standard._sum_combine)  # −L_i − Σ_j L_ij N_j
        b_N = tl.where(o_i[:, None] == i, b_a[None, :], b_N)  # write row i back
    return b_N + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)  # X = (I + L)⁻¹ = I + N


@_kernel
def _wy_kernel(
    k, v, beta, g,  # inputs: k [BH, T, Dk], v [BH, T, Dv], beta [BH, T], g [BH, T] or [BH, T, Dk]
    w, u,  # outputs: W [BH, T, Dk], U [BH, T, Dv] (float32, or bfloat16 in the bf16 mode)
    x,  # X = (I + L)⁻¹ [BH, T, C] (float32): written if STORE_X, read if LOAD_X (chapter 21)
    T, Dk, Dv,
    BC: tl.constexpr,  # chunk size C (16, 32, 64)
    BK: tl.constexpr,  # block of Dk columns loaded at a time
    BV: tl.constexpr,  # block of Dv columns loaded at a time
    BS: tl.constexpr,  # KDA's sub-chunk (16 tokens, one reference point each)
    GATE: tl.constexpr,  # 1: one gate per head (Gated DeltaNet), 2: one per key channel (KDA)
    PRECISION: tl.constexpr,  # tl.dot input_precision of float32 operands: "ieee", "tf32", "tf32x3"
    BF16: tl.constexpr,  # bfloat16 operands, float32 accumulation (fla's mode)
    EMULATE: tl.constexpr,  # interpreter: bfloat16 emulated by rounding float32 (runtime.to_operand)
    STORE_X: tl.constexpr = False,  # also write X (kept for the backward, chapter 21)
    LOAD_X: tl.constexpr = False,  # read X instead of solving (the backward's recomputation)
):
    # -- which chunk: program (i_c, i_bh) owns tokens i_c·C … i_c·C + C − 1 of head i_bh ----------
    i_c = tl.program_id(0)
    i_bh = tl.cast(tl.program_id(1), tl.int64)  # int64: BH·T·D can pass 2³¹
    o_i = tl.arange(0, BC)  # position inside the chunk (row index i, column index j)
    o_t = i_c * BC + o_i  # token index t
    m_t = o_t < T  # the last chunk may be partial: rows with t ≥ T are padding
    b_beta = tl.load(beta + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32)  # β   [C]
    if GATE == 1:  # G_i = Σ_{s ≤ i} g_s inside the chunk (padding: g = 0)                 [C]
        b_G = tl.associative_scan(tl.load(g + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32), 0,
                                  tl.standard._sum_combine)

    if LOAD_X:  # the backward (chapter 21): X kept by the forward, no K Kᵀ and no solve
        b_X = tl.load(x + i_bh * T * BC + o_t[:, None] * BC + o_i[None, :], mask=m_t[:, None],
                      other=0.0)
    else:
        b_X = _ut_inverse(k, g, b_beta, i_bh, o_t, m_t, T, Dk, BC, BK, BS, GATE, PRECISION, BF16,
                          EMULATE)
        if STORE_X:
            tl.store(x + i_bh * T * BC + o_t[:, None] * BC + o_i[None, :], b_X, mask=m_t[:, None])
    # 𝒯 = X diag(β): scale column j by β_j (float32; rounded once for the products below)
    b_UT = b_X * b_beta[None, :]  # [C, C]
    b_UT = to_operand(b_UT, BF16, EMULATE)

    # -- W = 𝒯 (K ⊙ γ)  (block by block over Dk; K is reloaded rather than kept in registers) -----
    for i_k in range(0, (Dk + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk
        m_tk = m_t[:, None] & m_k[None, :]
        p_k = k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
        b_k = tl.load(p_k, mask=m_tk, other=0.0).to(tl.float32)
        if GATE == 1:
            b_k = b_k * tl.exp(b_G)[:, None]  # diag(γ) K
        if GATE == 2:
            p_g = g + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
            b_Gc, b_Ls, b_R = _channel_gates(tl.load(p_g, mask=m_tk, other=0.0).to(tl.float32),
                                             BC, BK, BS)
            b_k = b_k * tl.exp(b_Gc)  # K ⊙ Γ, row i times γ_i channel by channel
        b_k = to_operand(b_k, BF16, EMULATE)
        b_w = tl.dot(b_UT, b_k, input_precision=PRECISION)  # [C, BK], float32 accumulator
        tl.store(w + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :],
                 to_operand(b_w, BF16, EMULATE).to(w.dtype.element_ty), mask=m_tk)

    # -- U = 𝒯 V  (block by block over Dv) ----------------------------------------------------------
    for i_v in range(0, (Dv + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < Dv)
        p_v = v + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :]
        b_v = to_operand(tl.load(p_v, mask=m_tv, other=0.0).to(tl.float32), BF16, EMULATE)
        b_u = tl.dot(b_UT, b_v, input_precision=PRECISION)  # [C, BV]
        tl.store(u + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :],
                 to_operand(b_u, BF16, EMULATE).to(u.dtype.element_ty), mask=m_tv)


# ---------------------------------------------------------------------------------------------
# Stage 2: the sequential state pass (one program per Dv block and head, a loop over chunks)
# ---------------------------------------------------------------------------------------------

@_kernel
def _state_kernel(
    k, g, w, u, s0,  # k [BH, T, Dk]; g [BH, T] or [BH, T, Dk]; W, U; S_0 [BH, Dk, Dv] (float32)
    states, u_new, s_out,  # S_[c] [BH, NT, Dk, Dv]; U' [BH, T, Dv]; S (float32)
    T, Dk, Dv, NT,
    BC: tl.constexpr,  # chunk size C
    BK: tl.constexpr,  # all of Dk, padded to a power of two (the state's rows stay in registers)
    BV: tl.constexpr,  # this program's block of the state's Dv columns
    GATE: tl.constexpr,  # 1: one gate per head, 2: one per key channel (row of S)
    HAS_S0: tl.constexpr,  # initial state given (else S_0 = 0)
    PRECISION: tl.constexpr,
    BF16: tl.constexpr,
    EMULATE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.cast(tl.program_id(1), tl.int64)
    o_i = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < Dk
    m_v = o_v < Dv
    m_kv = m_k[:, None] & m_v[None, :]

    # -- S_0: this program's columns of the state, [Dk, BV], float32 in registers -----------------
    b_S = tl.full([BK, BV], 0.0, tl.float32)
    if HAS_S0:
        p_s0 = s0 + i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        b_S += tl.load(p_s0, mask=m_kv, other=0.0).to(tl.float32)

    for i_c in range(0, NT):  # the one sequential loop: chunk c needs S_[c] from chunk c − 1
        o_t = i_c * BC + o_i
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        m_n = (o_i + 1 < BC) & (o_t + 1 < T)  # token i + 1 is in this chunk (shifted gate loads)
        b_Sop = to_operand(b_S, BF16, EMULATE)  # S_[c] as an operand (bfloat16 in the bf16 mode)

        # keep S_[c], the state chunk c starts from, for the output pass
        p_h = states + (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        tl.store(p_h, b_Sop.to(states.dtype.element_ty), mask=m_kv)

        # -- U'_[c] = U_[c] − W_[c] S_[c]: what each token still has to write, given the state ----
        b_w = tl.load(w + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk, other=0.0)
        b_u = tl.load(u + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
        b_w = to_operand(b_w.to(tl.float32), BF16, EMULATE)
        b_du = b_u.to(tl.float32) - tl.dot(b_w, b_Sop, input_precision=PRECISION)  # [C, BV]
        b_du = to_operand(b_du, BF16, EMULATE)  # stored, and the operand of K_[c]ᵀ U'_[c]
        b_k = tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)  # [C, BK]
        p_du = u_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :]
        tl.store(p_du, b_du.to(u_new.dtype.element_ty), mask=m_tv)

        # -- the decays: keys to the chunk's end, exp(G_C − G_i) = exp(Σ_{s > i} g_s) (a reverse
        # scan of the gates one token later), and the state by γ_C = exp(Σ_s g_s) -------------------
        if GATE == 1:
            b_gn = tl.load(g + i_bh * T + o_t + 1, mask=m_n, other=0.0).to(tl.float32)  # g_{i+1} [C]
            b_k = b_k * tl.exp(tl.associative_scan(b_gn, 0, tl.standard._sum_combine, reverse=True))[:, None]
            b_g = tl.load(g + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32)
            b_S = b_S * tl.exp(tl.reduce(b_g, 0, tl.standard._sum_combine))  # γ_C S_[c]
        if GATE == 2:
            p_gn = g + i_bh * T * Dk + (o_t + 1)[:, None] * Dk + o_k[None, :]
            b_gn = tl.load(p_gn, mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [C, BK]
            b_k = b_k * tl.exp(tl.associative_scan(b_gn, 0, tl.standard._sum_combine, reverse=True))
            b_g0 = tl.load(g + i_bh * T * Dk + (i_c * BC) * Dk + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_g = b_g0 + tl.reduce(b_gn, 0, tl.standard._sum_combine)  # Σ_s g_s = g_0 + Σ_{s>0} g_s
            b_S = b_S * tl.exp(b_g)[:, None]  # Diag(γ_C) S_[c]
        b_k = to_operand(b_k, BF16, EMULATE)

        # -- S_[c+1] = Diag(γ_C) S_[c] + (K ⊙ γ_C / γ)ᵀ U'_[c] (padded rows: k = 0, U' = 0) --------
        b_S += tl.dot(tl.trans(b_k), b_du, input_precision=PRECISION)  # [Dk, BV], float32

    # -- the final state, float32 ------------------------------------------------------------------
    tl.store(s_out + i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :], b_S, mask=m_kv)


# ---------------------------------------------------------------------------------------------
# Stage 3: the output pass (parallel over Dv blocks, chunks and heads)
# ---------------------------------------------------------------------------------------------

@_kernel
def _output_kernel(
    q, k, g, states, u_new,  # q, k [BH, T, Dk]; g; S_[c] [BH, NT, Dk, Dv]; U' [BH, T, Dv]
    o,  # output O [BH, T, Dv], the inputs' dtype
    T, Dk, Dv, NT,
    BC: tl.constexpr,
    BK: tl.constexpr,  # block of Dk columns per step of the reduction
    BV: tl.constexpr,
    BS: tl.constexpr,
    GATE: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16: tl.constexpr,
    EMULATE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.cast(tl.program_id(2), tl.int64)
    o_i = tl.arange(0, BC)
    o_t = i_c * BC + o_i
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < Dv
    m_tv = m_t[:, None] & m_v[None, :]
    if GATE == 1:
        b_G = tl.associative_scan(tl.load(g + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32), 0,
                                  tl.standard._sum_combine)

    # -- Q_[c] S_[c] and Q_[c] K_[c]ᵀ, both reductions over Dk, accumulated block by block ---------
    b_o = tl.full([BC, BV], 0.0, tl.float32)
    b_sc = tl.full([BC, BC], 0.0, tl.float32)
    for i_k in range(0, (Dk + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk, other=0.0)
        p_h = states + (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)  # S_[c] rows   [BK, BV]
        b_q = b_q.to(tl.float32)  # [C, BK]
        b_k = b_k.to(tl.float32)  # [C, BK]
        b_h = to_operand(b_h.to(tl.float32), BF16, EMULATE)
        if GATE == 2:  # Ω_ij = Σ_d q_id k_jd exp(G_id − G_jd), sub-chunk by sub-chunk as in stage 1
            p_g = g + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
            b_Gc, b_Ls, b_R = _channel_gates(tl.load(p_g, mask=m_tk, other=0.0).to(tl.float32),
                                             BC, BK, BS)
            b_sc += _decayed_scores(b_q, b_k, b_Ls, b_R, BC, BS, PRECISION, BF16, EMULATE)
            b_q = to_operand(b_q * tl.exp(b_Gc), BF16, EMULATE)  # Q ⊙ Γ for the inter-chunk term
        else:
            b_q = to_operand(b_q, BF16, EMULATE)
            b_sc += tl.dot(b_q, tl.trans(to_operand(b_k, BF16, EMULATE)), input_precision=PRECISION)
        b_o += tl.dot(b_q, b_h, input_precision=PRECISION)  # Q_[c] S_[c] (inter-chunk)
    if GATE == 1:  # diag(γ) Q S_[c] and Q Kᵀ ⊙ Γ (j ≤ i, the exponent masked before the exp)
        b_o = b_o * tl.exp(b_G)[:, None]
        b_sc = b_sc * tl.exp(tl.where(o_i[:, None] >= o_i[None, :], b_G[:, None] - b_G[None, :],
                                      float("-inf")))

    # -- O_[c] = (Q ⊙ γ) S_[c] + Ω_[c] U'_[c],  Ω_[c] = Q_[c] K_[c]ᵀ ⊙ Γ (j ≤ i) ---------------------
    b_sc = tl.where(o_i[:, None] >= o_i[None, :], b_sc, 0.0)  # causal mask M: j ≤ i
    b_sc = to_operand(b_sc, BF16, EMULATE)  # Ω_[c]
    b_du = tl.load(u_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
    b_du = to_operand(b_du.to(tl.float32), BF16, EMULATE)
    b_o += tl.dot(b_sc, b_du, input_precision=PRECISION)  # intra-chunk
    tl.store(o + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_tv)


# ---------------------------------------------------------------------------------------------
# Host side: checks, launches
# ---------------------------------------------------------------------------------------------

def check_sub_chunk_gates(g: torch.Tensor, op: str) -> None:
    """KDA's limit: the gates of every 16-token sub-chunk (aligned to multiples of 16 in ``T``)
    must sum to at least ``−EXP_LIMIT`` (−80), else the factorised sub-chunk scores overflow
    float32. Always true for gates ``≥ −5`` (checked first, one reduction); otherwise the sums are
    formed (float32) and a ``ValueError`` names the op that handles any gate."""
    g = g.detach()
    if g.numel() == 0 or float(g.min()) >= LOWER_BOUND:
        return
    B, H, T, Dk = g.shape
    pad = (-T) % SUB_CHUNK
    gp = torch.nn.functional.pad(g.float(), (0, 0, 0, pad))  # padded tokens: g = 0
    worst = float(gp.view(B, H, -1, SUB_CHUNK, Dk).sum(3).amin())
    if worst < -EXP_LIMIT:
        raise ValueError(
            f"{op}: the gates of a {SUB_CHUNK}-token sub-chunk sum to {worst:.4g} < -{EXP_LIMIT:g} "
            f"(possible only for gates below {LOWER_BOUND:g} per step): the kernel's factorised "
            "sub-chunk scores would overflow float32. Use tinyk3.ops.kda.chunked, which computes "
            "those blocks pair by pair, or bound the gate (tinyk3.gates.lower_bound_gate)")


def _validate(q, k, v, beta, g, chunk_size, initial_state, input_precision, operands, gate, op):
    """Check the inputs; return ``(input_precision, operands)`` with the defaults filled in."""
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    runtime.check_device(q, op)  # before check_gate, which reads g's values
    check_beta(beta, B, H, T, q, op)
    check_gate(g, B, H, T, Dk if gate == 2 else None, q, op)
    if initial_state is not None:
        check_state(initial_state, (B, H, Dk, Dv), q, op, "initial_state")
    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{op}: the Triton kernel takes float16, bfloat16 or float32 inputs "
                        f"(it accumulates in float32), got {q.dtype}; use "
                        f"tinyk3.ops.{_NAMES[gate]}.chunked for float64")
    runtime.check_choice(op, "chunk_size", chunk_size, CHUNK_SIZES,
                         " (tl.dot tiles are at least 16 and a power of two)")
    if Dk > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM or Dk < 1 or Dv < 1:
        raise ValueError(f"{op}: head dimensions must be 1..{MAX_HEAD_DIM} (the state block lives in "
                         f"registers), got Dk={Dk}, Dv={Dv}")
    if operands is None:
        operands = "bfloat16" if q.dtype == torch.bfloat16 else "float32"
    runtime.check_choice(op, "operands", operands, OPERANDS + (None,))
    if input_precision is None:
        input_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    runtime.check_choice(op, "input_precision", input_precision, INPUT_PRECISIONS + (None,))
    runtime.check_grid(op, B * H, -(-T // chunk_size))
    if gate == 2:
        check_sub_chunk_gates(g, op)
    return input_precision, operands


def _forward(q, k, v, beta, g, initial_state, chunk_size, input_precision, operands, gate,
             return_stages=False, config=None, keep_x=False):
    """Launch the stages. Inputs already validated. Returns ``(o, S)`` or a dict of all stages.
    ``config`` overrides :func:`launch_config` (for tuning on a GPU)."""
    B, H, T, Dk, Dv = q.shape[0], q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    out_dtype, dev = v.dtype, q.device
    f32 = torch.float32
    S = torch.zeros(B, H, Dk, Dv, dtype=f32, device=dev)  # a contiguous float32 copy of S_0
    if initial_state is not None:
        S.copy_(initial_state.detach())
    if T == 0 or B * H == 0:  # nothing to launch: the state passes through
        o = v.new_zeros(B, H, T, Dv)
        if return_stages:
            return {"o": o, "S": S}
        return o, S
    interpret = runtime.interpreting(dev)
    kern = _kernels(interpret)
    bf16 = operands == "bfloat16"
    if interpret:  # no bfloat16 in the interpreter: float32 tensors, bfloat16 emulated in-kernel
        q, k, v, beta, g = (t.to(f32) for t in (q, k, v, beta, g))
    mid = torch.bfloat16 if bf16 and not interpret else f32  # dtype of W, U, S_[c], U'
    q, k, v, beta, g = (t.contiguous() for t in (q, k, v, beta, g))
    C, NT, BH = chunk_size, triton.cdiv(T, chunk_size), B * H
    cfg = config or launch_config(C, Dk, Dv, gate)
    c1, c2, c3 = cfg["wy"], cfg["state"], cfg["output"]
    mode = dict(BC=C, GATE=gate, PRECISION=input_precision, BF16=bf16, EMULATE=interpret)

    # stage 1: W, U for every chunk of every head (grid: chunks × heads)
    w = torch.empty(B, H, T, Dk, dtype=mid, device=dev)
    u = torch.empty(B, H, T, Dv, dtype=mid, device=dev)
    x = torch.empty(B, H, T, C, dtype=f32, device=dev) if keep_x else w  # X, for the backward
    kern._wy_kernel[(NT, BH)](k, v, beta, g, w, u, x, T, Dk, Dv, BS=SUB_CHUNK, STORE_X=keep_x,
                              **mode, **c1)

    # stage 2: the state pass (grid: Dv blocks × heads), from S_0 to S_T
    states = torch.empty(B, H, NT, Dk, Dv, dtype=mid, device=dev)
    u_new = torch.empty(B, H, T, Dv, dtype=mid, device=dev)
    s_final = torch.empty_like(S)
    kern._state_kernel[(triton.cdiv(Dv, c2["BV"]), BH)](
        k, g, w, u, S, states, u_new, s_final, T, Dk, Dv, NT,
        HAS_S0=initial_state is not None, **mode, **c2)

    # stage 3: the output pass (grid: Dv blocks × chunks × heads)
    o = torch.empty(B, H, T, Dv, dtype=f32 if interpret else out_dtype, device=dev)
    kern._output_kernel[(triton.cdiv(Dv, c3["BV"]), NT, BH)](
        q, k, g, states, u_new, o, T, Dk, Dv, NT, BS=SUB_CHUNK, **mode, **c3)
    o = o.to(out_dtype)
    if return_stages:
        stages = {"w": w, "u": u, "states": states, "u_new": u_new, "o": o, "S": s_final}
        if keep_x:
            stages["x"] = x
        return stages
    return o, s_final


class _ChunkedFunction(torch.autograd.Function):
    """Forward: the Triton stages, keeping the inputs, the chunk-boundary states ``S_[c]`` and
    the inverses ``X`` (as fla keeps its ``A``). Backward: the backward kernels
    (:func:`tinyk3.kernels.backward.backward`, chapter 21), which recompute ``W`` and ``U`` from
    ``X`` and ``U'`` from the kept states."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, initial_state, chunk_size, input_precision, operands, gate):
        stages = _forward(q, k, v, beta, g, initial_state, chunk_size, input_precision, operands,
                          gate, return_stages=True, keep_x=True)
        ctx.save_for_backward(q, k, v, beta, g, initial_state, stages.get("states"), stages.get("x"))
        ctx.mode = (chunk_size, input_precision, operands, gate)
        return stages["o"], stages["S"]

    @staticmethod
    def backward(ctx, do, dS):
        from . import backward as _backward  # (imports this module)

        q, k, v, beta, g, initial_state, states, x = ctx.saved_tensors
        C, precision, operands, gate = ctx.mode
        grads = _backward.backward(q, k, v, beta, g, do, dS, gate=gate, chunk_size=C,
                                   initial_state=initial_state, states=states, x=x,
                                   input_precision=precision, operands=operands)
        like = (q, k, v, beta, g, initial_state)
        return (*(d.to(t.dtype) if n and t is not None else None
                  for d, t, n in zip(grads, like, ctx.needs_input_grad)), None, None, None, None)


def chunked(q, k, v, beta, g, *, gate, chunk_size=64, initial_state=None, input_precision=None,
            operands=None, op=None):
    """The public ``chunked`` of both rules (``gate`` 1 or 2): validate, then launch under
    :class:`_ChunkedFunction`. See :func:`tinyk3.kernels.gated_delta_rule.chunked`."""
    op = op or f"kernels.{_NAMES[gate]}.chunked"
    require_triton(f"tinyk3.{op}")
    precision, operands = _validate(q, k, v, beta, g, chunk_size, initial_state, input_precision,
                                    operands, gate, op)
    return _ChunkedFunction.apply(q, k, v, beta, g, initial_state, chunk_size, precision, operands,
                                  gate)


def forward_stages(q, k, v, beta, g, *, gate, chunk_size=64, initial_state=None,
                   input_precision=None, operands=None, config=None) -> dict[str, torch.Tensor]:
    """Run the forward stages and return what each one wrote: ``w``, ``u``, ``x`` (stage 1),
    ``states`` ([B, H, T/C, Dk, Dv]) and ``u_new`` (stage 2), ``o`` and the final ``S``. No
    autograd. ``config`` replaces :func:`launch_config`'s tiles and launch options."""
    op = f"kernels.{_NAMES[gate]}.forward_stages"
    require_triton(f"tinyk3.{op}")
    precision, operands = _validate(q, k, v, beta, g, chunk_size, initial_state, input_precision,
                                    operands, gate, op)
    with torch.no_grad():
        return _forward(q, k, v, beta, g, initial_state, chunk_size, precision, operands, gate,
                        return_stages=True, config=config, keep_x=True)


def compile_for_gpu(gate: int, arch: int = 90, *, chunk_size: int = 64, Dk: int = 128,
                    Dv: int = 128, dtype: torch.dtype = torch.bfloat16, has_initial_state: bool = True,
                    input_precision: str = "ieee", operands: str = "float32",
                    config: dict | None = None) -> dict:
    """Compile the three gated stages for ``GPUTarget("cuda", arch, 32)`` without a GPU, as
    :func:`tinyk3.kernels.delta_rule.compile_for_gpu` does for chapter 9's (same arguments, plus
    ``gate``; no ``fuse_output``). Returns ``{name: compiled}``; registers and spills:
    :func:`tinyk3.kernels.runtime.ptxas_report` of ``compiled.asm["ptx"]``."""
    require_triton("tinyk3.kernels.gated.compile_for_gpu")
    if (gate not in (1, 2) or dtype not in _KERNEL_DTYPES or chunk_size not in CHUNK_SIZES
            or input_precision not in INPUT_PRECISIONS or operands not in OPERANDS):
        raise ValueError("compile_for_gpu: unsupported gate, dtype, chunk_size, input_precision or "
                         "operands")
    kern = _kernels(False)
    cfg = config or launch_config(chunk_size, Dk, Dv, gate)
    bf16 = operands == "bfloat16"
    x = runtime.pointer_type(dtype)
    m = runtime.pointer_type(torch.bfloat16 if bf16 else torch.float32)
    f32 = "*fp32"
    mode = {"BC": chunk_size, "GATE": gate, "PRECISION": input_precision, "BF16": bf16,
            "EMULATE": False}
    specs = {
        "_wy_kernel": (dict(k=x, v=x, beta=x, g=x, w=m, u=m, x=m, T="i32", Dk="i32", Dv="i32"),
                       dict(mode, BS=SUB_CHUNK, STORE_X=False, LOAD_X=False), cfg["wy"]),
        "_state_kernel": (dict(k=x, g=x, w=m, u=m, s0=f32, states=m, u_new=m, s_out=f32,
                               T="i32", Dk="i32", Dv="i32", NT="i32"),
                          dict(mode, HAS_S0=has_initial_state), cfg["state"]),
        "_output_kernel": (dict(q=x, k=x, g=x, states=m, u_new=m, o=x, T="i32", Dk="i32",
                                Dv="i32", NT="i32"), dict(mode, BS=SUB_CHUNK), cfg["output"]),
    }
    out = {}
    for name, (sig, constexprs, launch) in specs.items():
        constexprs = {**constexprs, "BK": launch["BK"], "BV": launch["BV"]}
        out[name] = runtime.compile_kernel(getattr(kern, name), sig, constexprs, arch=arch,
                                           num_warps=launch["num_warps"],
                                           num_stages=launch["num_stages"])
    return out

"""Chunkwise DeltaNet as Triton kernels (chapter 9). Same contract as
:func:`tinyk3.ops.delta_rule.chunked`::

    chunked(q, k, v, beta, *, chunk_size=64, initial_state=None) -> (o, S)
    q, k: [B, H, T, Dk]   v: [B, H, T, Dv]   beta: [B, H, T]   S: [B, H, Dk, Dv] (float32)
    o_t = q_t S_t  (row layout; no scaling of q or k inside)

The chapter-8 equations, per chunk ``c`` of ``C`` tokens (rows are tokens, ``M``: j ≤ i)::

    A_[c]    = I + tril(diag(β) K_[c] K_[c]ᵀ, −1)          (unit lower triangular)
    𝒯_[c]    = A_[c]⁻¹ diag(β)                              (the UT matrix)
    W_[c]    = 𝒯_[c] K_[c],   U_[c] = 𝒯_[c] V_[c]            (WY factors)
    U'_[c]   = U_[c] − W_[c] S_[c]                          (deltas given the state so far)
    O_[c]    = Q_[c] S_[c] + (Q_[c] K_[c]ᵀ ⊙ M) U'_[c]
    S_[c+1]  = S_[c] + K_[c]ᵀ U'_[c]

How the work is split (the split of flash-linear-attention's ``chunk_delta_rule``, read in fla
0.6.0 from PyPI: ``fla/ops/delta_rule/chunk.py``, ``wy_fast.py``, ``fla/ops/common/
chunk_delta_h.py``, ``chunk_o.py``, ``chunk_scaled_dot_kkt.py``, ``fla/ops/utils/solve_tril.py``;
fla's ``A`` after ``solve_tril`` is our 𝒯 without the ``diag(β)``, its ``v_new`` our U', its ``h``
the chunk states S_[c]):

1. :func:`_wy_kernel`, one program per (chunk, B·H), all in parallel: ``K Kᵀ``, the triangular
   solve for 𝒯 (forward substitution in float32 registers), ``W`` and ``U``. Nothing here
   depends on the state, so every chunk of every head is independent.
   (fla: ``chunk_scaled_dot_kkt_fwd`` + ``solve_tril`` + ``recompute_w_u_fwd``. fla's solve
   inverts 16 × 16 diagonal blocks and merges them with matrix products, as
   :func:`tinyk3.ops.wy.block_inverse` does; row-by-row substitution over the whole chunk is
   simpler, C steps of O(C²) vector work.)
2. :func:`_state_kernel`, one program per (block of Dv columns, B·H): the only sequential
   part, a loop over the chunks carrying ``S`` in float32 registers. It stores the state each
   chunk *starts* from and the deltas ``U'``. The ``Dv`` columns of ``S`` evolve independently,
   so a head's state can be split over several programs. (fla: ``chunk_gated_delta_rule_fwd_h``.)
3. :func:`_output_kernel`, one program per (Dv block, chunk, B·H), all in parallel again:
   ``O_[c]`` from the stored ``S_[c]`` and ``U'_[c]``. (fla: ``chunk_fwd_o``.)

Why a separate output pass (the default, as in fla): the sequential pass then does only the
two ``C × Dk × Dv`` products per chunk it cannot avoid (``W_[c] S_[c]`` and ``K_[c]ᵀ U'_[c]``),
while the output runs on a grid ``T / C`` times larger. The price is memory traffic: every
chunk's starting state and ``U'`` go through global memory. ``fuse_output=True`` computes
``O_[c]`` inside the state pass instead: nothing stored, but that work then runs sequentially on
only ``B·H·Dv/BV`` programs. Both are checked equal to the PyTorch form.

Two operand modes (``operands=``):

* ``"float32"``: every tile is converted to float32 and every ``tl.dot`` takes float32 operands,
  with ``input_precision`` ``"ieee"`` (true float32, matches the PyTorch form to float32 round-off;
  no tensor cores), ``"tf32"`` (tensor cores, operands rounded to a 10-bit mantissa, errors ≈1e-3
  relative) or ``"tf32x3"`` (most of float32's precision at three times tf32's cost). ``W``, ``U``,
  the chunk states and ``U'`` are stored in float32. Default precision: ``"ieee"`` for float32
  inputs, ``"tf32"`` for float16 ones.
* ``"bfloat16"``, fla's design: bfloat16 operands into every ``tl.dot`` with float32
  accumulation; the triangular solve, the state carried in registers and every accumulator
  stay float32; ``W``, ``U``, the chunk states and ``U'`` are stored in bfloat16 (half the bytes).
  Rounded to bfloat16, as in fla: 𝒯 before ``𝒯 K`` and ``𝒯 V`` (fla rounds its inverse and
  ``diag(β) K``), the state before ``W S`` and before it is stored, ``U'`` before ``K ᵀ U'``, and
  the masked scores before ``(Q Kᵀ ⊙ M) U'``. ``input_precision`` does not apply.

Default (``operands=None``): ``"bfloat16"`` for bfloat16 inputs, ``"float32"`` for float32 and
float16 inputs. In both modes ``o`` is written in the inputs' dtype and the final ``S`` is
float32 (as in the PyTorch form). 𝒯 is not kept: the backward pass
(:class:`_ChunkedFunction`) recomputes everything with the PyTorch form under autograd.

Under the Triton interpreter (CPU tensors) the inputs are cast to float32 on the host and the
intermediates are float32 tensors: the interpreter's bfloat16 casts are silently wrong and numpy
has no bfloat16 (:mod:`tinyk3.kernels.runtime`). The bfloat16 mode is then emulated exactly:
:func:`tinyk3.kernels.runtime.to_operand` rounds each value to the nearest bfloat16 at the points
listed above and the products run in float32, which for bfloat16 values is what the tensor cores
compute up to the order of accumulation. ``input_precision`` is ignored there (its float32
products are exact IEEE).

Where it runs, and why the kernels call only Triton builtins: :mod:`tinyk3.kernels.runtime`.

Limits: ``chunk_size`` 16, 32 or 64 (``tl.dot`` needs tiles of at least 16); ``Dk, Dv ≤ 128``
(any size: tiles are padded to a power of two ≥ 16 by masked loads, and zero columns change
nothing); float16, bfloat16, float32 inputs. Any ``T``: the last chunk is masked (padded tokens
load ``k = 0, β = 0`` and are never stored; the interpreter does not check out-of-bounds
addresses, so every load and store below carries a mask).
"""

from __future__ import annotations

import torch

from .._validate import check_beta, check_qkv, check_state
from . import runtime
from .runtime import AVAILABLE, KernelSet, require_triton, tile_size, to_operand  # noqa: F401

if AVAILABLE:
    import triton
    import triton.language as tl
else:  # the kernels below are plain functions until jitted; nothing here touches triton
    triton = tl = None

__all__ = ["chunked", "forward_stages", "compile_for_gpu", "launch_config", "interpreter_only",
           "cannot_compile_reason", "CHUNK_SIZES", "MAX_HEAD_DIM", "INPUT_PRECISIONS", "OPERANDS",
           "KERNELS"]

CHUNK_SIZES = (16, 32, 64)
MAX_HEAD_DIM = 128
INPUT_PRECISIONS = ("ieee", "tf32", "tf32x3")
OPERANDS = ("float32", "bfloat16")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The kernels are plain functions, jitted on first use (once compiled, once interpreted).
KERNELS = KernelSet("tinyk3.kernels.delta_rule")
_kernel = KERNELS.kernel
interpreter_only = runtime.interpreter_only
cannot_compile_reason = runtime.cannot_compile_reason


def _kernels(interpret: bool):
    return KERNELS.get(interpret)


# ---------------------------------------------------------------------------------------------
# Stage 1: WY factors of every chunk (parallel over chunks and heads)
# ---------------------------------------------------------------------------------------------

@_kernel
def _wy_kernel(
    k, v, beta,  # inputs: k [BH, T, Dk], v [BH, T, Dv], beta [BH, T] (contiguous)
    w, u,  # outputs: W [BH, T, Dk], U [BH, T, Dv] (float32, or bfloat16 in the bf16 mode)
    T, Dk, Dv,
    BC: tl.constexpr,  # chunk size C (16, 32, 64)
    BK: tl.constexpr,  # block of Dk columns loaded at a time
    BV: tl.constexpr,  # block of Dv columns loaded at a time
    PRECISION: tl.constexpr,  # tl.dot input_precision of float32 operands: "ieee", "tf32", "tf32x3"
    BF16: tl.constexpr,  # bfloat16 operands, float32 accumulation (fla's mode)
    EMULATE: tl.constexpr,  # interpreter: bfloat16 emulated by rounding float32 (runtime.to_operand)
):
    # -- which chunk: program (i_c, i_bh) owns tokens i_c·C … i_c·C + C − 1 of head i_bh ----------
    i_c = tl.program_id(0)
    i_bh = tl.cast(tl.program_id(1), tl.int64)  # int64: BH·T·D can pass 2³¹
    o_i = tl.arange(0, BC)  # position inside the chunk (row index i, column index j)
    o_t = i_c * BC + o_i  # token index t
    m_t = o_t < T  # the last chunk may be partial: rows with t ≥ T are padding
    b_beta = tl.load(beta + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32)  # β   [C]

    # -- K Kᵀ, accumulated over Dk in blocks of BK: (K Kᵀ)_ij = k_i · k_j ---------------------------
    b_L = tl.full([BC, BC], 0.0, tl.float32)  # tl.zeros, spelled with a builtin (runtime docstring)
    for i_k in range(0, (Dk + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk  # columns past Dk load as 0 (padding to a power of two)
        p_k = k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
        b_k = to_operand(tl.load(p_k, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32),
                         BF16, EMULATE)  # [C, BK]
        b_L += tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)

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
    # 𝒯 = (I + N) diag(β): scale column j by β_j (float32; rounded once for the products below)
    b_UT = (b_N + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)) * b_beta[None, :]  # [C, C]
    b_UT = to_operand(b_UT, BF16, EMULATE)

    # -- W = 𝒯 K  (block by block over Dk; K is reloaded rather than kept in registers) -----------
    for i_k in range(0, (Dk + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk
        m_tk = m_t[:, None] & m_k[None, :]
        p_k = k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
        b_k = to_operand(tl.load(p_k, mask=m_tk, other=0.0).to(tl.float32), BF16, EMULATE)
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
    q, k, w, u, s0,  # q, k [BH, T, Dk]; W [BH, T, Dk], U [BH, T, Dv]; S_0 [BH, Dk, Dv] (float32)
    o, states, u_new, s_out,  # O [BH, T, Dv]; S_[c] [BH, NT, Dk, Dv]; U' [BH, T, Dv]; S (float32)
    T, Dk, Dv, NT,
    BC: tl.constexpr,  # chunk size C
    BK: tl.constexpr,  # all of Dk, padded to a power of two (the state's rows stay in registers)
    BV: tl.constexpr,  # this program's block of the state's Dv columns
    HAS_S0: tl.constexpr,  # initial state given (else S_0 = 0)
    FUSE_OUTPUT: tl.constexpr,  # compute O here (no stored states) instead of in stage 3
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
        b_Sop = to_operand(b_S, BF16, EMULATE)  # S_[c] as an operand (bfloat16 in the bf16 mode)

        if not FUSE_OUTPUT:  # keep S_[c], the state chunk c starts from, for the output pass
            p_h = states + (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
            tl.store(p_h, b_Sop.to(states.dtype.element_ty), mask=m_kv)

        # -- U'_[c] = U_[c] − W_[c] S_[c]: what each token still has to write, given the state ----
        b_w = tl.load(w + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk, other=0.0)
        b_u = tl.load(u + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
        b_w = to_operand(b_w.to(tl.float32), BF16, EMULATE)
        b_du = b_u.to(tl.float32) - tl.dot(b_w, b_Sop, input_precision=PRECISION)  # [C, BV]
        b_du = to_operand(b_du, BF16, EMULATE)  # stored, and the operand of K_[c]ᵀ U'_[c]
        b_k = to_operand(tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                                 other=0.0).to(tl.float32), BF16, EMULATE)  # [C, BK]

        if FUSE_OUTPUT:
            # -- O_[c] = Q_[c] S_[c] + (Q_[c] K_[c]ᵀ ⊙ M) U'_[c], right here (as in stage 3) -------
            b_q = to_operand(tl.load(q + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :],
                                     mask=m_tk, other=0.0).to(tl.float32), BF16, EMULATE)
            b_sc = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # Q_[c] K_[c]ᵀ  [C, C]
            b_sc = to_operand(tl.where(o_i[:, None] >= o_i[None, :], b_sc, 0.0), BF16, EMULATE)
            b_o = tl.dot(b_q, b_Sop, input_precision=PRECISION)  # Q_[c] S_[c]         [C, BV]
            b_o += tl.dot(b_sc, b_du, input_precision=PRECISION)  # + Ω_[c] U'_[c]
            p_o = o + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :]
            tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_tv)
        else:
            p_du = u_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :]
            tl.store(p_du, b_du.to(u_new.dtype.element_ty), mask=m_tv)

        # -- S_[c+1] = S_[c] + K_[c]ᵀ U'_[c] (padded rows have k = 0 and U' = 0: no change) -------
        b_S += tl.dot(tl.trans(b_k), b_du, input_precision=PRECISION)  # [Dk, BV], float32

    # -- the final state, float32 ------------------------------------------------------------------
    tl.store(s_out + i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :], b_S, mask=m_kv)


# ---------------------------------------------------------------------------------------------
# Stage 3: the output pass (parallel over Dv blocks, chunks and heads)
# ---------------------------------------------------------------------------------------------

@_kernel
def _output_kernel(
    q, k, states, u_new,  # q, k [BH, T, Dk]; S_[c] [BH, NT, Dk, Dv]; U' [BH, T, Dv]
    o,  # output O [BH, T, Dv], the inputs' dtype
    T, Dk, Dv, NT,
    BC: tl.constexpr,
    BK: tl.constexpr,  # block of Dk columns per step of the reduction
    BV: tl.constexpr,
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
        b_q = to_operand(b_q.to(tl.float32), BF16, EMULATE)  # [C, BK]
        b_k = to_operand(b_k.to(tl.float32), BF16, EMULATE)  # [C, BK]
        b_h = to_operand(b_h.to(tl.float32), BF16, EMULATE)
        b_o += tl.dot(b_q, b_h, input_precision=PRECISION)  # Q_[c] S_[c] (inter-chunk)
        b_sc += tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # Q_[c] K_[c]ᵀ

    # -- O_[c] = Q_[c] S_[c] + Ω_[c] U'_[c],  Ω_[c] = Q_[c] K_[c]ᵀ ⊙ M --------------------------------
    b_sc = tl.where(o_i[:, None] >= o_i[None, :], b_sc, 0.0)  # causal mask M: j ≤ i
    b_sc = to_operand(b_sc, BF16, EMULATE)  # Ω_[c]
    b_du = tl.load(u_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
    b_du = to_operand(b_du.to(tl.float32), BF16, EMULATE)
    b_o += tl.dot(b_sc, b_du, input_precision=PRECISION)  # intra-chunk
    tl.store(o + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_tv)


# ---------------------------------------------------------------------------------------------
# Host side: block sizes, launches
# ---------------------------------------------------------------------------------------------

def launch_config(chunk_size: int, Dk: int, Dv: int) -> dict[str, dict]:
    """Tile sizes and launch options of each stage: ``{"wy"|"state"|"output": {BK, BV, num_warps,
    num_stages}}``. The interpreter uses the tiles and ignores the options.

    * ``state``: ``BK`` is all of Dk (padded to a power of two ≥ 16; the state's rows stay in
      registers), ``BV`` the block of state columns one program carries.
    * ``wy`` and ``output``: Dk is walked in blocks of ``BK`` ≤ 64.

    Chosen by compiling for sm_90 without a GPU and reading ptxas' report (registers, spills,
    shared memory), not by timing (chapter 9 prints these reports). With tf32 and four warps the
    state pass spills at (C, D) = (32, 64), (64, 64) and (32, 128), and every stage spills at
    (64, 128); with eight warps nothing spills for C in {16, 32, 64} and D in {64, 128}. So eight
    warps from ``C · BK = 2048`` up, four below. BV = 32 with one pipeline stage keeps the state
    pass under 64 KB of shared memory at C = 64, D = 128, which every GPU Triton supports can
    hold (two stages, which prefetch the next chunk's tiles during the current one, need about
    twice that: A100/H100 only). ``tools/gpu_check_kernels.py`` times the alternatives on a GPU.
    """
    BK_full = tile_size(Dk)
    BK = min(BK_full, 64)
    BV_full = tile_size(Dv)
    BV = min(BV_full, 32 if BK_full > 64 else 64)
    warps = 8 if chunk_size * BK_full >= 2048 else 4
    return {
        "wy": dict(BK=BK, BV=min(BV_full, 64), num_warps=warps, num_stages=1),
        "state": dict(BK=BK_full, BV=BV, num_warps=warps, num_stages=1),
        "output": dict(BK=BK, BV=BV, num_warps=warps, num_stages=1),
    }


def _validate(q, k, v, beta, chunk_size, initial_state, input_precision, fuse_output, operands, op):
    """Check the inputs; return ``(input_precision, operands)`` with the defaults filled in."""
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    if initial_state is not None:
        check_state(initial_state, (B, H, Dk, Dv), q, op, "initial_state")
    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{op}: the Triton kernel takes float16, bfloat16 or float32 inputs "
                        f"(it accumulates in float32), got {q.dtype}; use "
                        "tinyk3.ops.delta_rule.chunked for float64")
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
    if not isinstance(fuse_output, bool):
        raise TypeError(f"{op}: fuse_output must be a bool, got {type(fuse_output).__name__}")
    runtime.check_device(q, op)
    runtime.check_grid(op, B * H, -(-T // chunk_size))
    return input_precision, operands


def _forward(q, k, v, beta, initial_state, chunk_size, input_precision, fuse_output, operands,
             return_stages=False, config=None):
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
        q, k, v, beta = (t.to(f32) for t in (q, k, v, beta))
    mid = torch.bfloat16 if bf16 and not interpret else f32  # dtype of W, U, S_[c], U'
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    C, NT, BH = chunk_size, triton.cdiv(T, chunk_size), B * H
    cfg = config or launch_config(C, Dk, Dv)
    c1, c2, c3 = cfg["wy"], cfg["state"], cfg["output"]
    mode = dict(BC=C, PRECISION=input_precision, BF16=bf16, EMULATE=interpret)

    # stage 1: W, U for every chunk of every head (grid: chunks × heads)
    w = torch.empty(B, H, T, Dk, dtype=mid, device=dev)
    u = torch.empty(B, H, T, Dv, dtype=mid, device=dev)
    kern._wy_kernel[(NT, BH)](k, v, beta, w, u, T, Dk, Dv, **mode, **c1)

    # stage 2: the state pass (grid: Dv blocks × heads), from S_0 to S_T
    o = torch.empty(B, H, T, Dv, dtype=f32 if interpret else out_dtype, device=dev)
    states = w if fuse_output else torch.empty(B, H, NT, Dk, Dv, dtype=mid, device=dev)
    u_new = w if fuse_output else torch.empty(B, H, T, Dv, dtype=mid, device=dev)
    s_final = torch.empty_like(S)  # (unused pointers get a placeholder tensor: never touched)
    kern._state_kernel[(triton.cdiv(Dv, c2["BV"]), BH)](
        q, k, w, u, S, o, states, u_new, s_final, T, Dk, Dv, NT,
        HAS_S0=initial_state is not None, FUSE_OUTPUT=fuse_output, **mode, **c2)

    # stage 3: the output pass (grid: Dv blocks × chunks × heads)
    if not fuse_output:
        kern._output_kernel[(triton.cdiv(Dv, c3["BV"]), NT, BH)](
            q, k, states, u_new, o, T, Dk, Dv, NT, **mode, **c3)
    o = o.to(out_dtype)
    if return_stages:
        stages = {"w": w, "u": u, "o": o, "S": s_final}
        if not fuse_output:
            stages.update(states=states, u_new=u_new)
        return stages
    return o, s_final


class _ChunkedFunction(torch.autograd.Function):
    """Forward: the Triton stages, keeping the inputs and the chunk-boundary states ``S_[c]``
    (with ``fuse_output`` none are stored: the backward recomputes them). Backward: the
    backward kernels of :mod:`tinyk3.kernels.backward` with ``GATE = 0`` (chapter 21)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, initial_state, chunk_size, input_precision, fuse_output,
                operands):
        stages = _forward(q, k, v, beta, initial_state, chunk_size, input_precision, fuse_output,
                          operands, return_stages=True)
        ctx.save_for_backward(q, k, v, beta, initial_state, stages.get("states"))
        ctx.mode = (chunk_size, input_precision, operands)
        return stages["o"], stages["S"]

    @staticmethod
    def backward(ctx, do, dS):
        from . import backward as _backward

        q, k, v, beta, initial_state, states = ctx.saved_tensors
        C, precision, operands = ctx.mode
        dq, dk, dv, db, _, dS0 = _backward.backward(
            q, k, v, beta, None, do, dS, gate=0, chunk_size=C, initial_state=initial_state,
            states=states, input_precision=precision, operands=operands)
        like = (q, k, v, beta, initial_state)
        return (*(d.to(t.dtype) if n and t is not None else None
                  for d, t, n in zip((dq, dk, dv, db, dS0), like, ctx.needs_input_grad)),
                None, None, None, None)


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    input_precision: str | None = None,
    fuse_output: bool = False,
    operands: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise DeltaNet in Triton; the contract of :func:`tinyk3.ops.delta_rule.chunked`.

    Returns ``(o [B, H, T, Dv] in the inputs' dtype, S [B, H, Dk, Dv] float32)``. CUDA tensors run
    compiled, CPU tensors under the Triton interpreter. Differentiable (the backward recomputes
    with the PyTorch form). ``operands``: ``"float32"`` or ``"bfloat16"`` (bfloat16 tiles into
    every ``tl.dot``, float32 accumulation, W, U, S_[c], U' stored in bfloat16, as fla does);
    ``None``: ``"bfloat16"`` for bfloat16 inputs, ``"float32"`` otherwise. ``input_precision``
    (float32 operands only): ``"ieee"`` (exact), ``"tf32"`` (tensor cores, ≈1e-3 relative),
    ``"tf32x3"``; ``None``: ``"ieee"`` for float32 inputs, ``"tf32"`` for float16. ``fuse_output``
    computes the output inside the sequential state pass instead of a separate parallel pass.
    Raises :class:`tinyk3.kernels.TritonUnavailableError` if Triton is not installed.
    """
    op = "kernels.delta_rule.chunked"
    require_triton("tinyk3.kernels.delta_rule.chunked")
    precision, operands = _validate(q, k, v, beta, chunk_size, initial_state, input_precision,
                                    fuse_output, operands, op)
    return _ChunkedFunction.apply(q, k, v, beta, initial_state, chunk_size, precision, fuse_output,
                                  operands)


def forward_stages(
    q, k, v, beta, *, chunk_size=64, initial_state=None, input_precision=None, fuse_output=False,
    operands=None, config=None,
) -> dict[str, torch.Tensor]:
    """Run the forward stages and return what each one wrote, for checking them one at a time:
    ``w``, ``u`` ([B, H, T, D], stage 1), ``states`` ([B, H, T/C, Dk, Dv], the state each chunk
    starts from) and ``u_new`` (``U'``, [B, H, T, Dv]) from stage 2 (absent when fused), ``o``
    and the final state ``S``. No autograd. ``config`` replaces :func:`launch_config`'s tiles and
    launch options (the same dict shape), to try other block sizes."""
    op = "kernels.delta_rule.forward_stages"
    require_triton("tinyk3.kernels.delta_rule.forward_stages")
    precision, operands = _validate(q, k, v, beta, chunk_size, initial_state, input_precision,
                                    fuse_output, operands, op)
    with torch.no_grad():
        return _forward(q, k, v, beta, initial_state, chunk_size, precision, fuse_output, operands,
                        return_stages=True, config=config)


def compile_for_gpu(
    arch: int = 90,
    *,
    chunk_size: int = 64,
    Dk: int = 128,
    Dv: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    has_initial_state: bool = True,
    fuse_output: bool = False,
    input_precision: str = "ieee",
    operands: str = "float32",
    config: dict | None = None,
) -> dict:
    """Compile the kernels for an NVIDIA GPU of compute capability ``arch`` (80: A100, 90: H100)
    **without a GPU** (:func:`tinyk3.kernels.runtime.compile_kernel`), with the tiles and options
    :func:`launch_config` gives (or ``config``), for inputs of ``dtype`` and the given
    ``operands`` mode (the intermediates' pointers are bfloat16 in the bfloat16 mode). Returns
    ``{name: compiled}``; ``compiled.asm`` holds ``"ttir"``, ``"ttgir"``, ``"llir"``, ``"ptx"``,
    ``"cubin"``, ``compiled.metadata`` the shared memory it needs;
    :func:`tinyk3.kernels.runtime.ptxas_report` gives registers and spills.

    Catches what the interpreter cannot: non-power-of-two tiles, dtype mismatches in ``tl.dot``,
    unsupported operations, and resource use on the real target.
    """
    require_triton("tinyk3.kernels.delta_rule.compile_for_gpu")
    if (dtype not in _KERNEL_DTYPES or chunk_size not in CHUNK_SIZES
            or input_precision not in INPUT_PRECISIONS or operands not in OPERANDS):
        raise ValueError("compile_for_gpu: unsupported dtype, chunk_size, input_precision or operands")
    kern = _kernels(False)
    cfg = config or launch_config(chunk_size, Dk, Dv)
    bf16 = operands == "bfloat16"
    x = runtime.pointer_type(dtype)
    m = runtime.pointer_type(torch.bfloat16 if bf16 else torch.float32)
    f32 = "*fp32"
    mode = {"BC": chunk_size, "PRECISION": input_precision, "BF16": bf16, "EMULATE": False}
    specs = {
        "_wy_kernel": (dict(k=x, v=x, beta=x, w=m, u=m, T="i32", Dk="i32", Dv="i32"),
                       mode, cfg["wy"]),
        "_state_kernel": (dict(q=x, k=x, w=m, u=m, s0=f32, o=x, states=m, u_new=m, s_out=f32,
                               T="i32", Dk="i32", Dv="i32", NT="i32"),
                          dict(mode, HAS_S0=has_initial_state, FUSE_OUTPUT=fuse_output), cfg["state"]),
    }
    if not fuse_output:
        specs["_output_kernel"] = (dict(q=x, k=x, states=m, u_new=m, o=x, T="i32", Dk="i32",
                                        Dv="i32", NT="i32"), mode, cfg["output"])
    out = {}
    for name, (sig, constexprs, launch) in specs.items():
        constexprs = {**constexprs, "BK": launch["BK"], "BV": launch["BV"]}
        out[name] = runtime.compile_kernel(getattr(kern, name), sig, constexprs, arch=arch,
                                           num_warps=launch["num_warps"],
                                           num_stages=launch["num_stages"])
    return out

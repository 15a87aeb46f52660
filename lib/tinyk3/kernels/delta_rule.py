"""Chunkwise DeltaNet as Triton kernels (chapter 9). Same contract as
:func:`tinyk3.ops.delta_rule.chunked`::

    chunked(q, k, v, beta, *, chunk_size=64, initial_state=None) -> (o, S)
    q, k: [B, H, T, Dk]   v: [B, H, T, Dv]   beta: [B, H, T]   S: [B, H, Dk, Dv] (float32)
    o_t = q_t S_t  (row layout; no scaling of q or k inside)

The chapter-8 equations, per chunk ``c`` of ``C`` tokens (rows are tokens, ``M``: j ≤ i)::

    A_c     = tril(diag(β) K_c K_cᵀ, −1)                       (scaled K Kᵀ, strictly lower)
    T_c     = (I + A_c)⁻¹ diag(β)                               (UT transform)
    W_c     = T_c K_c,   U_c = T_c V_c                           (WY factors)
    U'_c    = U_c − W_c S_c                                      (deltas given the state so far)
    O_c     = Q_c S_c + (Q_c K_cᵀ ⊙ M) U'_c
    S_{c+1} = S_c + K_cᵀ U'_c

How the work is split (the split of fla-org/flash-linear-attention's ``chunk_delta_rule``):

1. :func:`_wy_kernel`, one program per (chunk, B·H), all in parallel: ``K Kᵀ``, the triangular
   solve for ``T`` (forward substitution in float32 registers), ``W`` and ``U``. Nothing here
   depends on the state, so every chunk of every head is independent.
   (fla: ``chunk_scaled_dot_kkt_fwd`` + ``solve_tril`` + ``recompute_w_u_fwd``. fla's solve
   inverts 16 × 16 diagonal blocks and merges them with matrix products, as
   :func:`tinyk3.ops.wy.block_inverse` does, so the merges run on tensor cores; row-by-row
   substitution over the whole chunk is simpler, C steps of O(C²) vector work.)
2. :func:`_state_kernel`, one program per (block of Dv columns, B·H): the only sequential
   part, a loop over the chunks carrying ``S`` in registers. It stores the state each chunk
   *starts* from and the deltas ``U'``. The ``Dv`` columns of ``S`` evolve independently
   (every equation above acts on ``S`` column by column), so a head's state can be split over
   several programs. (fla: ``chunk_gated_delta_rule_fwd_h``.)
3. :func:`_output_kernel`, one program per (Dv block, chunk, B·H), all in parallel again:
   ``O_c = Q_c S_c + (Q_c K_cᵀ ⊙ M) U'_c`` from the stored ``S_c`` and ``U'_c``.
   (fla: ``chunk_fwd_o``.)

Why a separate output pass (the default, as in fla): the sequential pass then does only the
two ``C × Dk × Dv`` products per chunk it cannot avoid (``W_c S_c`` and ``K_cᵀ U'_c``), while
the output (``Q_c S_c``, ``Q_c K_cᵀ``, and the ``C × C`` product with ``U'_c``: about as many
flops again at C = 64, D = 128) runs on a grid ``T / C`` times larger. The price is memory
traffic: every chunk's starting state (``Dk · Dv`` floats, so ``T/C · Dk · Dv`` per head) and
``U'`` go through global memory. ``fuse_output=True`` computes ``O_c`` inside the state pass
instead: nothing stored, but that work then runs sequentially on only ``B·H·Dv/BV``
programs, which is fine when B·H alone fills the GPU and slow for a few long sequences. Both
are checked equal to the PyTorch form.

Stored between stages (float32): ``W``, ``U`` ([B, H, T, D]), per-chunk states
([B, H, T/C, Dk, Dv]) and ``U'``. Recomputed rather than stored: ``Q Kᵀ`` (stage 3 redoes the
product instead of keeping ``C × C`` scores). ``T`` is not kept: the backward pass
(:class:`_ChunkedFunction`) recomputes everything with the PyTorch form under autograd.

Numerics: every tile is converted to float32 when loaded and all products accumulate in
float32; ``o`` is written in the inputs' dtype, ``S`` is float32 (as in the PyTorch form).
``input_precision`` is passed to every ``tl.dot``: ``"ieee"`` is true float32, so the GPU
result matches the PyTorch form to float32 round-off (PyTorch's own float32 matmuls do not use
tf32 unless told to); ``"tf32"`` uses tensor cores (operands rounded to a 10-bit mantissa: much
faster, errors ≈1e-3 relative); ``"tf32x3"`` recovers most of the float32 precision at three
times the tf32 cost. The default (``None``) is ``"ieee"`` for float32 inputs and ``"tf32"`` for
float16/bfloat16 ones, whose values are exact in tf32 and whose output is rounded to 8 or 11
bits anyway. Mind the cost of ``"ieee"`` on a GPU: no tensor cores, and at C = 64, D = 128 the
stages spill registers (ptxas, sm_90); it is the mode for checking, tf32 the one for speed.
The interpreter ignores the setting (its float32 products are exact IEEE).

Where it runs: CUDA tensors are compiled (``triton.JITFunction``); CPU tensors go through the
Triton interpreter, chosen per call, so one process (a notebook, pytest) can do both and needs
no ``TRITON_INTERPRET``; with ``TRITON_INTERPRET=1`` set before triton is imported, everything
is interpreted, as usual. This is why the kernels call only Triton *builtins*: ``tl.full``
rather than ``tl.zeros``, ``tl.reduce(x, 0, tl.standard._sum_combine)`` rather than
``tl.sum(x, 0)``, ``//`` rather than ``tl.cdiv``. Those library helpers are themselves
``@triton.jit`` functions, fixed as compiled or interpreted when triton is imported (and
``transformers``, for one, imports triton). Under the interpreter the inputs are cast to
float32 on the host first: its bfloat16 arithmetic is silently wrong (TOOLING.md).

Limits: ``chunk_size`` 16, 32 or 64 (``tl.dot`` needs tiles of at least 16); ``Dk, Dv ≤ 128``
(any size: tiles are padded to a power of two ≥ 16 by masked loads, and zero columns change
nothing); float16, bfloat16, float32 inputs. Any ``T``: the last chunk is masked (padded tokens
load ``k = 0, β = 0`` and are never stored; the interpreter does not check out-of-bounds
addresses, so every load and store below carries a mask).
"""

from __future__ import annotations

import functools
import math
import os
import re
import types
from types import SimpleNamespace

import torch

from ..ops import delta_rule as _ops_delta_rule
from ..ops._checks import check_beta, check_qkv, check_state
from . import AVAILABLE, require_triton

if AVAILABLE:
    import triton
    import triton.language as tl
else:  # the kernels below are plain functions until jitted; nothing here touches triton
    triton = tl = None

__all__ = ["chunked", "forward_stages", "compile_for_gpu", "launch_config", "interpreter_only",
           "cannot_compile_reason", "CHUNK_SIZES", "MAX_HEAD_DIM", "INPUT_PRECISIONS"]

CHUNK_SIZES = (16, 32, 64)
MAX_HEAD_DIM = 128
INPUT_PRECISIONS = ("ieee", "tf32", "tf32x3")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The kernels are kept as plain functions and jitted on first use, once for the GPU
# (JITFunction) and once for the interpreter, so a CPU call and a CUDA call can share a process.
_KERNEL_FNS: dict = {}


def _kernel(fn):
    """Register a Triton kernel (what ``@triton.jit`` would decorate): see :func:`_kernels`."""
    _KERNEL_FNS[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------------------------------------
# Stage 1: WY factors of every chunk (parallel over chunks and heads)
# ---------------------------------------------------------------------------------------------

@_kernel
def _wy_kernel(
    k, v, beta,  # inputs: k [BH, T, Dk], v [BH, T, Dv], beta [BH, T] (contiguous)
    w, u,  # outputs (float32): W [BH, T, Dk], U [BH, T, Dv]
    T, Dk, Dv,
    BC: tl.constexpr,  # chunk size C (16, 32, 64)
    BK: tl.constexpr,  # block of Dk columns loaded at a time
    BV: tl.constexpr,  # block of Dv columns loaded at a time
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee", "tf32", "tf32x3"
):
    # -- which chunk: program (i_c, i_bh) owns tokens i_c·C … i_c·C + C − 1 of head i_bh ----------
    i_c = tl.program_id(0)
    i_bh = tl.cast(tl.program_id(1), tl.int64)  # int64: BH·T·D can pass 2³¹
    o_i = tl.arange(0, BC)  # position inside the chunk (row index i, column index j)
    o_t = i_c * BC + o_i  # token index t
    m_t = o_t < T  # the last chunk may be partial: rows with t ≥ T are padding
    b_beta = tl.load(beta + i_bh * T + o_t, mask=m_t, other=0.0).to(tl.float32)  # β   [C]

    # -- K Kᵀ, accumulated over Dk in blocks of BK: A_ij = k_i · k_j --------------------------------
    b_A = tl.full([BC, BC], 0.0, tl.float32)  # tl.zeros, spelled with a builtin (module docstring)
    for i_k in range(0, (Dk + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk  # columns past Dk load as 0 (padding to a power of two)
        p_k = k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
        b_k = tl.load(p_k, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [C, BK]
        b_A += tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)

    # -- A = tril(diag(β) K Kᵀ, −1): scale row i by β_i, keep j < i ---------------------------------
    b_A = tl.where(o_i[:, None] > o_i[None, :], b_beta[:, None] * b_A, 0.0)

    # -- forward substitution for (I + A)⁻¹ = I + N, one row at a time, in registers --------------
    # Row i of X = (I + A)⁻¹ solves Σ_j (I + A)_ij X_j = e_i:  X_i = e_i − Σ_{j<i} A_ij X_j,
    # so N_i = X_i − e_i = −A_i − Σ_{j<i} A_ij N_j. Start from N = −A (row i still holds −A_i
    # until step i overwrites it); rows j < i are final when row i is computed, and the terms
    # with j ≥ i vanish because A_ij = 0 there. Row 0 is already final (N_0 = 0).
    # (tl.reduce(x, 0, tl.standard._sum_combine) is tl.sum(x, 0), spelled with builtins: see the
    # module docstring.)
    b_N = -b_A
    for i in range(1, BC):
        b_a = tl.reduce(tl.where(o_i[:, None] == i, b_N, 0.0), 0, tl.standard._sum_combine)  # −A_i [C]
        b_a = b_a + tl.reduce(b_a[:, None] * b_N, 0, tl.standard._sum_combine)  # −A_i − Σ_j A_ij N_j
        b_N = tl.where(o_i[:, None] == i, b_a[None, :], b_N)  # write row i back
    # T = (I + N) diag(β): scale column j by β_j
    b_T = (b_N + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)) * b_beta[None, :]  # [C, C]

    # -- W = T K  (block by block over Dk; K is reloaded rather than kept in registers) -----------
    for i_k in range(0, (Dk + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk
        m_tk = m_t[:, None] & m_k[None, :]
        p_k = k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
        b_k = tl.load(p_k, mask=m_tk, other=0.0).to(tl.float32)
        b_w = tl.dot(b_T, b_k, input_precision=PRECISION)  # [C, BK]
        tl.store(w + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], b_w, mask=m_tk)

    # -- U = T V  (block by block over Dv) ----------------------------------------------------------
    for i_v in range(0, (Dv + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < Dv)
        p_v = v + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :]
        b_v = tl.load(p_v, mask=m_tv, other=0.0).to(tl.float32)
        b_u = tl.dot(b_T, b_v, input_precision=PRECISION)  # [C, BV]
        tl.store(u + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], b_u, mask=m_tv)


# ---------------------------------------------------------------------------------------------
# Stage 2: the sequential state pass (one program per Dv block and head, a loop over chunks)
# ---------------------------------------------------------------------------------------------

@_kernel
def _state_kernel(
    q, k, w, u, s0,  # q, k [BH, T, Dk]; W [BH, T, Dk], U [BH, T, Dv] (float32); S_0 [BH, Dk, Dv]
    o, states, u_new, s_out,  # O [BH, T, Dv]; S_c [BH, NT, Dk, Dv]; U' [BH, T, Dv]; S [BH, Dk, Dv]
    T, Dk, Dv, NT,
    BC: tl.constexpr,  # chunk size C
    BK: tl.constexpr,  # all of Dk, padded to a power of two (the state's rows stay in registers)
    BV: tl.constexpr,  # this program's block of the state's Dv columns
    HAS_S0: tl.constexpr,  # initial state given (else S_0 = 0)
    FUSE_OUTPUT: tl.constexpr,  # compute O here (no stored states) instead of in stage 3
    PRECISION: tl.constexpr,
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

    for i_c in range(0, NT):  # the one sequential loop: chunk c needs S_c from chunk c − 1
        o_t = i_c * BC + o_i
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]

        if not FUSE_OUTPUT:  # keep S_c, the state chunk c starts from, for the output pass
            p_h = states + (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
            tl.store(p_h, b_S, mask=m_kv)

        # -- U'_c = U_c − W_c S_c: what each token still has to write, given the state so far -----
        b_w = tl.load(w + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk, other=0.0)
        b_u = tl.load(u + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
        b_du = b_u - tl.dot(b_w, b_S, input_precision=PRECISION)  # [C, BV]
        b_k = tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)  # [C, BK]

        if FUSE_OUTPUT:
            # -- O_c = Q_c S_c + (Q_c K_cᵀ ⊙ M) U'_c, right here (see stage 3 for the same block) ---
            b_q = tl.load(q + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                          other=0.0).to(tl.float32)
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # Q_c K_cᵀ     [C, C]
            b_A = tl.where(o_i[:, None] >= o_i[None, :], b_A, 0.0)  # ⊙ M (j ≤ i)
            b_o = tl.dot(b_q, b_S, input_precision=PRECISION)  # Q_c S_c            [C, BV]
            b_o += tl.dot(b_A, b_du, input_precision=PRECISION)  # + (Q_c K_cᵀ ⊙ M) U'_c
            p_o = o + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :]
            tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_tv)
        else:
            p_du = u_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :]
            tl.store(p_du, b_du, mask=m_tv)

        # -- S_{c+1} = S_c + K_cᵀ U'_c (padded rows have k = 0 and U' = 0: no change) -------------
        b_S += tl.dot(tl.trans(b_k), b_du, input_precision=PRECISION)  # [Dk, BV]

    # -- the final state, float32 ------------------------------------------------------------------
    tl.store(s_out + i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :], b_S, mask=m_kv)


# ---------------------------------------------------------------------------------------------
# Stage 3: the output pass (parallel over Dv blocks, chunks and heads)
# ---------------------------------------------------------------------------------------------

@_kernel
def _output_kernel(
    q, k, states, u_new,  # q, k [BH, T, Dk]; S_c [BH, NT, Dk, Dv]; U' [BH, T, Dv] (float32)
    o,  # output O [BH, T, Dv], the inputs' dtype
    T, Dk, Dv, NT,
    BC: tl.constexpr,
    BK: tl.constexpr,  # block of Dk columns per step of the reduction
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
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

    # -- Q_c S_c and Q_c K_cᵀ, both reductions over Dk, accumulated block by block -----------------
    b_o = tl.full([BC, BV], 0.0, tl.float32)
    b_A = tl.full([BC, BC], 0.0, tl.float32)
    for i_k in range(0, (Dk + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)  # [C, BK]
        b_k = tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)  # [C, BK]
        p_h = states + (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)  # S_c rows   [BK, BV]
        b_o += tl.dot(b_q, b_h, input_precision=PRECISION)  # Q_c S_c (inter-chunk)
        b_A += tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # Q_c K_cᵀ

    # -- O_c = Q_c S_c + (Q_c K_cᵀ ⊙ M) U'_c ----------------------------------------------------------
    b_A = tl.where(o_i[:, None] >= o_i[None, :], b_A, 0.0)  # causal mask M: j ≤ i
    b_du = tl.load(u_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
    b_o += tl.dot(b_A, b_du, input_precision=PRECISION)  # intra-chunk
    tl.store(o + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_tv)


# ---------------------------------------------------------------------------------------------
# Host side: jitting, block sizes, launches
# ---------------------------------------------------------------------------------------------

def _env_interpret() -> bool:
    """``TRITON_INTERPRET`` as Triton reads it (``triton.knobs`` from 3.4, the variable before)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _interpreting(device: torch.device) -> bool:
    return device.type == "cpu" or _env_interpret() or interpreter_only()


def interpreter_only() -> bool:
    """True if this process can only interpret Triton kernels, not compile them: triton was
    imported with ``TRITON_INTERPRET=1``, so its own library functions are interpreter objects."""
    require_triton("tinyk3.kernels.delta_rule.interpreter_only")
    return not isinstance(tl.standard._sum_combine, triton.JITFunction)


_INTERPRETER_USED = False  # set by the first interpreted launch (see cannot_compile_reason)


def cannot_compile_reason() -> str | None:
    """Why this process cannot compile kernels for a GPU (``None`` if it can): triton was imported
    with ``TRITON_INTERPRET=1``, or Triton < 3.6 has run the interpreter here (it leaves its
    patches on ``triton.language`` in place; 3.6 restores them)."""
    require_triton("tinyk3.kernels.delta_rule.cannot_compile_reason")
    if interpreter_only():
        return ("triton was imported with TRITON_INTERPRET=1, so this process can only interpret "
                "kernels; compile in a process without it")
    version = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    if _INTERPRETER_USED and version < (3, 6):
        return (f"Triton {triton.__version__} keeps the interpreter's patches after an interpreted "
                "launch in this process; compile in a fresh process (or use Triton >= 3.6)")
    return None


def _interpreter_range(*bounds):
    """``range`` for interpreted kernels. The interpreter hands runtime integers to a kernel as
    one-element arrays; before Triton 3.7 it turned them into loop bounds with ``int(array)``,
    which NumPy 2.4 refuses (only 0-d arrays convert). Compiled kernels use the builtin."""
    return range(*(int(b.handle.data.reshape(-1)[0]) if hasattr(b, "handle") else int(b) for b in bounds))


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """The kernels, jitted for the GPU (``interpret=False``: what ``@triton.jit`` builds when
    ``TRITON_INTERPRET`` is unset) or wrapped for the interpreter (what it builds when set).

    The interpreter's wrapper runs each kernel as rewritten Python in a copy of this module's
    namespace (it adds its own helpers to the namespace it is given)."""
    require_triton("tinyk3.kernels.delta_rule")
    if not interpret:
        return SimpleNamespace(**{name: triton.JITFunction(fn) for name, fn in _KERNEL_FNS.items()})
    from triton.runtime.interpreter import InterpretedFunction

    ns = dict(globals())
    ns["range"] = _interpreter_range
    wrapped = {}
    for name, fn in _KERNEL_FNS.items():
        copy = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__annotations__, copy.__kwdefaults__ = dict(fn.__annotations__), fn.__kwdefaults__
        wrapped[name] = InterpretedFunction(copy)
    return SimpleNamespace(**wrapped)


def _pow2(n: int) -> int:
    """Tile size for a dimension of ``n``: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def launch_config(chunk_size: int, Dk: int, Dv: int) -> dict[str, dict]:
    """Tile sizes and launch options of each stage: ``{"wy"|"state"|"output": {BK, BV, num_warps,
    num_stages}}``. The interpreter uses the tiles and ignores the options.

    * ``state``: ``BK`` is all of Dk (padded to a power of two ≥ 16; the state's rows stay in
      registers), ``BV`` the block of state columns one program carries.
    * ``wy`` and ``output``: Dk is walked in blocks of ``BK`` ≤ 64.

    Chosen by compiling for sm_90 without a GPU and reading ptxas' report (registers, spills,
    shared memory), not by timing. With tf32 and four warps the state pass spills at
    (C, D) = (32, 64), (64, 64) and (32, 128), and every stage spills at (64, 128); with eight
    warps nothing spills for C in {16, 32, 64} and D in {64, 128}. So eight warps from
    ``C · BK = 2048`` up (at (16, 128) four warps sit at 254 registers, eight at 222), four below.
    BV = 32 with one pipeline stage keeps the state pass at 57 KB of shared memory, which
    every GPU Triton supports can hold (two stages, which prefetch the next chunk's tiles during
    the current one, need 106 KB: A100/H100 only). ``tools/gpu_check_kernels.py`` times the
    alternatives on a real GPU.
    """
    BK_full = _pow2(Dk)
    BK = min(BK_full, 64)
    BV_full = _pow2(Dv)
    BV = min(BV_full, 32 if BK_full > 64 else 64)
    warps = 8 if chunk_size * BK_full >= 2048 else 4
    return {
        "wy": dict(BK=BK, BV=min(BV_full, 64), num_warps=warps, num_stages=1),
        "state": dict(BK=BK_full, BV=BV, num_warps=warps, num_stages=1),
        "output": dict(BK=BK, BV=BV, num_warps=warps, num_stages=1),
    }


def _validate(q, k, v, beta, chunk_size, initial_state, input_precision, fuse_output, op):
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    if initial_state is not None:
        check_state(initial_state, (B, H, Dk, Dv), q, op, "initial_state")
    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{op}: the Triton kernel computes in float32 and takes float16, bfloat16 or "
                        f"float32 inputs, got {q.dtype}; use tinyk3.ops.delta_rule.chunked for float64")
    if isinstance(chunk_size, bool) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"{op}: chunk_size must be one of {CHUNK_SIZES} (tl.dot tiles are at least 16 "
                         f"and a power of two), got {chunk_size!r}")
    if Dk > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM or Dk < 1 or Dv < 1:
        raise ValueError(f"{op}: head dimensions must be 1..{MAX_HEAD_DIM} (the state block lives in "
                         f"registers), got Dk={Dk}, Dv={Dv}")
    if input_precision is None:
        input_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(f"{op}: input_precision must be one of {INPUT_PRECISIONS} or None, "
                         f"got {input_precision!r}")
    if not isinstance(fuse_output, bool):
        raise TypeError(f"{op}: fuse_output must be a bool, got {type(fuse_output).__name__}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: tensors must be on a CUDA device (compiled) or the CPU (Triton "
                         f"interpreter), got {q.device}")
    T, C = q.shape[2], chunk_size
    if B * H > 65535 or -(-T // C) > 65535:  # CUDA grids allow 65535 along their 2nd and 3rd axes
        raise ValueError(f"{op}: at most 65535 heads (B·H = {B * H}) and 65535 chunks "
                         f"(T / chunk_size = {-(-T // C)}) per call; split the call")
    return input_precision


def _forward(q, k, v, beta, initial_state, chunk_size, input_precision, fuse_output,
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
    interpret = _interpreting(dev)
    kern = _kernels(interpret)
    if interpret:  # the interpreter's bfloat16 arithmetic is silently wrong: hand it float32
        global _INTERPRETER_USED
        _INTERPRETER_USED = True
        q, k, v, beta = (t.to(f32) for t in (q, k, v, beta))
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    C, NT, BH = chunk_size, triton.cdiv(T, chunk_size), B * H
    cfg = config or launch_config(C, Dk, Dv)
    c1, c2, c3 = cfg["wy"], cfg["state"], cfg["output"]

    # stage 1: W, U for every chunk of every head (grid: chunks × heads)
    w = torch.empty(B, H, T, Dk, dtype=f32, device=dev)
    u = torch.empty(B, H, T, Dv, dtype=f32, device=dev)
    kern._wy_kernel[(NT, BH)](k, v, beta, w, u, T, Dk, Dv, BC=C, PRECISION=input_precision, **c1)

    # stage 2: the state pass (grid: Dv blocks × heads), from S_0 to S_T
    o = torch.empty(B, H, T, Dv, dtype=f32 if interpret else out_dtype, device=dev)
    states = w if fuse_output else torch.empty(B, H, NT, Dk, Dv, dtype=f32, device=dev)
    u_new = w if fuse_output else torch.empty(B, H, T, Dv, dtype=f32, device=dev)
    s_final = torch.empty_like(S)  # (unused pointers get a placeholder tensor: never touched)
    kern._state_kernel[(triton.cdiv(Dv, c2["BV"]), BH)](
        q, k, w, u, S, o, states, u_new, s_final, T, Dk, Dv, NT, BC=C,
        HAS_S0=initial_state is not None, FUSE_OUTPUT=fuse_output, PRECISION=input_precision, **c2)

    # stage 3: the output pass (grid: Dv blocks × chunks × heads)
    if not fuse_output:
        kern._output_kernel[(triton.cdiv(Dv, c3["BV"]), NT, BH)](
            q, k, states, u_new, o, T, Dk, Dv, NT, BC=C, PRECISION=input_precision, **c3)
    o = o.to(out_dtype)
    if return_stages:
        stages = {"w": w, "u": u, "o": o, "S": s_final}
        if not fuse_output:
            stages.update(states=states, u_new=u_new)
        return stages
    return o, s_final


class _ChunkedFunction(torch.autograd.Function):
    """Forward: the Triton stages. Backward: recompute with the PyTorch chunked form under
    autograd (:func:`tinyk3.ops.delta_rule.chunked`) and differentiate that. Correct and simple;
    a production backward is its own set of kernels (fla's ``chunk_delta_rule_bwd``)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, initial_state, chunk_size, input_precision, fuse_output):
        ctx.save_for_backward(q, k, v, beta, initial_state)
        ctx.chunk_size = chunk_size
        return _forward(q, k, v, beta, initial_state, chunk_size, input_precision, fuse_output)

    @staticmethod
    def backward(ctx, do, dS):
        q, k, v, beta, initial_state = ctx.saved_tensors
        needs = ctx.needs_input_grad[:5]
        inputs = [t.detach().requires_grad_(n) if t is not None else None
                  for t, n in zip((q, k, v, beta, initial_state), needs)]
        wrt = [t for t, n in zip(inputs, needs) if n and t is not None]
        grads = [None] * 5
        if wrt:
            with torch.enable_grad():
                o, S = _ops_delta_rule.chunked(*inputs[:4], chunk_size=ctx.chunk_size,
                                               initial_state=inputs[4])
                got = iter(torch.autograd.grad((o, S), wrt, (do, dS), allow_unused=True))
            grads = [next(got) if n and t is not None else None for t, n in zip(inputs, needs)]
        return (*grads, None, None, None)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise DeltaNet in Triton; the contract of :func:`tinyk3.ops.delta_rule.chunked`.

    Returns ``(o [B, H, T, Dv] in the inputs' dtype, S [B, H, Dk, Dv] float32)``. CUDA tensors run
    compiled, CPU tensors under the Triton interpreter. Differentiable (the backward recomputes
    with the PyTorch form). ``input_precision`` goes to every ``tl.dot`` (``"ieee"``: float32,
    matches the PyTorch form; ``"tf32"``: tensor cores, ≈1e-3 relative; ``None``: ``"ieee"`` for
    float32 inputs, ``"tf32"`` for half ones; see the module docstring). ``fuse_output`` computes
    the output inside the sequential state pass instead of a separate parallel pass.
    Raises :class:`tinyk3.kernels.TritonUnavailableError` if Triton is not installed.
    """
    op = "kernels.delta_rule.chunked"
    require_triton("tinyk3.kernels.delta_rule.chunked")
    precision = _validate(q, k, v, beta, chunk_size, initial_state, input_precision, fuse_output, op)
    return _ChunkedFunction.apply(q, k, v, beta, initial_state, chunk_size, precision, fuse_output)


def forward_stages(
    q, k, v, beta, *, chunk_size=64, initial_state=None, input_precision=None, fuse_output=False,
    config=None,
) -> dict[str, torch.Tensor]:
    """Run the forward stages and return what each one wrote, for checking them one at a time:
    ``w``, ``u`` ([B, H, T, D], stage 1), ``states`` ([B, H, T/C, Dk, Dv], the state each chunk
    starts from) and ``u_new`` (``U'``, [B, H, T, Dv]) from stage 2 (absent when fused), ``o``
    and the final state ``S``. No autograd. ``config`` replaces :func:`launch_config`'s tiles and
    launch options (the same dict shape), to try other block sizes."""
    op = "kernels.delta_rule.forward_stages"
    require_triton("tinyk3.kernels.delta_rule.forward_stages")
    precision = _validate(q, k, v, beta, chunk_size, initial_state, input_precision, fuse_output, op)
    with torch.no_grad():
        return _forward(q, k, v, beta, initial_state, chunk_size, precision, fuse_output,
                        return_stages=True, config=config)


_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


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
    config: dict | None = None,
) -> dict:
    """Compile the kernels for an NVIDIA GPU of compute capability ``arch`` (80: A100, 90: H100)
    **without a GPU**: ``triton.compile`` with an explicit target runs the whole tool chain (Triton
    IR → LLVM → PTX → the ptxas inside the Triton wheel → cubin), with the tiles and options
    :func:`launch_config` gives (or ``config``). Returns ``{name: compiled}``; ``compiled.asm``
    holds ``"ttir"``, ``"ttgir"``, ``"llir"``, ``"ptx"``, ``"cubin"``, and ``compiled.metadata``
    the shared memory it needs (registers and spills: run ptxas ``-v`` on the PTX).

    Catches what the interpreter cannot: non-power-of-two tiles, dtype mismatches in ``tl.dot``,
    unsupported operations, and resource use on the real target.
    """
    require_triton("tinyk3.kernels.delta_rule.compile_for_gpu")
    reason = cannot_compile_reason()
    if reason:
        raise RuntimeError(f"compile_for_gpu: {reason}")
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if dtype not in _TRITON_DTYPE or chunk_size not in CHUNK_SIZES or input_precision not in INPUT_PRECISIONS:
        raise ValueError("compile_for_gpu: unsupported dtype, chunk_size or input_precision")
    kern = _kernels(False)
    cfg = config or launch_config(chunk_size, Dk, Dv)
    x, f32 = "*" + _TRITON_DTYPE[dtype], "*fp32"
    common = {"BC": chunk_size, "PRECISION": input_precision}
    specs = {
        "_wy_kernel": (dict(k=x, v=x, beta=x, w=f32, u=f32, T="i32", Dk="i32", Dv="i32"),
                       common, cfg["wy"]),
        "_state_kernel": (dict(q=x, k=x, w=f32, u=f32, s0=f32, o=x, states=f32, u_new=f32, s_out=f32,
                               T="i32", Dk="i32", Dv="i32", NT="i32"),
                          dict(common, HAS_S0=has_initial_state, FUSE_OUTPUT=fuse_output), cfg["state"]),
    }
    if not fuse_output:
        specs["_output_kernel"] = (dict(q=x, k=x, states=f32, u_new=f32, o=x, T="i32", Dk="i32",
                                        Dv="i32", NT="i32"), common, cfg["output"])
    # The constexpr keyword is ``constexprs`` from Triton 3.3, ``constants`` before.
    key = "constexprs" if "constexprs" in inspect.signature(ASTSource).parameters else "constants"
    target = GPUTarget("cuda", arch, 32)
    out = {}
    for name, (sig, constexprs, launch) in specs.items():
        constexprs = {**constexprs, "BK": launch["BK"], "BV": launch["BV"]}
        signature = {**sig, **{c: "constexpr" for c in constexprs}}
        src = ASTSource(fn=getattr(kern, name), signature=signature, **{key: constexprs})
        options = {"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]}
        out[name] = triton.compile(src, target=target, options=options)
    return out

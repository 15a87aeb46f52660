"""Chapter 9 exercises: what one program of the Triton kernel does. Two in PyTorch (they need no
Triton): the addresses and mask of a chunk's tile, and the state pass for one block of the
state's columns. One in Triton: the output stage, checked under the Triton interpreter by
:func:`check_output_kernel`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import wy as wy_ops
from .core import Case, CheckResult, Exercise, Mistake, NanMargins, check_kernel, interpret, register

# triton.language, set by check_output_kernel when Triton is there (importing tinyk3.checks does
# not import Triton); the solution kernel below reads it when the interpreter runs it
tl = None

# -- kernel.tile_offsets --------------------------------------------------------------------------


def tile_offsets(i_bh: int, i_c: int, T: int, D: int, C: int, BD: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the element offsets and the mask of the ``[C, BD]`` tile that program ``(i_c, i_bh)``
    loads from a contiguous ``[B·H, T, D]`` tensor: rows ``i_c·C … i_c·C + C − 1`` (tokens) of head
    ``i_bh``, columns ``0 … BD − 1`` (``BD ≥ D``, a power of two). Offsets are computed for every
    lane, masked or not (as ``tl.arange`` arithmetic does); the mask is ``t < T`` and ``d < D``."""
    o_t = i_c * C + torch.arange(C)  # token index of each row          [C]
    o_d = torch.arange(BD)  # column index                              [BD]
    offsets = i_bh * T * D + o_t[:, None] * D + o_d[None, :]  # [C, BD], int64
    mask = (o_t[:, None] < T) & (o_d[None, :] < D)  # [C, BD], bool
    return offsets, mask


def _tile_variant(*, head=lambda T, D: T * D, row=lambda T, D: D, col=lambda T, D: 1,
                  rows_mask=True, cols_mask=True, le=False, chunk_start=True):
    """A wrong tile_offsets with one part changed (strides, masks, the chunk's first token)."""

    def fn(i_bh, i_c, T, D, C, BD):
        o_t = (i_c * C if chunk_start else i_c) + torch.arange(C)
        o_d = torch.arange(BD)
        offsets = i_bh * head(T, D) + o_t[:, None] * row(T, D) + o_d[None, :] * col(T, D)
        mask = torch.ones(C, BD, dtype=torch.bool)
        if rows_mask:
            mask &= (o_t[:, None] <= T) if le else (o_t[:, None] < T)
        if cols_mask:
            mask &= o_d[None, :] < D
        return offsets, mask

    return fn


def _tile_cases(g: torch.Generator) -> list[Case]:
    shapes = [
        (0, 0, 64, 16, 16, 16, "the first tile: nothing masked, offsets 0 … C·D − 1"),
        (3, 2, 64, 32, 16, 32, "head 3, chunk 2: the head and row strides both count"),
        (1, 2, 37, 16, 16, 16, "the last chunk of head 1 is partial: rows t ≥ 37 would read head 2"),
        (2, 1, 40, 20, 32, 32, "D = 20 padded to BD = 32, last chunk partial: rows and columns masked"),
        (0, 0, 10, 12, 16, 16, "T < C: one partial chunk, D padded"),
        (4, 1, 128, 48, 64, 64, "C = 64, D = 48 padded to 64"),
        (1, 3, 50, 16, 16, 16, "T = 50 = 3·16 + 2: the last chunk has two tokens (t = 48, 49)"),
    ]
    T = int(torch.randint(70, 200, (1,), generator=g))
    i_c = (T - 1) // 32
    shapes.append((int(torch.randint(1, 6, (1,), generator=g)), i_c, T, 24, 32, 32,
                   f"random T = {T}, its last chunk"))
    return [Case((i_bh, i_c, T, D, C, BD), label=label) for i_bh, i_c, T, D, C, BD, label in shapes]


register(Exercise(
    id="kernel.tile_offsets",
    title="the addresses and mask of a chunk's tile",
    signature="tile_offsets(i_bh, i_c, T, D, C, BD) -> (offsets [C, BD] int64, mask [C, BD] bool)",
    reference=tile_offsets,
    make_cases=_tile_cases,
    chapter=9,
    atol=0.0,
    rtol=0.0,
    mistakes=[
        Mistake("no_row_mask", _tile_variant(rows_mask=False),
                "your mask lets the rows with t ≥ T through. In the last chunk those addresses "
                "belong to the next head's first tokens (or lie past the end of the tensor, which "
                "the interpreter does not notice): mask rows with o_t < T as well as columns."),
        Mistake("no_col_mask", _tile_variant(cols_mask=False),
                "your mask lets the padding columns d ≥ D through: with BD > D they address the "
                "first elements of the next row. Mask columns with o_d < D as well as rows."),
        Mistake("row_le_T", _tile_variant(le=True),
                "your row mask keeps t = T: token indices run 0 … T − 1, so the mask is o_t < T, "
                "not o_t <= T."),
        Mistake("row_stride_T", _tile_variant(row=lambda T, D: T),
                "consecutive tokens are D elements apart in a contiguous [B·H, T, D] tensor (the row "
                "stride is D, the size of the last dimension), not T."),
        Mistake("transposed_strides", _tile_variant(row=lambda T, D: 1, col=lambda T, D: T),
                "your offsets walk the tensor as if it were [B·H, D, T] (token stride 1, column "
                "stride T). In [B·H, T, D] the last index, the column d, has stride 1 and the token "
                "stride D: offset = i_bh·T·D + t·D + d."),
        Mistake("head_stride_T", _tile_variant(head=lambda T, D: T),
                "the heads are T·D elements apart: each head holds T rows of D. A head stride of T "
                "is right for β ([B·H, T]), not for q, k or v."),
        Mistake("no_head_offset", _tile_variant(head=lambda T, D: 0),
                "every head reads head 0: add i_bh·T·D, the start of head i_bh, to the offsets."),
        Mistake("chunk_start_not_scaled", _tile_variant(chunk_start=False),
                "chunk i_c starts at token i_c·C, not at token i_c: o_t = i_c·C + arange(C)."),
    ],
    hint="o_t = i_c·C + arange(C), o_d = arange(BD); offsets = i_bh·T·D + o_t[:, None]·D + "
         "o_d[None, :]; mask = (o_t[:, None] < T) & (o_d[None, :] < D).",
))

# -- kernel.state_pass_block ----------------------------------------------------------------------


def state_pass_block(w, u, k, s0, chunk_size, i_v, BV):
    """Reference: the work of one program of the state pass (``_state_kernel``) for one head:
    columns ``i_v·BV … min(Dv, i_v·BV + BV) − 1`` of the state, chunk after chunk,

        U'_c = U_c − W_c S_c,   S_{c+1} = S_c + K_cᵀ U'_c.

    ``w [T, Dk]``, ``u [T, Dv]``, ``k [T, Dk]``, ``s0 [Dk, Dv]`` (the whole initial state).
    Returns ``(states [N, Dk, n], u_new [T, n], s_final [Dk, n])``: the state each chunk *starts*
    from, the deltas, and the final state, for the block's ``n`` columns (``N = ⌈T/C⌉``)."""
    T, Dv = u.shape
    cols = slice(i_v * BV, min(Dv, i_v * BV + BV))
    S = s0[:, cols].clone()  # this program's columns of S_0       [Dk, n]
    states, deltas = [], []
    for start in range(0, T, chunk_size):
        rows = slice(start, start + chunk_size)  # the last chunk may be short
        states.append(S)  # S_c: stored before the update
        du = u[rows, cols] - w[rows] @ S  # U'_c = U_c − W_c S_c     [C, n]
        deltas.append(du)
        S = S + k[rows].T @ du  # S_{c+1} = S_c + K_cᵀ U'_c          [Dk, n]
    return torch.stack(states), torch.cat(deltas), S


def _pass_variant(*, store_after=False, subtract=True, s0_from_zero=False, state_with_u=False,
                  floor_chunks=False):
    def fn(w, u, k, s0, chunk_size, i_v, BV):
        T, Dv = u.shape
        v0, v1 = i_v * BV, min(Dv, i_v * BV + BV)
        S = s0[:, : v1 - v0].clone() if s0_from_zero else s0[:, v0:v1].clone()
        states, deltas = [], []
        n_chunks = T // chunk_size if floor_chunks else -(-T // chunk_size)
        for c in range(n_chunks):
            rows = slice(c * chunk_size, (c + 1) * chunk_size)
            if not store_after:
                states.append(S)
            du = u[rows, v0:v1] - w[rows] @ S if subtract else u[rows, v0:v1]
            deltas.append(du)
            S = S + k[rows].T @ (u[rows, v0:v1] if state_with_u else du)
            if store_after:
                states.append(S)
        return torch.stack(states), torch.cat(deltas), S

    return fn


def _pass_cases(g: torch.Generator) -> list[Case]:
    def case(T, Dk, Dv, C, i_v, BV, label, *, zero_s0=False, dtype=torch.float32):
        k = F.normalize(torch.randn(T, Dk, generator=g, dtype=dtype), dim=-1)
        v = torch.randn(T, Dv, generator=g, dtype=dtype)
        beta = torch.rand(T, generator=g, dtype=dtype)
        s0 = torch.zeros(Dk, Dv, dtype=dtype) if zero_s0 else torch.randn(Dk, Dv, generator=g, dtype=dtype)
        N = -(-T // C)
        pad = N * C - T  # W, U from chapter 7's WY factors of each (zero-padded) chunk
        kc = F.pad(k, (0, 0, 0, pad)).view(N, C, Dk)
        vc = F.pad(v, (0, 0, 0, pad)).view(N, C, Dv)
        w, u = wy_ops.wy_factors(kc, vc, F.pad(beta, (0, pad)).view(N, C))
        w, u = w.reshape(N * C, Dk)[:T].contiguous(), u.reshape(N * C, Dv)[:T].contiguous()
        return Case((w, u, k, s0, C, i_v, BV), label=f"T={T}, Dk={Dk}, Dv={Dv}, C={C}, block {i_v} of "
                                                       f"BV={BV}: {label}")

    return [
        case(32, 8, 8, 16, 0, 8, "two whole chunks, one block holds every column, S_0 = 0", zero_s0=True),
        case(48, 8, 16, 16, 1, 8, "the second block of columns, a non-zero S_0"),
        case(37, 16, 12, 16, 1, 8, "T not a multiple of C; the last block has 4 columns, not 8"),
        case(20, 8, 8, 32, 0, 8, "C > T: one short chunk"),
        case(50, 16, 24, 16, 2, 8, "float64, the third block", dtype=torch.float64),
        case(100, 16, 16, 64, 0, 16, "C = 64, the second chunk short"),
        case(64, 16, 32, 16, 3, 8, "four chunks, the last of four blocks"),
    ]


register(Exercise(
    id="kernel.state_pass_block",
    title="the state pass of one program (one block of the state's columns)",
    signature="state_pass_block(w [T, Dk], u [T, Dv], k [T, Dk], s0 [Dk, Dv], chunk_size, i_v, BV) "
              "-> (states [N, Dk, n], u_new [T, n], s_final [Dk, n])",
    reference=state_pass_block,
    make_cases=_pass_cases,
    chapter=9,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("stores_next_state", _pass_variant(store_after=True),
                "your stored states are one chunk late: you store S_{c+1}, after the update. The "
                "output pass needs the state chunk c *starts* from (O_c = Q_c S_c + …): store S "
                "first, then update it. The first stored state is S_0."),
        Mistake("no_minus_WS", _pass_variant(subtract=False),
                "your deltas are U_c, as if every chunk started from an empty state: subtract what "
                "the state already returns at the chunk's keys, U'_c = U_c − W_c S_c."),
        Mistake("block_from_column_0", _pass_variant(s0_from_zero=True),
                "your block starts from the first columns of S_0 whatever i_v is: this program "
                "owns columns i_v·BV … i_v·BV + BV − 1 of the state, S_0 included."),
        Mistake("state_with_u", _pass_variant(state_with_u=True),
                "your state update adds K_cᵀ U_c: it must add the true deltas, S_{c+1} = S_c + "
                "K_cᵀ U'_c, with U'_c = U_c − W_c S_c."),
        Mistake("floor_chunks", _pass_variant(floor_chunks=True),
                "T // C drops the last, partial chunk: loop over ⌈T/C⌉ chunks "
                "(range(0, T, C)); a slice past the end is just short."),
    ],
    hint="cols = slice(i_v·BV, min(Dv, i_v·BV + BV)); S = s0[:, cols]; for each chunk of rows r "
         "(the last may be short): store S; du = u[r, cols] − w[r] @ S; S = S + k[r].T @ du. Return "
         "(torch.stack(states), torch.cat(deltas), S).",
))

# -- kernel.output_stage: a Triton kernel, run under the interpreter -----------------------------
#
# The learner writes the body of a Triton kernel (a plain function, as chapter 9 writes
# ``scaled_kkt_kernel``; a ``@triton.jit`` one is accepted too). ``check_output_kernel`` launches
# it under the Triton interpreter on the cases below and compares with the PyTorch reference:
#
#     output_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC, BK, BV)   grid (NT, B·H)
#     O_[c] = Q_[c] S_[c] + (Q_[c] K_[c]ᵀ ⊙ M) U'_[c],   M: j ≤ i
#
# Every tensor is placed inside a larger buffer filled with NaN, so a load without a mask that
# runs past the end (or before the start) reads NaN instead of unknown memory, and a store
# without a mask lands in the margin of ``o``, where the launcher sees it
# (``tinyk3.checks.core``, shared with chapter 21's exercise).


def output_stage(q, k, states, u_new, C):
    """Reference: ``O_[c] = Q_[c] S_[c] + (Q_[c] K_[c]ᵀ ⊙ M) U'_[c]`` for every chunk ``c`` of
    ``C`` tokens. ``q, k [BH, T, Dk]``, ``states [BH, N, Dk, Dv]`` (the state each chunk starts
    from), ``u_new [BH, T, Dv]``; returns ``o [BH, T, Dv]`` (float32)."""
    BH, T, Dk = q.shape
    N, pad = -(-T // C), -T % C
    qc, kc, uc = (F.pad(x, (0, 0, 0, pad)).view(BH, N, C, -1) for x in (q, k, u_new))
    M = torch.ones(C, C, dtype=torch.bool).tril()
    scores = (qc @ kc.mT).masked_fill(~M, 0.0)  # Ω_[c]
    o = qc @ states + scores @ uc
    return o.reshape(BH, N * C, -1)[:, :T]


def _output_variant(*, mask=lambda C: torch.ones(C, C, dtype=torch.bool).tril(), state="own",
                    nan_u_past_T=False):
    """A wrong output stage, computed in PyTorch the way the wrong kernel computes it."""

    def fn(q, k, states, u_new, C):
        BH, T, Dk = q.shape
        N, pad = -(-T // C), -T % C
        if state == "first":  # every chunk reads S_[0]
            s = states[:, :1].expand_as(states)
        elif state == "previous":  # chunk c reads the state at (bh·N + c − 1): S_[c−1], one back
            flat = torch.cat([torch.full_like(states[:1, 0], float("nan"))[None],
                              states.reshape(1, BH * N, *states.shape[2:])], dim=1)
            s = flat[0, : BH * N].view_as(states)
        else:
            s = states
        qc, kc, uc = (F.pad(x, (0, 0, 0, pad)).view(BH, N, C, -1) for x in (q, k, u_new))
        if nan_u_past_T and pad:  # U' loaded without a row mask: the last head's rows t ≥ T are NaN
            uc = uc.clone()
            uc[-1, -1, C - pad:] = float("nan")
        m = mask(C)
        o = qc @ s + (qc @ kc.mT).masked_fill(~m, 0.0) @ uc
        return o.reshape(BH, N * C, -1)[:, :T]

    return fn


def _output_cases(g: torch.Generator) -> list[Case]:
    def case(BH, T, Dk, Dv, C, label):
        N = -(-T // C)
        q = torch.randn(BH, T, Dk, generator=g)
        k = F.normalize(torch.randn(BH, T, Dk, generator=g), dim=-1)
        states = torch.randn(BH, N, Dk, Dv, generator=g)
        u_new = torch.randn(BH, T, Dv, generator=g)
        return Case((q, k, states, u_new, C), label=f"B·H={BH}, T={T}, Dk={Dk}, Dv={Dv}, C={C}: {label}")

    return [
        case(1, 16, 16, 16, 16, "one whole chunk, nothing masked"),
        case(2, 64, 16, 32, 16, "four whole chunks, two heads: each chunk its own state"),
        case(2, 37, 16, 16, 16, "the last chunk has 5 tokens"),
        case(3, 50, 20, 12, 16, "Dk = 20 and Dv = 12 padded to 32 and 16, last chunk partial"),
        case(2, 70, 32, 24, 32, "C = 32, the last chunk has 6 tokens"),
    ]


def _launch_output(kernel):
    """The learner's kernel as a function of a case's arguments: launched under the interpreter
    with tensors inside NaN margins; raises (so the check reports it) if it stored outside ``o``."""

    def launch(q, k, states, u_new, C):
        from ..kernels.runtime import tile_size

        BH, T, Dk = q.shape
        Dv, N = u_new.shape[-1], states.shape[1]
        margins = NanMargins()
        q_, k_, s_, u_ = (margins.place(x) for x in (q, k, states, u_new))
        o = margins.place(torch.full((BH, T, Dv), float("nan")), output=True)
        interpret(kernel, (N, BH), q_, k_, s_, u_, o, T, Dk, Dv, N, BC=C, BK=tile_size(Dk),
                  BV=tile_size(Dv))
        outside = margins.stored_outside()
        if outside:
            raise RuntimeError(
                f"your kernel stored {outside} values outside o (past its last row or before its "
                "first): the store needs the mask m_t[:, None] & m_v[None, :], so that the padded "
                "rows t ≥ T of the last chunk and the padded columns d ≥ Dv are not written")
        return o.clone()

    return launch


_OUTPUT_EXERCISE = register(Exercise(
    id="kernel.output_stage",
    title="the output stage as a Triton kernel",
    signature="output_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, "
              "BK: tl.constexpr, BV: tl.constexpr), one program per (chunk, head); checked with "
              "checks.ch09_kernel.check_output_kernel(output_kernel)",
    reference=output_stage,
    make_cases=_output_cases,
    chapter=9,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("no_causal_mask", _output_variant(mask=lambda C: torch.ones(C, C, dtype=torch.bool)),
                "every token of the chunk sees the later ones: keep only j ≤ i of Q_[c] K_[c]ᵀ, "
                "tl.where(o_i[:, None] >= o_i[None, :], scores, 0.0), before the product with U'."),
        Mistake("strict_mask", _output_variant(mask=lambda C: torch.ones(C, C, dtype=torch.bool).tril(-1)),
                "your mask drops the diagonal: o_t reads the state after token t has written, so "
                "j = i belongs in the mask (>=, not >)."),
        Mistake("first_state_every_chunk", _output_variant(state="first"),
                "every chunk uses S_[0]: the state of chunk i_c starts at "
                "states + (i_bh·NT + i_c)·Dk·Dv; you left out i_c."),
        Mistake("previous_chunk_state", _output_variant(state="previous"),
                "your state is one chunk behind: chunk c needs S_[c], the state it starts from, at "
                "index i_bh·NT + i_c of states (not i_c − 1; the state pass stored S_[c] before "
                "updating it)."),
        Mistake("u_new_without_row_mask", _output_variant(nan_u_past_T=True),
                "the padded rows t ≥ T of U' are loaded without a mask: the causal mask zeroes "
                "their scores, but 0 · NaN (or 0 · inf) is NaN. Load U' with mask=m_t[:, None] & "
                "m_v[None, :] and other=0.0."),
    ],
    hint="o_t = i_c·BC + o_i; load Q_[c], K_[c] ([BC, BK]), S_[c] from states + (i_bh·NT + i_c)·Dk·Dv "
         "+ o_k[:, None]·Dv + o_v[None, :] ([BK, BV]) and U'_[c] ([BC, BV]), each masked with "
         "other=0.0; o = tl.dot(q, S) + tl.dot(tl.where(o_i[:, None] >= o_i[None, :], "
         "tl.dot(q, tl.trans(k)), 0.0), u); store with mask m_t[:, None] & m_v[None, :].",
))


def check_output_kernel(kernel, *, verbose: bool = True) -> CheckResult:
    """Run the learner's output-stage kernel under the Triton interpreter on every case of
    ``kernel.output_stage`` and report (case, distance, hint), as :func:`tinyk3.checks.run` does.
    Never raises because of the kernel (a compile error, NaN, a store outside ``o`` are reported);
    without Triton it reports that and how to install it."""
    global tl
    from ..kernels import runtime

    if runtime.AVAILABLE:
        import triton.language as tl  # noqa: F811 (the module's name for the solution kernel)
    return check_kernel(_OUTPUT_EXERCISE, _launch_output, kernel, verbose)


def output_kernel_solution(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr):
    """A solution of ``kernel.output_stage`` (what the tests and the chapter check against)."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    o_i = tl.arange(0, BC)
    o_t = i_c * BC + o_i
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_t, m_k, m_v = o_t < T, o_k < Dk, o_v < Dv
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_q = tl.load(q + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk, other=0.0)
    p_s = states + (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
    b_s = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0)  # S_[c]
    b_u = tl.load(u_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], mask=m_tv, other=0.0)
    b_sc = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")  # Q_[c] K_[c]ᵀ
    b_sc = tl.where(o_i[:, None] >= o_i[None, :], b_sc, 0.0)  # Ω_[c] = ... ⊙ M
    b_o = tl.dot(b_q, b_s, input_precision="ieee") + tl.dot(b_sc, b_u, input_precision="ieee")
    tl.store(o + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], b_o, mask=m_tv)

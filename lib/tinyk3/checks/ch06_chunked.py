"""Chapter 6 exercises: chunked linear attention, and its flop count."""

from __future__ import annotations

import torch

from .. import cost
from ..ops import linear_attention as la
from .core import Case, Exercise, Mistake, register

# -- chunked.linear_attention ---------------------------------------------------------------------


def chunked_linear_attention(q, k, v, chunk_size):
    """Reference: ``O_c = Q_c S_c + (Q_c K_cᵀ ⊙ M) V_c``, ``S_{c+1} = S_c + K_cᵀ V_c``, ``S_0 = 0``,
    no normaliser; any ``T`` (the last chunk may be short). Returns ``o [B, H, T, Dv]``."""
    return la.chunked(q, k, v, chunk_size=chunk_size)[0]


def _chunk_loop(q, k, v, C, *, read_after_write=False, mask_diagonal=0, masked=True,
                accumulate=True, inter_chunk=True, keep_remainder=True):
    """The chunk loop with one thing changed: each keyword switches on a typical mistake."""
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])  # [B, H, Dk, Dv]
    outs = []
    stop = T if keep_remainder else T - T % C
    for start in range(0, stop, C):
        Qc, Kc, Vc = (x[:, :, start : start + C] for x in (q, k, v))  # [B, H, n, D], n <= C
        kv = Kc.transpose(-1, -2) @ Vc  # K_cᵀ V_c  [B, H, Dk, Dv]
        if read_after_write:
            S = S + kv
        scores = Qc @ Kc.transpose(-1, -2)  # [B, H, n, n]
        if masked:
            scores = scores.tril(mask_diagonal)
        o = scores @ Vc
        if inter_chunk:
            o = o + Qc @ S
        outs.append(o)
        if not read_after_write:
            S = S + kv if accumulate else kv
    if not outs:
        return v.new_zeros(B, H, 0, v.shape[-1])
    return torch.cat(outs, dim=2)


def _la_cases(g: torch.Generator) -> list[Case]:
    def case(B, H, T, Dk, Dv, C, label, dtype=torch.float32):
        q, k = (0.5 * torch.randn(B, H, T, Dk, generator=g, dtype=dtype) for _ in range(2))
        v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
        return Case((q, k, v, C), label=f"B={B}, H={H}, T={T}, Dk={Dk}, Dv={Dv}, C={C}: {label}")

    return [
        case(1, 2, 16, 8, 8, 4, "T a multiple of C, 4 chunks"),
        case(2, 1, 10, 4, 6, 4, "T not a multiple of C: the last chunk has 2 tokens"),
        case(1, 1, 7, 5, 5, 1, "C = 1: the recurrence"),
        case(1, 2, 9, 6, 3, 16, "C > T: a single, short chunk"),
        case(2, 2, 12, 8, 8, 12, "C = T: one chunk, the parallel form"),
        case(1, 1, 37, 8, 8, 8, "float64, 5 chunks, the last one of 5 tokens: keep the dtype",
             dtype=torch.float64),
    ]


register(Exercise(
    id="chunked.linear_attention",
    title="chunked linear attention",
    signature="chunked_linear_attention(q, k, v, chunk_size) -> o [B, H, T, Dv]",
    reference=chunked_linear_attention,
    make_cases=_la_cases,
    chapter=6,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("no_inter_chunk", lambda q, k, v, C: _chunk_loop(q, k, v, C, inter_chunk=False),
                "each chunk sees only itself: the term Q_c S_c, which brings in every earlier "
                "chunk through the state, is missing (or the state is never updated). Add Q_c @ S "
                "to the masked block, then S = S + K_cᵀ V_c."),
        Mistake("read_after_write", lambda q, k, v, C: _chunk_loop(q, k, v, C, read_after_write=True),
                "the current chunk is counted twice: you added K_cᵀ V_c to the state before "
                "reading Q_c S, and the masked block adds the same pairs again. Read the state "
                "first (O_c = Q_c S_c + block), then update it."),
        Mistake("no_mask", lambda q, k, v, C: _chunk_loop(q, k, v, C, masked=False),
                "tokens see the later tokens of their own chunk: the scores Q_c K_cᵀ inside a "
                "chunk need the causal mask (`.tril()`), as in chapter 3's parallel form."),
        Mistake("strict_mask", lambda q, k, v, C: _chunk_loop(q, k, v, C, mask_diagonal=-1),
                "a token does not see itself: your mask inside the chunk drops the diagonal "
                "(tril(-1)). Keep j <= i: `.tril()` with diagonal 0."),
        Mistake("previous_chunk_only", lambda q, k, v, C: _chunk_loop(q, k, v, C, accumulate=False),
                "the state holds only the chunk just before: you replaced S by K_cᵀ V_c instead "
                "of adding to it. The state sums every earlier chunk: S = S + K_cᵀ V_c."),
        Mistake("drops_remainder", lambda q, k, v, C: _chunk_loop(q, k, v, C, keep_remainder=False),
                "your output is shorter than the input: `range(T // C)` leaves out the last "
                "T mod C tokens (the post's listing has this bug). Loop over ⌈T/C⌉ chunks "
                "(`range(0, T, C)`; a slice past the end is just short), or pad the last one."),
    ],
    hint="for each chunk: o = Q_c @ S + (Q_c @ K_cᵀ).tril() @ V_c, then S = S + K_cᵀ @ V_c, "
         "starting from S = 0; cover every token, including a short last chunk.",
))


# -- chunked.flops --------------------------------------------------------------------------------


def chunked_flops(T, D, C):
    """Reference: matmul flops per head of ``la.chunked`` (Dk = Dv = D, last chunk padded)."""
    return cost.chunked_linear_attention_flops(int(T), int(D), int(C)).matmul


def _n(T, C):
    return -(-T // C)


def _flops_cases(g: torch.Generator) -> list[Case]:
    shapes = [(4096, 64, 64, "a GPU-like chunk size"), (4096, 128, 1, "C = 1"),
              (1000, 64, 64, "T not a multiple of C: the last chunk is padded"),
              (100, 16, 128, "C > T: one padded chunk"), (8192, 128, 8192, "C = T"),
              (2048, 32, 16, "D > C")]
    T = int(torch.randint(100, 5000, (1,), generator=g))
    shapes.append((T, 48, 24, "random T"))
    return [Case((T, D, C), label=f"T={T}, D={D}, C={C}: {label}") for T, D, C, label in shapes]


def _exact_last_chunk(T, D, C):
    sizes = [min(C, T - s) for s in range(0, T, C)]
    return sum(4 * n * D * D + 4 * n * n * D for n in sizes)


register(Exercise(
    id="chunked.flops",
    title="the flops of chunked linear attention",
    signature="chunked_flops(T, D, C) -> int",
    reference=chunked_flops,
    make_cases=_flops_cases,
    chapter=6,
    mistakes=[
        Mistake("multiply_adds", lambda T, D, C: _n(T, C) * (2 * C * D * D + 2 * C * C * D),
                "your count is half: you counted one operation per multiply-add (as the post's "
                "2LD² + 2LCD does). A product [m, k] @ [k, n] is 2·m·k·n flops."),
        Mistake("one_state_product", lambda T, D, C: _n(T, C) * (2 * C * D * D + 4 * C * C * D),
                "one of the two products with the state is missing: each chunk reads the state "
                "(Q_c S, 2·C·D² flops) AND writes into it (K_cᵀ V_c, another 2·C·D²)."),
        Mistake("one_diagonal_product", lambda T, D, C: _n(T, C) * (4 * C * D * D + 2 * C * C * D),
                "one of the two diagonal-block products is missing: Q_c K_cᵀ (2·C²·D) and the "
                "masked scores times V_c (another 2·C²·D)."),
        Mistake("c_squared_per_token", lambda T, D, C: 4 * T * D * D + 4 * T * C * C * D,
                "you charged a whole C × C block to every token: there are ⌈T/C⌉ blocks, not T, "
                "so the diagonal costs ⌈T/C⌉·4·C²·D ≈ 4·T·C·D."),
        Mistake("floor_chunks", lambda T, D, C: (T // C) * (4 * C * D * D + 4 * C * C * D),
                "T // C leaves out the last, partial chunk (zero chunks when C > T): there are "
                "⌈T/C⌉ chunks, `-(-T // C)` or `math.ceil(T / C)`."),
        Mistake("exact_last_chunk", _exact_last_chunk,
                "you counted the short last chunk at its true length; la.chunked pads it with zero "
                "rows to C and multiplies them too, so count ⌈T/C⌉ full chunks."),
        Mistake("closed_form_unpadded", lambda T, D, C: 4 * T * D * D + 4 * T * C * D,
                "4·T·D² + 4·T·C·D is exact only when C divides T; la.chunked pads the last chunk "
                "to C rows and multiplies the zeros too, so count ⌈T/C⌉ full chunks."),
        Mistake("counts_scan", lambda T, D, C: _n(T, C) * (4 * C * D * D + 4 * C * C * D + D * D),
                "you added the scan's D² additions per chunk: count only the four matrix products."),
    ],
    hint="per chunk of C rows: Q_c S and K_cᵀ V_c (2·C·D² each), Q_c K_cᵀ and (…) V_c (2·C²·D "
         "each); times ⌈T/C⌉ chunks.",
))

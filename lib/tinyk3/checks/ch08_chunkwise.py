"""Chapter 8 exercises: the chunkwise delta rule, and its flop count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cost
from ..ops import delta_rule as dr
from ..ops import wy
from .core import Case, Exercise, Mistake, register

# -- chunkwise.delta_rule -------------------------------------------------------------------------


def chunkwise_delta_rule(q, k, v, beta, chunk_size):
    """Reference: the chunkwise delta rule from ``S_0 = 0``. Per chunk of ``C`` tokens, with
    ``T_c = (I + tril(diag(β) K_c K_cᵀ, −1))⁻¹ diag(β)``, ``W_c = T_c K_c``, ``U_c = T_c V_c``:
    ``U'_c = U_c − W_c S_c``, ``O_c = Q_c S_c + (Q_c K_cᵀ ⊙ M) U'_c``, ``S_{c+1} = S_c + K_cᵀ U'_c``.
    Any ``T`` (the last chunk may be short). Returns ``(o [B, H, T, Dv], S [B, H, Dk, Dv])``."""
    return dr.chunked(q, k, v, beta, chunk_size=chunk_size)


def _chunk_loop(q, k, v, beta, C, *, deltas=True, state_deltas=True, read_after_write=False,
                mask_diagonal=0, masked=True, inter_chunk=True, keep_remainder=True):
    """The chunk loop with one thing changed: each keyword switches on a typical mistake."""
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])  # S_0  [B, H, Dk, Dv]
    outs = []
    stop = T if keep_remainder else T - T % C
    for start in range(0, stop, C):
        Qc, Kc, Vc = (x[:, :, start : start + C] for x in (q, k, v))  # [B, H, n, D], n <= C
        Tc = wy.ut_transform(Kc, beta[:, :, start : start + C])  # [B, H, n, n]
        W, U = Tc @ Kc, Tc @ Vc
        U_new = U - W @ S  # U'_c = U_c − W_c S_c
        S_next = S + Kc.transpose(-1, -2) @ (U_new if state_deltas else U)
        scores = Qc @ Kc.transpose(-1, -2)  # [B, H, n, n]
        if masked:
            scores = scores.tril(mask_diagonal)
        o = scores @ (U_new if deltas else U)
        if inter_chunk:
            o = o + Qc @ (S_next if read_after_write else S)
        outs.append(o)
        S = S_next
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1])
    return o, S


def _dr_cases(g: torch.Generator) -> list[Case]:
    def case(B, H, T, Dk, Dv, C, label, dtype=torch.float32):
        q = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1)
        k = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1)
        v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
        beta = torch.rand(B, H, T, generator=g, dtype=dtype)
        return Case((q, k, v, beta, C), label=f"B={B}, H={H}, T={T}, Dk={Dk}, Dv={Dv}, C={C}: {label}")

    return [
        case(1, 2, 16, 8, 8, 4, "T a multiple of C, 4 chunks"),
        case(2, 1, 10, 4, 6, 4, "T not a multiple of C: the last chunk has 2 tokens"),
        case(1, 1, 7, 5, 5, 1, "C = 1: the recurrence"),
        case(1, 2, 9, 6, 3, 16, "C > T: a single, short chunk"),
        case(2, 2, 24, 4, 5, 8, "T > Dk: keys must overlap, so the deltas matter"),
        case(1, 1, 37, 8, 8, 8, "float64, 5 chunks, the last one of 5 tokens: keep the dtype",
             dtype=torch.float64),
    ]


register(Exercise(
    id="chunkwise.delta_rule",
    title="the chunkwise delta rule",
    signature="chunkwise_delta_rule(q, k, v, beta, chunk_size) -> (o [B, H, T, Dv], S [B, H, Dk, Dv])",
    reference=chunkwise_delta_rule,
    make_cases=_dr_cases,
    chapter=8,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("u_not_u_prime", lambda *a: _chunk_loop(*a, deltas=False, state_deltas=False),
                "you used U_c = T_c V_c where the deltas U'_c = U_c − W_c S_c belong: U_c are the "
                "deltas of a chunk that starts from an empty state. Subtract what the state already "
                "holds, W_c S_c, before using them in the output and in the state update."),
        Mistake("state_with_u", lambda *a: _chunk_loop(*a, state_deltas=False),
                "the outputs use U'_c but the state update adds K_cᵀ U_c: the state then never "
                "forgets what the chunk overwrote. Update with the same deltas: "
                "S_{c+1} = S_c + K_cᵀ U'_c."),
        Mistake("output_with_u", lambda *a: _chunk_loop(*a, deltas=False),
                "the state update uses U'_c but the masked block multiplies U_c: the block must "
                "add the deltas the tokens actually wrote, (Q_c K_cᵀ ⊙ M) U'_c."),
        Mistake("read_after_write", lambda *a: _chunk_loop(*a, read_after_write=True),
                "the chunk's own writes are counted twice: you updated the state before reading "
                "Q_c S, and the masked block adds the same writes again. Compute O_c from S_c, the "
                "state at the START of the chunk, then update it."),
        Mistake("no_mask", lambda *a: _chunk_loop(*a, masked=False),
                "tokens see the later tokens of their own chunk: the scores Q_c K_cᵀ need the "
                "causal mask (`.tril()`), as in chapter 6."),
        Mistake("strict_mask", lambda *a: _chunk_loop(*a, mask_diagonal=-1),
                "a token does not see its own write: your mask drops the diagonal (tril(-1)). "
                "o_t = q_t S_t reads the state AFTER token t wrote, so keep j <= i: `.tril()`."),
        Mistake("no_inter_chunk", lambda *a: _chunk_loop(*a, inter_chunk=False),
                "each chunk sees only itself: the term Q_c S_c, which brings in every earlier "
                "chunk through the state, is missing. O_c = Q_c S_c + (Q_c K_cᵀ ⊙ M) U'_c."),
        Mistake("drops_remainder", lambda *a: _chunk_loop(*a, keep_remainder=False),
                "your output is shorter than the input: `range(T // C)` leaves out the last "
                "T mod C tokens, and the final state misses them too. Loop over ⌈T/C⌉ chunks "
                "(`range(0, T, C)`; a slice past the end is just short, and ut_transform takes a "
                "short chunk)."),
    ],
    hint="S = 0; for each chunk (the last may be short): T = wy.ut_transform(K_c, β_c); W, U = T K_c, "
         "T V_c; U' = U − W S; o_c = Q_c S + (Q_c K_cᵀ).tril() @ U'; then S = S + K_cᵀ U'. Return "
         "(torch.cat(outputs, dim=2), S).",
))


# -- chunkwise.flops ------------------------------------------------------------------------------


def chunked_delta_rule_flops(T, D, C):
    """Reference: matmul flops per head of the chunked delta rule (``Dk = Dv = D``, ``⌈T/C⌉``
    chunks of ``C`` rows, the last one padded), the count of :func:`tinyk3.cost.chunked_delta_rule_flops`."""
    return float(cost.chunked_delta_rule_flops(int(T), int(D), int(C)))


def _n(T, C):
    return -(-T // C)


def _per_chunk(D, C, *, inverse=True, wy_products=2, state_products=3):
    """Flops of one chunk, with parts switchable to build the typical mistakes: K Kᵀ, the
    inverse, T K and T V, Q Kᵀ, the three products with the state, the masked block times U'."""
    return (2 * C * C * D + inverse * C**3 / 3 + wy_products * 2 * C * C * D + 2 * C * C * D
            + state_products * 2 * C * D * D + 2 * C * C * D)


def _flops_cases(g: torch.Generator) -> list[Case]:
    shapes = [(4096, 64, 64, "a GPU-like chunk size"), (4096, 128, 1, "C = 1"),
              (1000, 64, 64, "T not a multiple of C: the last chunk is padded"),
              (100, 16, 128, "C > T: one padded chunk"), (2048, 32, 16, "D > C"),
              (8192, 128, 128, "Kimi Linear's head size, C = 128")]
    T = int(torch.randint(100, 5000, (1,), generator=g))
    shapes.append((T, 48, 24, "random T"))
    return [Case((T, D, C), label=f"T={T}, D={D}, C={C}: {label}") for T, D, C, label in shapes]


register(Exercise(
    id="chunkwise.flops",
    title="the flops of the chunked delta rule",
    signature="chunked_delta_rule_flops(T, D, C) -> float",
    reference=chunked_delta_rule_flops,
    make_cases=_flops_cases,
    chapter=8,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("multiply_adds", lambda T, D, C: _n(T, C) * _per_chunk(D, C) / 2,
                "your count is half: you counted one operation per multiply-add. A product "
                "[m, k] @ [k, n] is 2·m·k·n flops (and the triangular inverse C³/3)."),
        Mistake("linear_attention_state", lambda T, D, C: _n(T, C) * _per_chunk(D, C, state_products=2),
                "one product with the state is missing: besides Q_c S_c and K_cᵀ U'_c, the delta "
                "rule reads the state at the chunk's keys, W_c S_c (2·C·D² more per chunk)."),
        Mistake("one_c2d_product_missing", lambda T, D, C: _n(T, C) * _per_chunk(D, C, wy_products=1),
                "one product of 2·C²·D flops is missing. There are five per chunk: K_c K_cᵀ (for the "
                "UT transform), Q_c K_cᵀ (the scores), W_c = T_c K_c, U_c = T_c V_c and "
                "(Q_c K_cᵀ ⊙ M) U'_c."),
        Mistake("no_inverse", lambda T, D, C: _n(T, C) * _per_chunk(D, C, inverse=False),
                "the UT transform's triangular inverse is missing: inverting a C × C unit "
                "lower-triangular matrix costs C³/3 flops per chunk."),
        Mistake("floor_chunks", lambda T, D, C: (T // C) * _per_chunk(D, C),
                "T // C leaves out the last, partial chunk (zero chunks when C > T): there are "
                "⌈T/C⌉ chunks, `-(-T // C)` or `math.ceil(T / C)`."),
        Mistake("closed_form_unpadded", lambda T, D, C: 6 * T * D * D + 10 * T * C * D + T * C * C / 3,
                "6·T·D² + 10·T·C·D + T·C²/3 is exact only when C divides T; the chunked form pads "
                "the last chunk to C rows and multiplies the zeros too, so count ⌈T/C⌉ full chunks."),
        Mistake("chapter_6_count", lambda T, D, C: _n(T, C) * (4 * C * D * D + 4 * C * C * D),
                "that is chapter 6's count for linear attention. The delta rule adds K_c K_cᵀ, the "
                "inverse (C³/3), W_c = T_c K_c, U_c = T_c V_c and W_c S_c."),
    ],
    hint="per chunk of C rows: K_c K_cᵀ, Q_c K_cᵀ, T_c K_c, T_c V_c, (Q_c K_cᵀ ⊙ M) U'_c (2·C²·D "
         "each), the inverse (C³/3), W_c S_c, Q_c S_c, K_cᵀ U'_c (2·C·D² each); times ⌈T/C⌉.",
))

"""Cost models: floating-point operations of the sequence-mixing forms, counted from the code.

Convention: a matrix product ``[m, k] @ [k, n]`` costs ``2·m·k·n`` flops (one multiply and one
add per term), the convention of ``tinyk3.bench.matmul_flops`` and of FLOP/s figures, and of
``torch.utils.flop_counter``. Counts are per head; multiply by ``B·H`` for a layer.

Chunked linear attention (chapter 6), for chunk ``c`` with ``C`` rows ``Q_c, K_c, V_c``:

    O_c     = Q_c S_c + (Q_c K_cᵀ ⊙ M) V_c
    S_{c+1} = S_c + K_cᵀ V_c

splits into

* **state** work, ``Q_c S_c`` and ``K_cᵀ V_c``: ``2·C·Dk·Dv`` each, ``4·T·Dk·Dv`` over the sequence
  (independent of ``C``);
* **diagonal** blocks, ``Q_c K_cᵀ`` (``2·C²·Dk``) and ``(…) V_c`` (``2·C²·Dv``): ``2·T·C·(Dk + Dv)``,
  counted dense (PyTorch multiplies the masked half too);
* the **scan** that turns the per-chunk ``K_cᵀ V_c`` into every chunk's starting state: one
  ``Dk × Dv`` addition per chunk.

For ``Dk = Dv = D`` and ``T`` a multiple of ``C`` that is ``4TD² + 4TCD`` matmul flops
plus ``TD²/C`` additions. :func:`tinyk3.ops.linear_attention.chunked` pads the last chunk to ``C``
rows, so it does ``⌈T/C⌉`` chunks of full work; the counts here are of that work.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._validate import positive_int

__all__ = [
    "FlopCount",
    "matmul",
    "n_chunks",
    "chunked_linear_attention_flops",
    "recurrent_linear_attention_flops",
    "parallel_linear_attention_flops",
    "chunked_delta_rule_flops",
    "chunk_products",
    "sdpa_flops",
]


@dataclass(frozen=True)
class FlopCount:
    """Flops of one head, split by where they are spent.

    ``state``: products with the ``Dk × Dv`` state (reading it, writing into it);
    ``diagonal``: the ``C × C`` score blocks on the diagonal of the attention matrix and their
    product with the values; ``scan``: additions that carry the state from chunk to chunk;
    ``sequential_steps``: how many steps must run one after another (the rest is parallel).
    """

    state: int
    diagonal: int
    scan: int
    sequential_steps: int

    @property
    def matmul(self) -> int:
        """Flops in matrix products: ``state + diagonal``."""
        return self.state + self.diagonal

    @property
    def total(self) -> int:
        return self.state + self.diagonal + self.scan


def _positive_int(x, name: str) -> int:
    return positive_int(x, name, "cost")


def matmul(m: int, k: int, n: int) -> int:
    """Flops of ``[m, k] @ [k, n]``: ``2·m·k·n``."""
    return 2 * m * k * n


def n_chunks(T: int, C: int) -> int:
    """Chunks of ``C`` tokens that cover ``T`` tokens: ``⌈T / C⌉`` (the last may be short)."""
    return -(-_positive_int(T, "T") // _positive_int(C, "C"))


def chunked_linear_attention_flops(T: int, D: int, C: int, *, Dv: int | None = None) -> FlopCount:
    """Flops of :func:`tinyk3.ops.linear_attention.chunked` per head (``D`` = ``Dk``), without the
    normaliser: ``⌈T/C⌉`` chunks of ``C`` rows (the last one zero-padded), each doing
    ``Q_c S_c`` and ``K_cᵀ V_c`` (state), ``Q_c K_cᵀ`` and ``(…) V_c`` (diagonal), and one
    ``Dk × Dv`` addition of the scan. ``C = 1`` is the recurrence, ``C ≥ T`` one quadratic block.
    """
    Dk = _positive_int(D, "D")
    Dv = Dk if Dv is None else _positive_int(Dv, "Dv")
    N = n_chunks(T, C)
    state = N * (matmul(C, Dk, Dv) + matmul(Dk, C, Dv))  # Q_c S_c, K_cᵀ V_c
    diagonal = N * (matmul(C, Dk, C) + matmul(C, C, Dv))  # Q_c K_cᵀ, (Q_c K_cᵀ ⊙ M) V_c
    return FlopCount(state=state, diagonal=diagonal, scan=N * Dk * Dv, sequential_steps=N)


def recurrent_linear_attention_flops(T: int, D: int, *, Dv: int | None = None) -> FlopCount:
    """Flops of the token loop (:func:`tinyk3.ops.linear_attention.recurrent`) per head, without
    the normaliser: per token the write ``S += k_tᵀ v_t`` (a multiply and an add per entry,
    ``2·Dk·Dv``) and the read ``q_t S_t`` (``2·Dk·Dv``). All of it is state work, in ``T``
    sequential steps.
    """
    T = _positive_int(T, "T")
    Dk = _positive_int(D, "D")
    Dv = Dk if Dv is None else _positive_int(Dv, "Dv")
    return FlopCount(state=T * 4 * Dk * Dv, diagonal=0, scan=0, sequential_steps=T)


def parallel_linear_attention_flops(T: int, D: int, *, Dv: int | None = None) -> FlopCount:
    """Flops of the masked quadratic form (:func:`tinyk3.ops.linear_attention.parallel`) per head,
    without the normaliser: ``Q Kᵀ`` and ``(Q Kᵀ ⊙ M) V``, dense (``2·T²·(Dk + Dv)``), plus the
    state work ``Q S_0`` and ``S_T = S_0 + Kᵀ V`` (``4·T·Dk·Dv``), which a model that needs no
    initial or final state could skip. One step: nothing is sequential. Equals
    :func:`chunked_linear_attention_flops` at ``C = T`` but for the one scan addition.
    """
    T = _positive_int(T, "T")
    Dk = _positive_int(D, "D")
    Dv = Dk if Dv is None else _positive_int(Dv, "Dv")
    state = matmul(T, Dk, Dv) + matmul(Dk, T, Dv)
    diagonal = matmul(T, Dk, T) + matmul(T, T, Dv)
    return FlopCount(state=state, diagonal=diagonal, scan=0, sequential_steps=1)


def chunked_delta_rule_flops(T: int, Dk: int, C: int, *, Dv: int | None = None) -> float:
    """Matmul flops of the chunked delta rule, per head (counted from ``ops.delta_rule.chunked``).

    Per chunk of ``C`` tokens: ``K Kᵀ`` (2C²Dk), inverting the unit triangular ``C × C``
    matrix (C³/3), ``W = T K`` and ``U = T V`` (2C²(Dk + Dv)), ``Q Kᵀ`` (2C²Dk), ``W S``,
    ``Q S`` and ``Kᵀ U'`` (2C·Dk·Dv each) and ``(QKᵀ ⊙ M) U'`` (2C²Dv). Dense counts: the
    masked products do the full work in PyTorch. For Dk = Dv = D and T a multiple of C this sums to
    6TD² + 10TCD + TC²/3 per head (summing the terms above over T/C chunks).
    """
    Dk = _positive_int(Dk, "Dk")
    Dv = Dk if Dv is None else _positive_int(Dv, "Dv")
    n_chunks = -(-_positive_int(T, "T") // _positive_int(C, "C"))
    per_chunk = (2 * C * C * Dk + C**3 / 3 + 2 * C * C * (Dk + Dv) + 2 * C * C * Dk
                 + 3 * 2 * C * Dk * Dv + 2 * C * C * Dv)
    return n_chunks * per_chunk


def chunk_products(rule: str, C: int, D: int) -> list[tuple[str, int, int, int]]:
    """The matrix products ``(name, m, k, n)`` one forward pass issues per chunk of ``C`` tokens
    and per head (``Dk = Dv = D``), as fla's forward kernels issue them (chapter 11).

    ``"DPLR"`` (``fla/ops/generalized_delta_rule/dplr``): four ``C × C`` scores ``A_qk, A_qb,
    A_ak, A_ab`` (``chunk_A_fwd``), the inverse of ``I + A_ab`` multiplied into ``A_ak`` and
    into the decayed ``a``, the state pass's ``w S``, ``k_gᵀ v`` and ``b_gᵀ v₂`` (``chunk_h_fwd``)
    and the outputs' ``q_g S``, ``A_qk v`` and ``A_qb v₂`` (``chunk_o_fwd``). ``"KDA"``
    (``fla/ops/kda``): two scores ``A_kk, A_qk`` (``chunk_intra``), since both low-rank vectors
    of its transition are the key, then chapter 8's products. The triangular inverse (``C³/3``
    flops, both rules) is not a product and is not listed.
    """
    C, D = _positive_int(C, "C"), _positive_int(D, "D")
    if rule == "DPLR":
        return ([(f"A_{x}", C, D, C) for x in ("qk", "qb", "ak", "ab")]
                + [("A_ab⁻¹ A_ak", C, C, C), ("w = A_ab⁻¹ a_g", C, C, D),
                   ("u = (A_ab⁻¹ A_ak) v", C, C, D)]
                + [("w S", C, D, D), ("k_gᵀ v", D, C, D), ("b_gᵀ v₂", D, C, D)]
                + [("q_g S", C, D, D), ("A_qk v", C, C, D), ("A_qb v₂", C, C, D)])
    if rule == "KDA":
        return ([("A_kk", C, D, C), ("A_qk", C, D, C)]
                + [("w = 𝒯 (K⊙Γ)", C, C, D), ("u = 𝒯 V", C, C, D)]
                + [("w S", C, D, D), ("k_gᵀ u'", D, C, D)]
                + [("q_g S", C, D, D), ("A_qk u'", C, C, D)])
    raise ValueError(f"chunk_products: rule must be 'DPLR' or 'KDA', got {rule!r}")


def sdpa_flops(T: int, D: int) -> float:
    """Matmul flops of causal softmax attention per head: ``Q Kᵀ`` and ``P V``, the lower half
    of each (``2 · 2T²D / 2``; what a causal flash kernel computes, up to the diagonal blocks)."""
    return 2.0 * _positive_int(T, "T") ** 2 * _positive_int(D, "D")

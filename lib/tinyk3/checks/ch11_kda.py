"""Chapter 11 exercises: one step of Kimi Delta Attention, and the decayed key scores of a chunk."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .core import Case, Exercise, Mistake, register

# -- kda.step -------------------------------------------------------------------------------------


def kda_step(S, k, v, beta, g):
    """Reference: one KDA step, forget (row by row) before error::

        S' = Diag(α) S,  α = exp(g) ∈ (0, 1]^Dk   (row d of S decays by α_d)
        S_new = S' + kᵀ β (v − k S')             (the delta rule, into what is left)

    ``S [B, H, Dk, Dv]``, ``k [B, H, Dk]``, ``v [B, H, Dv]``, ``beta [B, H]``, ``g [B, H, Dk]``."""
    S = torch.exp(g).unsqueeze(-1) * S  # Diag(α) S: one factor per row   [B, H, Dk, Dv]
    u = beta.unsqueeze(-1) * (v - _read(k, S))  # β (v − k S')         [B, H, Dv]
    return S + _outer(k, u)


def _read(k, S):
    return torch.einsum("bhk,bhkv->bhv", k, S)  # k S   [B, H, Dv]


def _outer(k, u):
    return k.unsqueeze(-1) * u.unsqueeze(-2)  # kᵀ u   [B, H, Dk, Dv]


def _delta(S, k, v, beta):
    return S + _outer(k, beta.unsqueeze(-1) * (v - _read(k, S)))  # chapter 5's step


def _rows(g):
    return torch.exp(g).unsqueeze(-1)  # α as a column: scales the rows of S   [B, H, Dk, 1]


def _step_cases(gen: torch.Generator) -> list[Case]:
    def case(B, H, Dk, Dv, label, *, low=-5.0, beta=None, dtype=torch.float32):
        S = torch.randn(B, H, Dk, Dv, generator=gen, dtype=dtype)
        k = F.normalize(torch.randn(B, H, Dk, generator=gen, dtype=dtype), dim=-1)
        v = torch.randn(B, H, Dv, generator=gen, dtype=dtype)
        b = (torch.rand(B, H, generator=gen, dtype=dtype) if beta is None
             else torch.full((B, H), beta, dtype=dtype))
        g = low * torch.rand(B, H, Dk, generator=gen, dtype=dtype)  # in (low, 0]
        return Case((S, k, v, b, g), label=f"B={B}, H={H}, Dk={Dk}, Dv={Dv}: {label}")

    return [
        case(2, 3, 8, 8, "gates in (−5, 0], a different one per channel"),
        case(1, 2, 6, 6, "Dk = Dv, mild gates in (−0.5, 0]", low=-0.5),
        case(2, 1, 6, 4, "Dk > Dv: the gate has Dk entries, one per row of S"),
        case(1, 2, 4, 10, "Dk < Dv"),
        case(2, 2, 8, 8, "β = 1: the decayed value at k is replaced", beta=1.0),
        case(1, 1, 5, 5, "β = 0: only the decay acts", beta=0.0),
        case(2, 2, 8, 6, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="kda.step",
    title="one step of Kimi Delta Attention",
    signature="kda_step(S [B, H, Dk, Dv], k [B, H, Dk], v [B, H, Dv], beta [B, H], g [B, H, Dk]) "
              "-> S_new [B, H, Dk, Dv]",
    reference=kda_step,
    make_cases=_step_cases,
    chapter=11,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("decay_after_write", lambda S, k, v, b, g: _rows(g) * _delta(S, k, v, b),
                "you decayed after the write: Diag(α)(S + kᵀ β (v − k S)) also shrinks the new "
                "write. KDA forgets first, then corrects into what is left: S' = Diag(α) S, "
                "S_new = S' + kᵀ β (v − k S')."),
        Mistake("decay_columns", lambda S, k, v, b, g: _delta(torch.exp(g).unsqueeze(-2) * S, k, v, b),
                "you scaled the columns of S (the value axis): exp(g)[..., None, :] * S. The gate "
                "has one entry per KEY channel, and channel d of the key addresses row d of S: "
                "Diag(α) S is exp(g)[..., :, None] * S (or exp(g).unsqueeze(-1) * S)."),
        Mistake("error_before_decay", lambda S, k, v, b, g: _rows(g) * S + _outer(
                    k, b.unsqueeze(-1) * (v - _read(k, S))),
                "your delta reads the state before the decay: β (v − k S) with the old S, then "
                "adds it to Diag(α) S. The delta must correct what the decayed state holds, "
                "β (v − k S') with S' = Diag(α) S, or the value at k is not replaced."),
        Mistake("transition_order", lambda S, k, v, b, g: _rows(g) * (S - _outer(k, _read(k, S)) * b[
                    ..., None, None]) + _outer(k, b.unsqueeze(-1) * v),
                "you applied the transition as Diag(α) (I − β kᵀk) S + β kᵀ v: the decay after "
                "the projection. With one gate per head (chapter 10) the two commute; with a gate "
                "per channel they do not. KDA is (I − β kᵀk) Diag(α) S + β kᵀ v: decay first."),
        Mistake("no_exp", lambda S, k, v, b, g: _delta(g.unsqueeze(-1) * S, k, v, b),
                "you multiplied the rows of S by g itself: g is the LOG decay (g ≤ 0); the decay "
                "factor is α = exp(g) ∈ (0, 1]."),
        Mistake("one_gate_per_head", lambda S, k, v, b, g: _delta(
                    torch.exp(g.mean(-1))[..., None, None] * S, k, v, b),
                "you used one decay for the whole head (the mean gate): that is chapter 10's "
                "Gated DeltaNet. KDA decays each row d of S by its own exp(g_d)."),
        Mistake("no_decay", lambda S, k, v, b, g: _delta(S, k, v, b),
                "the gate is ignored: that is the plain delta rule. Scale row d of S by exp(g_d) "
                "first: S' = exp(g).unsqueeze(-1) * S."),
    ],
    hint="S' = exp(g).unsqueeze(-1) * S (one factor per row, i.e. per key channel); "
         "u = β (v − k S') (k S' = einsum('bhk,bhkv->bhv', k, S')); return S' + kᵀ u "
         "(k.unsqueeze(-1) * u.unsqueeze(-2)).",
))


# -- kda.chunk_scores -----------------------------------------------------------------------------


def chunk_scores(k, g):
    """Reference: the decayed key scores of one chunk, ``A_ij = Σ_d k_id k_jd exp(G_id − G_jd)``
    for ``j < i`` and 0 on and above the diagonal, with ``G_i = Σ_{s ≤ i} g_s`` per channel.
    ``k, g [B, H, C, Dk]`` (``g ≤ 0``); returns ``Ω^kk [B, H, C, C]`` in ``k``'s dtype.

    Computed pair by pair in float64: ``G_i − G_j ≤ 0`` for ``j < i``, so every exponential is
    at most 1 (the pairs above the diagonal are never exponentiated)."""
    K, G = k.double(), g.double().cumsum(-2)
    A = _pairwise(K, G, strict=True)
    return A.to(k.dtype)


def _pairwise(K, G, *, strict, mask_after_exp=False):
    C = K.shape[-2]
    i = torch.arange(C, device=K.device)
    keep = (i[:, None] > i[None, :]) if strict else (i[:, None] >= i[None, :])
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # G_i − G_j   [B, H, C, C, Dk]
    if mask_after_exp:
        E = torch.exp(diff) * keep[..., None]
    else:
        E = torch.exp(torch.where(keep[..., None], diff, torch.full_like(diff, -torch.inf)))
    return torch.einsum("bhid,bhjd,bhijd->bhij", K, K, E)


def _naive(k, g, *, diagonal=-1):
    """The factorisation (K ⊙ Γ)(K ⊘ Γ)ᵀ in the inputs' dtype, then the mask."""
    G = g.cumsum(-2)
    A = (k * torch.exp(G)) @ (k * torch.exp(-G)).transpose(-1, -2)
    return A.tril(diagonal)


def _scores_cases(gen: torch.Generator) -> list[Case]:
    def case(B, H, C, Dk, label, *, low, const=False, dtype=torch.float32):
        k = F.normalize(torch.randn(B, H, C, Dk, generator=gen, dtype=dtype), dim=-1)
        if const:
            g = torch.full((B, H, C, Dk), low, dtype=dtype)
        else:
            g = low * torch.rand(B, H, C, Dk, generator=gen, dtype=dtype)  # in (low, 0]
        return Case((k, g), label=f"B={B}, H={H}, C={C}, Dk={Dk}: {label}")

    return [
        case(2, 2, 8, 4, "mild gates in (−0.5, 0]", low=-0.5),
        case(1, 3, 16, 8, "C = 16, gates in (−5, 0]", low=-5.0),
        case(1, 2, 7, 5, "C = 7, gates in (−2, 0]", low=-2.0),
        case(1, 2, 64, 8, "C = 64, every gate −5: exp(−G) reaches e^320", low=-5.0, const=True),
        case(2, 1, 32, 6, "C = 32, gates in (−5, 0]", low=-5.0),
        case(1, 1, 64, 16, "C = 64, gates in (−5, 0]", low=-5.0),
        case(1, 2, 64, 8, "float64, C = 64, every gate −5: keep the dtype", low=-5.0, const=True,
             dtype=torch.float64),
    ]


register(Exercise(
    id="kda.chunk_scores",
    title="the decayed key scores of one chunk",
    signature="chunk_scores(k [B, H, C, Dk], g [B, H, C, Dk]) -> Okk [B, H, C, C]",
    reference=chunk_scores,
    make_cases=_scores_cases,
    chapter=11,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("naive_factorisation", lambda k, g: _naive(k, g),
                "you factorised exp(G_i − G_j) = exp(G_i) · exp(−G_j): (K ⊙ exp(G)) @ "
                "(K ⊙ exp(−G))ᵀ. Over a chunk of strong gates exp(−G_j) overflows (float32 "
                "stops at e^88.7) and exp(G_i) underflows to 0, so entries become inf or NaN. "
                "Take the difference first: exp(G_i − G_j) pair by pair (a [C, C, Dk] tensor), "
                "which is ≤ 1 below the diagonal."),
        Mistake("with_diagonal", lambda k, g: _naive_safe(k, g, strict=False),
                "your Ω^kk has the diagonal: the scores go into the UT transform's strictly lower "
                "part, j < i. The diagonal Σ_d k_id² is not part of Ω^kk: mask with j < i "
                "(tril(·, −1))."),
        Mistake("no_mask", lambda k, g: _full(k, g),
                "Ω^kk has entries on and above the diagonal: keep only j < i (the earlier tokens), "
                "and 0 elsewhere."),
        Mistake("mask_after_exp", lambda k, g: _pairwise(k, g.cumsum(-2), strict=True,
                                                        mask_after_exp=True),
                "you exponentiated every pair, then multiplied by the mask. Above the diagonal "
                "G_i − G_j ≥ 0 and exp overflows to inf for strong gates, and inf · 0 = NaN. "
                "Set those differences to −inf before the exponential (torch.where), as "
                "gated_delta_rule.decay_mask does."),
        Mistake("no_decay", lambda k, g: (k @ k.transpose(-1, -2)).tril(-1),
                "the decay is missing: that is chapter 8's tril(K Kᵀ, −1). Each term k_id k_jd "
                "carries exp(G_id − G_jd), the decay of channel d from token j to token i."),
        Mistake("gates_not_summed", lambda k, g: _naive_safe(k, g, strict=True, cumulative=False),
                "you used the per-token gates g where their running sum belongs: the decay from "
                "token j to token i is exp(G_i − G_j) with G_i = Σ_{s ≤ i} g_s (g.cumsum over "
                "the chunk's tokens)."),
    ],
    hint="G = g.cumsum(-2); diff = G[..., :, None, :] − G[..., None, :, :] (G_i − G_j, "
         "[B, H, C, C, Dk]); set it to −inf where j ≥ i (torch.where) BEFORE torch.exp; "
         "Okk = einsum('bhid,bhjd,bhijd->bhij', k, k, exp(diff)).",
))


def _naive_safe(k, g, *, strict, cumulative=True):
    """Pairwise and finite, with the mask or the running sum switched to the mistake."""
    G = g.double().cumsum(-2) if cumulative else g.double()
    return _pairwise(k.double(), G, strict=strict).to(k.dtype)


def _full(k, g):
    """Every pair, above the diagonal too (there exp(G_i − G_j) ≥ 1), in float64."""
    G = g.double().cumsum(-2)
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)
    K = k.double()
    return torch.einsum("bhid,bhjd,bhijd->bhij", K, K, torch.exp(diff)).to(k.dtype)

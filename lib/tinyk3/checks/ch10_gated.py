"""Chapter 10 exercises: one step of the gated delta rule, and the decay mask Γ of a chunk."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import gated_delta_rule as gdr
from .core import Case, Exercise, Mistake, register

# -- gated.step -----------------------------------------------------------------------------------


def gated_step(S, k, v, beta, g):
    """Reference: one step of the gated delta rule, forget before error::

        S' = α S,  α = exp(g)          (forget)
        S_new = S' + kᵀ β (v − k S')   (the delta rule, into what is left)

    ``S [B, H, Dk, Dv]``, ``k [B, H, Dk]``, ``v [B, H, Dv]``, ``beta, g [B, H]`` (``g ≤ 0``)."""
    S = torch.exp(g)[..., None, None] * S  # α S
    u = beta.unsqueeze(-1) * (v - _read(k, S))  # β (v − k α S)   [B, H, Dv]
    return S + _outer(k, u)


def _read(k, S):
    return torch.einsum("bhk,bhkv->bhv", k, S)  # k S   [B, H, Dv]


def _outer(k, u):
    return k.unsqueeze(-1) * u.unsqueeze(-2)  # kᵀ u   [B, H, Dk, Dv]


def _alpha(g):
    return torch.exp(g)[..., None, None]  # α as [B, H, 1, 1]


def _delta(S, k, v, beta):
    return S + _outer(k, beta.unsqueeze(-1) * (v - _read(k, S)))  # chapter 5's step


def _step_cases(gen: torch.Generator) -> list[Case]:
    def case(B, H, Dk, Dv, label, *, g=None, beta=None, unit=False, dtype=torch.float32):
        S = torch.randn(B, H, Dk, Dv, generator=gen, dtype=dtype)
        k = torch.randn(B, H, Dk, generator=gen, dtype=dtype)
        k = F.normalize(k, dim=-1) if unit else 0.5 * k
        v = torch.randn(B, H, Dv, generator=gen, dtype=dtype)
        b = (torch.rand(B, H, generator=gen, dtype=dtype) if beta is None
             else torch.full((B, H), beta, dtype=dtype))
        gate = (-2 * torch.rand(B, H, generator=gen, dtype=dtype) if g is None
                else torch.full((B, H), g, dtype=dtype))
        return Case((S, k, v, b, gate), label=label)

    return [
        case(2, 3, 8, 8, "B=2, H=3, Dk=Dv=8, a gate and a β per head"),
        case(1, 2, 6, 4, "Dk=6 > Dv=4: S is [Dk, Dv]"),
        case(2, 1, 4, 10, "Dk=4 < Dv=10"),
        case(3, 2, 16, 16, "unit keys, β = 1, g = −0.7: the decayed value at k is replaced",
             g=-0.7, beta=1.0, unit=True),
        case(1, 1, 5, 5, "g = 0: no decay, the delta rule of chapter 5", g=0.0),
        case(2, 2, 8, 6, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="gated.step",
    title="one step of the gated delta rule",
    signature="gated_step(S [B, H, Dk, Dv], k [B, H, Dk], v [B, H, Dv], beta [B, H], "
              "g [B, H]) -> S_new [B, H, Dk, Dv]",
    reference=gated_step,
    make_cases=_step_cases,
    chapter=10,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("decay_after_write",
                lambda S, k, v, beta, g: _alpha(g) * _delta(S, k, v, beta),
                "you decayed the state after the write, α (S + kᵀ β (v − k S)): then the value "
                "just written at k fades too, and with β = 1 reading k no longer gives v. Forget "
                "first, S' = α S, then write the delta rule into S'."),
        Mistake("error_before_forget",
                lambda S, k, v, beta, g: _alpha(g) * S + _outer(k, beta.unsqueeze(-1)
                                                              * (v - _read(k, S))),
                "the correction is computed from the state before the decay, β (v − k S), but "
                "added to α S: it removes the full old value at k although only α of it is "
                "left. Read the decayed state: u = β (v − k (α S)), then S_new = α S + kᵀ u."),
        Mistake("no_decay", lambda S, k, v, beta, g: _delta(S, k, v, beta),
                "the gate is missing: that is chapter 5's delta rule. Multiply the state by "
                "α = exp(g) before anything else."),
        Mistake("g_as_alpha", lambda S, k, v, beta, g: _delta(g[..., None, None] * S, k, v, beta),
                "you multiplied the state by g itself: g is the LOG decay (g ≤ 0), so the "
                "factor is α = exp(g) (g = 0 keeps everything)."),
        Mistake("exp_minus_g",
                lambda S, k, v, beta, g: _delta(torch.exp(-g)[..., None, None] * S, k, v, beta),
                "exp(−g) ≥ 1 grows the state instead of shrinking it: g ≤ 0 is already the log "
                "of the decay, α = exp(g) ∈ (0, 1]."),
    ],
    hint="α = exp(g) per head (view it as [B, H, 1, 1]); S' = α S; v_old = k S' "
         "(torch.einsum('bhk,bhkv->bhv', k, S')); u = β (v − v_old); return S' + kᵀ u "
         "(k[..., :, None] * u[..., None, :]).",
))


# -- gated.decay_mask -----------------------------------------------------------------------------


def decay_mask(g):
    """Reference: the decay mask of one chunk from its log decays ``g [..., C]``: ``Γ [..., C, C]``
    with ``Γ_ij = γ_i / γ_j = exp(G_i − G_j)`` on ``j ≤ i`` and 0 above, ``G_i = Σ_{s ≤ i} g_s``.
    Masked before the exponential (``tinyk3.ops.gated_delta_rule.decay_mask``)."""
    return gdr.decay_mask(g.cumsum(-1))


def _pair(G):
    return G.unsqueeze(-1) - G.unsqueeze(-2)  # G_i − G_j   [..., C, C]


def _tril(C, like):
    return torch.ones(C, C, dtype=like.dtype).tril()  # M: ones on and below the diagonal


def _mask_after_exp(g):
    G = g.cumsum(-1)
    return torch.exp(_pair(G)) * _tril(g.shape[-1], g)


def _ratio_of_products(g):
    gamma = torch.exp(g).cumprod(-1)  # γ_i = α_1 ⋯ α_i
    return (gamma.unsqueeze(-1) / gamma.unsqueeze(-2)).tril()  # γ_i / γ_j, then j ≤ i kept


def _mask_cases(gen: torch.Generator) -> list[Case]:
    def case(shape, label, *, low=-1.0, zero=False, dtype=torch.float32):
        g = (torch.zeros(shape, dtype=dtype) if zero
             else low * torch.rand(shape, generator=gen, dtype=dtype))
        return Case((g,), label=f"g {list(shape)}: {label}")

    return [
        case((8,), "one chunk of 8 tokens, gates in (−1, 0)"),
        case((2, 3, 16), "B=2, H=3, C=16"),
        case((2, 4, 4, 16), "[B, H, N, C]: four chunks at once, gates in (−0.1, 0)", low=-0.1),
        case((1,), "C = 1: Γ = [[1]]"),
        case((2, 12), "g = 0: no decay, Γ is the causal mask M", zero=True),
        case((1, 2, 16), "strong gates in (−20, 0): e^(−G) overflows float32", low=-20.0),
        case((3, 10), "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="gated.decay_mask",
    title="the decay mask Γ of a chunk",
    signature="decay_mask(g [..., C]) -> Gamma [..., C, C]",
    reference=decay_mask,
    make_cases=_mask_cases,
    chapter=10,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("exclusive_cumsum",
                lambda g: gdr.decay_mask(g.cumsum(-1) - g),
                "off by one token: your G_i = Σ_{s < i} g_s leaves out g_i itself. Γ_ij must "
                "hold the decays of tokens j+1, …, i (those after token j wrote, up to the "
                "reader): G_i − G_j with the inclusive G_i = Σ_{s ≤ i} g_s, `g.cumsum(-1)`."),
        Mistake("no_cumsum", lambda g: gdr.decay_mask(g),
                "you used g_i − g_j: the decay between tokens j and i is the SUM of the gates "
                "in between, G_i − G_j with G = g.cumsum(-1)."),
        Mistake("no_mask", lambda g: torch.exp(_pair(g.cumsum(-1))),
                "above the diagonal Γ must be 0 (a token never sees later tokens); exp(G_i − G_j) "
                "there is ≥ 1. Mask the entries with j > i."),
        Mistake("strict_mask",
                lambda g: gdr.decay_mask(g.cumsum(-1), strict=True),
                "the diagonal is missing: Γ_ii = 1 (o_t reads the state after token t wrote, "
                "with no decay in between). Keep j ≤ i."),
        Mistake("reversed_difference", lambda g: gdr.decay_mask(-g.cumsum(-1)),
                "the difference is the wrong way round: exp(G_j − G_i) ≥ 1 below the diagonal "
                "grows with distance. The reader i has decayed more than the writer j: "
                "Γ_ij = exp(G_i − G_j) ≤ 1."),
        Mistake("mask_after_exp", _mask_after_exp,
                "NaN: you took exp(G_i − G_j) everywhere and masked afterwards. Above the "
                "diagonal G_i − G_j > 0, and for strong gates exp of it overflows to inf; "
                "inf · 0 is NaN. Mask BEFORE the exponential: put −inf above the diagonal "
                "(torch.where), then exp gives exact zeros."),
        Mistake("ratio_of_products", _ratio_of_products,
                "NaN: you divided cumulative products, γ_i / γ_j. For strong gates both "
                "underflow to 0 in float32 (γ = e^(−300) is below the smallest float) and 0/0 "
                "is NaN. Take the ratio in log space: exp(G_i − G_j), G = g.cumsum(-1)."),
    ],
    hint="G = g.cumsum(-1); D = G[..., :, None] − G[..., None, :] (D_ij = G_i − G_j); keep "
         "j ≤ i: D = torch.where(torch.ones(C, C, dtype=torch.bool).tril(), D, −inf); "
         "return D.exp().",
))

"""Chapter 17 exercises: one read of Kimi K3's block attention residuals (a softmax over depth
of RMS-normed sources against one learned vector, values the raw sources), and SiTU-GLU, the
soft-capped gated unit of every K3 feed-forward network."""

from __future__ import annotations

import math

import torch

from .core import Case, Exercise, Mistake, register

# -- kimi_k3.depth_mix ----------------------------------------------------------------------------


def depth_mix(sources, w_norm, w_proj, eps):
    """Reference: one attention-residual read. ``sources [S, B, T, d]`` are the completed block
    sums (the embedding first) and, last, the current partial sum; ``w_norm [d]`` is the weight
    of the read's RMSNorm and ``w_proj [d]`` its ``d → 1`` projection. Each source ``s`` gets
    the logit ``(s / sqrt(mean(s²) + eps)) · (w_norm ⊙ w_proj)`` (no ``1/√d``); the weights are
    a softmax over the ``S`` sources (depth), separately for every token, and the read is
    ``Σ_s p_s s`` over the RAW sources. Computed in float64, returned in ``sources``' dtype."""
    src = sources.double()
    w = w_norm.double() * w_proj.double()
    logits = (src @ w) * torch.rsqrt(src.pow(2).mean(-1) + eps)  # [S, B, T]
    p = torch.softmax(logits, dim=0)
    return (p.unsqueeze(-1) * src).sum(0).to(sources.dtype)


def _mistake_mix(kind):
    def fn(sources, w_norm, w_proj, eps):
        src = sources.double()
        d = src.shape[-1]
        w = w_proj.double() if kind == "w_norm_ignored" else w_norm.double() * w_proj.double()
        normed = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)
        logits = (src if kind == "raw_logits" else normed) @ w  # [S, B, T]
        if kind == "scaled":
            logits = logits / math.sqrt(d)
        if kind == "over_tokens":
            p = torch.softmax(logits, dim=-1)
        elif kind == "per_channel":  # a softmax over depth per channel: no dot product
            p = torch.softmax(normed * w, dim=0)
            return (p * src).sum(0).to(sources.dtype)
        else:
            p = torch.softmax(logits, dim=0)
        values = normed if kind == "normed_values" else src
        if kind == "partial_added":  # the mix, plus the partial sum again (a residual on top)
            return ((p.unsqueeze(-1) * src).sum(0) + src[-1]).to(sources.dtype)
        return (p.unsqueeze(-1) * values).sum(0).to(sources.dtype)

    return fn


def _mix_cases(gen: torch.Generator) -> list[Case]:
    def case(S, B, T, d, label, *, gain=3.0, eps=1e-5, scale=1.0, dtype=torch.float32):
        # sources of different sizes (a growing residual stream); logits of order `gain`
        sizes = scale * torch.linspace(0.5, 2.0, S, dtype=torch.float64).view(S, 1, 1, 1)
        src = sizes * torch.randn(S, B, T, d, generator=gen, dtype=torch.float64)
        w_norm = 1 + 0.2 * torch.randn(d, generator=gen, dtype=torch.float64)
        w_proj = gain * torch.randn(d, generator=gen, dtype=torch.float64) / math.sqrt(d)
        return Case((src.to(dtype), w_norm.to(dtype), w_proj.to(dtype), eps),
                    label=f"S={S} sources, B={B}, T={T}, d={d}: {label}")

    return [
        case(2, 1, 3, 8, "the embedding and one partial sum"),
        case(4, 2, 5, 16, "three completed blocks and the partial sum"),
        case(9, 1, 4, 32, "nine sources, as K3's final read (the embedding, 7 block sums "
                          "and a partial sum)"),
        case(3, 2, 6, 64, "sharper logits", gain=6.0),
        case(1, 2, 3, 8, "nothing completed yet: the read is the partial sum itself"),
        case(5, 1, 4, 16, "tiny sources: the eps inside the square root matters",
             scale=1e-3, eps=1e-5),
        case(4, 2, 3, 24, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="kimi_k3.depth_mix",
    title="one attention-residual read",
    signature="depth_mix(sources [S, B, T, d], w_norm [d], w_proj [d], eps) -> [B, T, d]",
    reference=depth_mix,
    make_cases=_mix_cases,
    chapter=17,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("scaled_by_sqrt_d", _mistake_mix("scaled"),
                "you divided the logits by √d as in softmax attention: an attention-residual "
                "logit is (s / rms(s)) · (w_norm ⊙ w_proj) with no 1/√d (the RMSNorm already "
                "fixes the scale of the key)."),
        Mistake("normed_values", _mistake_mix("normed_values"),
                "you mixed the RMS-normed sources: the norm makes the keys only. The values are "
                "the RAW sources, Σ p_s s, so the sizes of the block sums survive the mix."),
        Mistake("softmax_over_tokens", _mistake_mix("over_tokens"),
                "your softmax runs over the tokens (the last axis of the [S, B, T] logits): it "
                "runs over depth, the S sources, separately for every token (dim=0)."),
        Mistake("softmax_per_channel", _mistake_mix("per_channel"),
                "you took a softmax over depth for every channel of normed ⊙ w: each source "
                "gets ONE logit per token, the dot product (s / rms(s)) · w, summed over the "
                "channels, and one weight for all its channels."),
        Mistake("raw_logits", _mistake_mix("raw_logits"),
                "your logits use the raw sources: the keys are RMS-normed, s / sqrt(mean(s²) "
                "+ eps), so a larger block sum does not get a larger logit just by its size."),
        Mistake("w_norm_ignored", _mistake_mix("w_norm_ignored"),
                "the RMSNorm's weight is missing: the logit is normed(s) · (w_norm ⊙ w_proj), "
                "the norm's weight times the projection."),
        Mistake("partial_added", _mistake_mix("partial_added"),
                "you added the partial sum to the mix: the read replaces the residual "
                "stream, it is Σ p_s s alone (the partial sum is one of the sources)."),
    ],
    hint="src = sources (float64); w = w_norm * w_proj; logits = (src @ w) * "
         "rsqrt(src.pow(2).mean(-1) + eps)  [S, B, T]; p = softmax(logits, dim=0); return "
         "(p[..., None] * src).sum(0) in sources' dtype.",
))


# -- kimi_k3.situ_glu -----------------------------------------------------------------------------


def situ_glu(gate, up):
    """Reference: Kimi K3's SiTU-GLU, ``4·tanh(g/4)·σ(g) · 25·tanh(u/25)``: SiLU's gate with
    ``g`` soft-capped at 4 before the sigmoid's weighting, times the value soft-capped at 25.
    Computed in float64, returned in ``gate``'s dtype."""
    g, u = gate.double(), up.double()
    return (4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)).to(gate.dtype)


def _mistake_situ(kind):
    def fn(gate, up):
        g, u = gate.double(), up.double()
        if kind == "silu_glu":
            y = torch.nn.functional.silu(g) * u
        elif kind == "caps_swapped":
            y = 25 * torch.tanh(g / 25) * torch.sigmoid(g) * 4 * torch.tanh(u / 4)
        elif kind == "no_sigmoid":
            y = 4 * torch.tanh(g / 4) * 25 * torch.tanh(u / 25)
        elif kind == "value_uncapped":
            y = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * u
        elif kind == "gate_uncapped":
            y = torch.nn.functional.silu(g) * 25 * torch.tanh(u / 25)
        elif kind == "silu_capped":  # the cap on SiLU's output instead of on g
            y = 4 * torch.tanh(torch.nn.functional.silu(g) / 4) * 25 * torch.tanh(u / 25)
        elif kind == "hard_clamp":
            y = torch.nn.functional.silu(g.clamp(-4, 4)) * u.clamp(-25, 25)
        elif kind == "tanh_unscaled":
            y = torch.tanh(g) * torch.sigmoid(g) * torch.tanh(u)
        else:
            raise ValueError(kind)
        return y.to(gate.dtype)

    return fn


def _situ_cases(gen: torch.Generator) -> list[Case]:
    def case(shape, g_scale, u_scale, label, *, g_shift=0.0, dtype=torch.float32):
        g = g_shift + g_scale * torch.randn(*shape, generator=gen, dtype=torch.float64)
        u = u_scale * torch.randn(*shape, generator=gen, dtype=torch.float64)
        return Case((g.to(dtype), u.to(dtype)),
                    label=f"gate ~ {g_shift:+g} + {g_scale:g}·N(0,1), up ~ {u_scale:g}·N(0,1), "
                          f"shape {list(shape)}: {label}")

    return [
        case((4, 8), 1.0, 1.0, "inputs of order one: close to SiLU-GLU, not equal"),
        case((3, 16), 10.0, 60.0, "large inputs: both caps bite"),
        case((2, 5, 8), 20.0, 2.0, "a large gate, a small value"),
        case((2, 32), 1.5, 80.0, "a large value, a small gate"),
        case((4, 8), 3.0, 5.0, "negative gates: SiLU's dip below zero", g_shift=-3.0),
        case((3, 12), 8.0, 40.0, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="kimi_k3.situ_glu",
    title="SiTU-GLU",
    signature="situ_glu(gate [...], up [...]) -> [...]",
    reference=situ_glu,
    make_cases=_situ_cases,
    chapter=17,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("silu_glu", _mistake_situ("silu_glu"),
                "that is SiLU-GLU, silu(g) · u, without caps: SiTU-GLU is 4·tanh(g/4)·σ(g) · "
                "25·tanh(u/25)."),
        Mistake("caps_swapped", _mistake_situ("caps_swapped"),
                "the caps are swapped: the gate is capped at 4, 4·tanh(g/4)·σ(g), and the value "
                "at 25, 25·tanh(u/25)."),
        Mistake("no_sigmoid", _mistake_situ("no_sigmoid"),
                "the sigmoid is missing: the gate is SiLU's g·σ(g) with g soft-capped, "
                "4·tanh(g/4)·σ(g); without σ(g) a negative gate lets a large negative value "
                "through."),
        Mistake("value_uncapped", _mistake_situ("value_uncapped"),
                "the value is not capped: multiply by 25·tanh(u/25), not by u."),
        Mistake("gate_uncapped", _mistake_situ("gate_uncapped"),
                "the gate is not capped: replace g in g·σ(g) by 4·tanh(g/4), so the gate "
                "stays below 4."),
        Mistake("silu_capped", _mistake_situ("silu_capped"),
                "you capped SiLU's output, 4·tanh(silu(g)/4): the cap goes on g inside the "
                "SiLU, 4·tanh(g/4)·σ(g) (the sigmoid still sees the raw g)."),
        Mistake("hard_clamp", _mistake_situ("hard_clamp"),
                "you clamped g and u: SiTU's caps are soft, β·tanh(x/β), smooth and with a "
                "gradient everywhere; and the sigmoid sees the raw g: 4·tanh(g/4)·σ(g) · "
                "25·tanh(u/25)."),
        Mistake("tanh_unscaled", _mistake_situ("tanh_unscaled"),
                "tanh(g)·σ(g)·tanh(u) caps at 1: a soft cap at β is β·tanh(x/β), which is x "
                "for small x and β for large x (β = 4 for the gate, 25 for the value)."),
    ],
    hint="g, u = gate.double(), up.double(); return (4 * tanh(g / 4) * sigmoid(g) * 25 * "
         "tanh(u / 25)) in gate's dtype.",
))

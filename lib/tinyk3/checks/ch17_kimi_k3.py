"""Chapter 17 exercises: one read of Kimi K3's block attention residuals (a softmax over depth
of RMS-normed sources against one learned vector, values the raw sources), and the routed
experts' share of K3's parameters, counted from its released configuration."""

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


# -- kimi_k3.routed_experts ------------------------------------------------------------------------


def routed_experts(config):
    """Reference: ``(total, active)``, the parameters of the routed experts of a K3-style
    configuration dict (K3's released keys). Layers ``0 … first_k_dense_replace − 1`` (0-based)
    have a dense feed-forward; each later layer (``moe_layer_freq`` is 1 in every case) has
    ``num_experts`` routed experts, each a gated unit of three matrices of
    ``moe_intermediate_size × routed_expert_hidden_size`` (the latent width the experts work
    in: smaller than ``hidden_size`` in K3's latent MoE, equal to it in a DeepSeek-V3-shaped
    one). A token uses ``num_experts_per_token`` of them per MoE layer; the shared experts are
    not routed and not counted here."""
    n_moe = config["num_hidden_layers"] - config["first_k_dense_replace"]
    per_expert = 3 * config["moe_intermediate_size"] * config["routed_expert_hidden_size"]
    return (n_moe * config["num_experts"] * per_expert,
            n_moe * config["num_experts_per_token"] * per_expert)


def _k3_like(**changes):
    keys = ("num_hidden_layers", "hidden_size", "first_k_dense_replace", "num_experts",
            "num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
            "routed_expert_hidden_size", "moe_layer_freq", "intermediate_size")
    k3 = {"num_hidden_layers": 93, "hidden_size": 7168, "first_k_dense_replace": 1,
          "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
          "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
          "moe_layer_freq": 1, "intermediate_size": 33792}
    assert set(changes) <= set(keys)
    return dict(k3, **changes)


def _experts_cases(gen: torch.Generator) -> list[Case]:
    del gen  # the cases are fixed configurations

    def case(label, **changes):
        cfg = _k3_like(**changes)
        return Case((cfg,), label=f"{cfg['num_hidden_layers']} layers "
                                  f"({cfg['first_k_dense_replace']} dense), "
                                  f"{cfg['num_experts']} experts, "
                                  f"{cfg['num_experts_per_token']} per token, "
                                  f"{cfg['moe_intermediate_size']} × "
                                  f"{cfg['routed_expert_hidden_size']} of width "
                                  f"{cfg['hidden_size']}: {label}")

    return [
        case("Kimi K3 as released"),
        case("DeepSeek-V3's shape: experts at full width", num_hidden_layers=61,
             first_k_dense_replace=3, num_experts=256, num_experts_per_token=8,
             num_shared_experts=1, moe_intermediate_size=2048, routed_expert_hidden_size=7168,
             intermediate_size=18432),
        case("Kimi K2's shape", num_hidden_layers=61, num_experts=384, num_experts_per_token=8,
             num_shared_experts=1, moe_intermediate_size=2048, routed_expert_hidden_size=7168,
             intermediate_size=18432),
        case("tiny: a latent half the width", num_hidden_layers=4, hidden_size=16,
             num_experts=8, num_experts_per_token=2, moe_intermediate_size=12,
             routed_expert_hidden_size=8, intermediate_size=48),
        case("tiny: no dense layer", num_hidden_layers=3, hidden_size=32,
             first_k_dense_replace=0, num_experts=6, num_experts_per_token=3,
             moe_intermediate_size=20, routed_expert_hidden_size=24, intermediate_size=64),
        case("K3 with three dense layers", first_k_dense_replace=3),
    ]


def _mistake_experts(kind):
    def fn(config):
        L, dense = config["num_hidden_layers"], config["first_k_dense_replace"]
        n_moe = {"every_layer": L, "dense_one_based": L - dense + 1}.get(kind, L - dense)
        width = config["hidden_size" if kind == "hidden_not_latent" else
                       "routed_expert_hidden_size"]
        per = (2 if kind == "two_matrices" else 3) * config["moe_intermediate_size"] * width
        k = config["num_experts_per_token"]
        if kind == "shared_in_active":
            k += config["num_shared_experts"]
        total = n_moe * config["num_experts"] * per
        return total, (total if kind == "all_active" else n_moe * k * per)

    return fn


register(Exercise(
    id="kimi_k3.routed_experts",
    title="the routed experts' parameters",
    signature="routed_experts(config: dict) -> (total: int, active: int)",
    reference=routed_experts,
    make_cases=_experts_cases,
    chapter=17,
    mistakes=[
        Mistake("hidden_not_latent", _mistake_experts("hidden_not_latent"),
                "your experts are hidden_size wide: K3's routed experts work in the latent, "
                "routed_expert_hidden_size (3,584, half of 7,168); a projection down and up "
                "surrounds them and belongs to the layer, not to the experts."),
        Mistake("every_layer", _mistake_experts("every_layer"),
                "you gave every layer experts: the first first_k_dense_replace layers have a "
                "dense feed-forward instead."),
        Mistake("dense_one_based", _mistake_experts("dense_one_based"),
                "one MoE layer too many: first_k_dense_replace is the number of dense layers "
                "at the start (0-based layers 0 … k − 1), so num_hidden_layers − k layers have "
                "experts."),
        Mistake("two_matrices", _mistake_experts("two_matrices"),
                "an expert is a gated unit with three matrices (gate, up and down), each "
                "moe_intermediate_size × routed_expert_hidden_size."),
        Mistake("shared_in_active", _mistake_experts("shared_in_active"),
                "the shared experts are not routed experts (and in K3 they run at full width, "
                "with their own size): a token uses num_experts_per_token routed experts per "
                "layer."),
        Mistake("all_active", _mistake_experts("all_active"),
                "your active count is the total: a token goes through num_experts_per_token "
                "of the num_experts experts in each MoE layer."),
    ],
    hint="n_moe = num_hidden_layers − first_k_dense_replace; per expert 3 · "
         "moe_intermediate_size · routed_expert_hidden_size; total n_moe · num_experts · per, "
         "active n_moe · num_experts_per_token · per.",
))

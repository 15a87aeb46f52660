"""Chapter 14 exercises: the router of a mixture of experts (a bias that only selects, weights
from the unbiased scores, group-limited routing), the auxiliary-loss-free bias update, Kimi
K3's Quantile Balancing, and the parameters of one MoE layer, total and active."""

from __future__ import annotations

import torch

from .core import Case, Exercise, Mistake, register

# -- moe.route ------------------------------------------------------------------------------------


def route_gates(scores, bias, top_k, n_group, topk_group, scale):
    """Reference: DeepSeek-V3's routing, returned as dense gates ``[N, E]`` (zero for the experts
    a token is not sent to), so the order of the chosen experts does not matter.

    ``scores [N, E]`` are the router's sigmoid scores, ``bias [E]`` the score-correction bias.
    Selection uses ``scores + bias``: the ``E / n_group`` experts of a group are scored by the
    sum of their two largest biased scores, the ``topk_group`` best groups are kept, and the
    ``top_k`` largest biased scores among the kept experts are chosen. The weights are the
    UNBIASED scores of the chosen experts, divided by their sum, times ``scale``
    (``routed_scaling_factor``)."""
    chosen = _select(scores + bias, top_k, n_group, topk_group)
    w = scores.gather(1, chosen)
    return _dense(scores, chosen, w / w.sum(-1, keepdim=True) * scale)


def _select(biased, top_k, n_group, topk_group, *, group_score="top2", fill=-torch.inf,
            group_from=None):
    """Indices ``[N, top_k]`` of the chosen experts; the keyword arguments switch to mistakes."""
    N, E = biased.shape
    if n_group > 1:
        grouped = (biased if group_from is None else group_from).view(N, n_group, E // n_group)
        if group_score == "top2":
            g = grouped.topk(2, dim=-1).values.sum(-1)  # [N, n_group]
        elif group_score == "max":
            g = grouped.amax(-1)
        else:  # "sum"
            g = grouped.sum(-1)
        kept = torch.zeros(N, n_group, dtype=torch.bool, device=biased.device)
        kept.scatter_(1, g.topk(topk_group, dim=-1).indices, True)
        kept = kept.repeat_interleave(E // n_group, dim=1)  # [N, E]
        biased = biased.masked_fill(~kept, fill)
    return biased.topk(top_k, dim=-1).indices


def _dense(scores, chosen, w):
    return torch.zeros_like(scores).scatter(1, chosen, w.to(scores.dtype))


def _mistake_route(*, bias_in_weights=False, renorm="selected", use_scale=True,
                   select_with_bias=True, groups=True, groups_unbiased=False, **select_kw):
    def fn(scores, bias, top_k, n_group, topk_group, scale):
        sel = scores + bias if select_with_bias else scores
        # groups_unbiased: the groups scored without the bias, the experts with it
        kw = dict(select_kw, group_from=scores) if groups_unbiased else select_kw
        chosen = _select(sel, top_k, n_group if groups else 1, topk_group, **kw)
        w = (scores + bias if bias_in_weights else scores).gather(1, chosen)
        if renorm == "selected":
            w = w / w.sum(-1, keepdim=True)
        elif renorm == "all":
            w = w / scores.sum(-1, keepdim=True)
        return _dense(scores, chosen, w * scale if use_scale else w)

    return fn


def _route_cases(gen: torch.Generator) -> list[Case]:
    def case(N, E, k, G, KG, scale, label, *, spread=0.05, shift=0.0, dtype=torch.float32):
        scores = torch.sigmoid(torch.randn(N, E, generator=gen, dtype=torch.float64))
        bias = shift + spread * torch.randn(E, generator=gen, dtype=torch.float64)
        return Case((scores.to(dtype), bias.to(dtype), k, G, KG, scale),
                    label=f"N={N}, E={E}, top_k={k}, n_group={G}, topk_group={KG}, "
                          f"scale={scale}: {label}")

    return [
        case(16, 8, 2, 1, 1, 1.0, "one group, no scaling"),
        case(32, 16, 4, 1, 1, 2.5, "one group, scaled (Kimi K2 routes with one group)"),
        case(32, 16, 3, 1, 1, 1.0, "a large bias: it changes the selection", spread=0.3),
        case(64, 32, 4, 4, 2, 2.5, "4 groups, 2 kept"),
        case(64, 64, 8, 8, 4, 2.5, "DeepSeek-V3's groups: 8 of 8 experts, 4 kept", spread=0.2),
        case(48, 32, 4, 8, 3, 1.0, "8 groups of 4, 3 kept, a large bias", spread=0.3),
        case(32, 32, 4, 4, 2, 2.5, "every bias negative: masked experts must never win",
             spread=0.05, shift=-1.2),
        case(24, 32, 6, 4, 2, 1.5, "float64: keep the dtype", spread=0.2,
             dtype=torch.float64),
    ]


register(Exercise(
    id="moe.route",
    title="routing with a selection-only bias",
    signature="route_gates(scores [N, E], bias [E], top_k, n_group, topk_group, scale) "
              "-> gates [N, E]",
    reference=route_gates,
    make_cases=_route_cases,
    chapter=14,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("bias_in_weights", _mistake_route(bias_in_weights=True),
                "your weights include the bias: you gathered them from scores + bias. The bias "
                "only chooses which experts run; the weights are the UNBIASED scores of the "
                "chosen experts, scores.gather(1, idx), renormalised and scaled."),
        Mistake("bias_ignored", _mistake_route(select_with_bias=False),
                "you chose the experts on the scores alone: the selection (groups and top-k) "
                "uses scores + bias; only the weights leave the bias out."),
        Mistake("no_renormalisation", _mistake_route(renorm="none"),
                "the weights are not renormalised: divide the chosen scores by their sum "
                "(w / w.sum(-1, keepdim=True)) before multiplying by scale, so that each "
                "token's weights sum to scale."),
        Mistake("renormalised_over_all", _mistake_route(renorm="all"),
                "you divided by the sum of ALL the token's scores: renormalise over the "
                "top_k chosen ones only, w / w.sum(-1, keepdim=True)."),
        Mistake("no_scale", _mistake_route(use_scale=False),
                "the weights sum to 1: multiply them by scale (routed_scaling_factor) after "
                "the renormalisation."),
        Mistake("groups_by_max", _mistake_route(group_score="max"),
                "you scored each group by its largest biased score: DeepSeek-V3 scores a group "
                "by the SUM of its two largest, grouped.topk(2, dim=-1).values.sum(-1)."),
        Mistake("groups_by_sum", _mistake_route(group_score="sum"),
                "you scored each group by the sum of all its experts: DeepSeek-V3 sums only "
                "the two largest biased scores of a group, grouped.topk(2, dim=-1).values.sum(-1)."),
        Mistake("groups_unbiased", _mistake_route(groups_unbiased=True),
                "you scored the groups on the unbiased scores: the groups, like the experts, "
                "are chosen on scores + bias."),
        Mistake("no_group_limit", _mistake_route(groups=False),
                "the groups are ignored: with n_group > 1, keep only the topk_group groups "
                "with the largest top-2 sums, and choose top_k experts among theirs."),
        Mistake("masked_with_zero", _mistake_route(fill=0.0),
                "you masked the experts of dropped groups with 0: a biased score can be "
                "negative, and then a dropped expert's 0 beats a kept expert. Mask with -inf "
                "(masked_fill(~kept, float('-inf')))."),
    ],
    hint="biased = scores + bias; with n_group > 1: view [N, n_group, E // n_group], "
         "group score = topk(2).values.sum(-1), keep the topk_group best groups, set the "
         "others' biased scores to -inf; idx = biased.topk(top_k).indices; w = "
         "scores.gather(1, idx); w = w / w.sum(-1, keepdim=True) * scale; return "
         "zeros_like(scores).scatter(1, idx, w).",
))


# -- moe.update_bias ------------------------------------------------------------------------------


def update_bias(bias, indices, speed):
    """Reference: one step of auxiliary-loss-free balancing. ``indices [N, k]`` are the experts
    each token was sent to in the step; the load of expert ``i`` is how many of the ``N·k``
    slots went to it, and ``b_i ← b_i + speed · sign(mean load − load_i)`` (the mean load is
    ``N·k / E``): overloaded experts go down, underloaded up, those exactly at the mean stay."""
    E = bias.shape[0]
    load = torch.bincount(indices.reshape(-1), minlength=E).to(torch.float64)
    return (bias + speed * torch.sign(load.mean() - load)).to(bias.dtype)


def _load(indices, E):
    return torch.bincount(indices.reshape(-1), minlength=E).to(torch.float64)


def _update_cases(gen: torch.Generator) -> list[Case]:
    def routed(N, E, k, skew, speed, label, *, dtype=torch.float32):
        logits = torch.randn(N, E, generator=gen, dtype=torch.float64)
        logits[:, : max(1, E // 8)] += skew  # a few favoured experts
        idx = logits.topk(k, dim=-1).indices
        bias = 0.01 * torch.randn(E, generator=gen, dtype=torch.float64)
        return Case((bias.to(dtype), idx, speed), label=f"N={N}, E={E}, k={k}, speed={speed}: "
                                                        f"{label}")

    def balanced(E, k, speed, label, *, dtype=torch.float32):
        """Every expert at exactly the mean load but two: one above by 1, one below by 1."""
        N = E  # N·k / E = k slots per expert
        loads = torch.full((E,), k)
        loads[0] += 1
        loads[1] -= 1
        slots = torch.repeat_interleave(torch.arange(E), loads)  # sorted by expert
        idx = slots.reshape(k, N).T.contiguous()  # column-major: no expert twice in a row
        perm = torch.randperm(N, generator=gen)
        bias = 0.01 * torch.randn(E, generator=gen, dtype=torch.float64)
        return Case((bias.to(dtype), idx[perm], speed),
                    label=f"N={N}, E={E}, k={k}, speed={speed}: {label}")

    return [
        routed(64, 8, 2, 1.0, 0.001, "a skewed router, DeepSeek-V3's speed"),
        routed(128, 16, 4, 2.0, 0.01, "a strongly skewed router"),
        routed(40, 32, 8, 0.5, 0.1, "more experts than a token's slots cover twice"),
        balanced(16, 4, 0.01, "14 experts exactly at the mean load: their bias stays"),
        routed(256, 64, 8, 1.5, 0.001, "float64: keep the dtype", dtype=torch.float64),
    ]


def _mistake_update(kind):
    def fn(bias, indices, speed):
        E = bias.shape[0]
        if kind == "first_choice_only":
            load = _load(indices[:, 0], E)
        else:
            load = _load(indices, E)
        mean = indices.shape[0] / E if kind == "mean_without_k" else load.mean()
        if kind == "wrong_direction":
            step = torch.sign(load - mean)
        elif kind == "proportional":
            step = mean - load
        elif kind == "ties_pushed":
            step = torch.where(load > mean, -1.0, 1.0).to(torch.float64)
        else:
            step = torch.sign(mean - load)
        return (bias + speed * step).to(bias.dtype)

    return fn


register(Exercise(
    id="moe.update_bias",
    title="the balancing bias update",
    signature="update_bias(bias [E], indices [N, k], speed) -> new bias [E]",
    reference=update_bias,
    make_cases=_update_cases,
    chapter=14,
    atol=1e-7,
    rtol=1e-6,
    mistakes=[
        Mistake("wrong_direction", _mistake_update("wrong_direction"),
                "your update raises the bias of overloaded experts: that sends them even more "
                "tokens. b_i + speed · sign(mean load − load_i): busy experts go DOWN."),
        Mistake("proportional", _mistake_update("proportional"),
                "your step is proportional to the load difference: the rule moves every bias "
                "by exactly ±speed, speed · sign(mean load − load_i), whatever the size of "
                "the imbalance."),
        Mistake("ties_pushed", _mistake_update("ties_pushed"),
                "experts exactly at the mean load moved: sign(0) = 0, so their bias stays. "
                "torch.sign(mean − load) handles all three cases."),
        Mistake("first_choice_only", _mistake_update("first_choice_only"),
                "you counted only each token's first expert: the load is over all N·k slots, "
                "torch.bincount(indices.flatten(), minlength=E)."),
        Mistake("mean_without_k", _mistake_update("mean_without_k"),
                "your mean load is N / E: with k experts per token there are N·k slots, so "
                "the mean load is N·k / E (load.float().mean())."),
    ],
    hint="load = torch.bincount(indices.flatten(), minlength=E) (as float); return bias + "
         "speed * torch.sign(load.mean() − load), in bias's dtype.",
))


# -- moe.quantile_bias ------------------------------------------------------------------------------


def quantile_bias(scores, bias, top_k):
    """Reference: Kimi K3's Quantile Balancing, the exact form. ``scores [T, E]`` are sigmoid
    scores before the bias, ``bias [E]`` the current bias. Each token's cutoff is its
    ``(top_k + 1)``-th largest BIASED score; expert e's required bias for token t is
    ``cutoff_t − scores[t, e]``; the new bias of expert e is the ``top_k / E`` quantile of its
    required biases (``torch.quantile``, linear interpolation), minus the mean over experts."""
    s, b = scores.double(), bias.double()
    E = s.shape[1]
    cutoff = (s + b).sort(dim=-1, descending=True).values[:, top_k:top_k + 1]
    q = torch.quantile(cutoff - s, top_k / E, dim=0)
    return (q - q.mean()).to(scores.dtype)


def _quantile_cases(gen: torch.Generator) -> list[Case]:
    def case(T, E, k, skew, label, *, dtype=torch.float32):
        logits = torch.randn(T, E, generator=gen, dtype=torch.float64)
        logits[:, : max(1, E // 8)] += skew
        bias = 0.2 * torch.randn(E, generator=gen, dtype=torch.float64)
        return Case((torch.sigmoid(logits).to(dtype), bias.to(dtype), k),
                    label=f"T={T}, E={E}, top_k={k}: {label}")

    return [
        case(64, 8, 2, 1.0, "a skewed router"),
        case(200, 16, 4, 2.0, "a strongly skewed router"),
        case(50, 6, 5, 0.5, "top_k = E − 1: the cutoff is each token's smallest biased score"),
        case(1, 8, 3, 1.0, "a single token"),
        case(300, 32, 1, 1.5, "one expert per token"),
        case(128, 12, 3, 1.0, "float64: keep the dtype", dtype=torch.float64),
    ]


def _mistake_quantile(kind):
    def fn(scores, bias, top_k):
        s, b = scores.double(), bias.double()
        E = s.shape[1]
        ranked = ((s if kind == "unbiased_cutoff" else s + b)
                  .sort(dim=-1, descending=True).values)
        rank = top_k - 1 if kind == "kth_cutoff" else top_k
        required = ranked[:, rank:rank + 1] - s
        if kind == "flipped":
            required = -required
        level = 1 - top_k / E if kind == "upper_quantile" else top_k / E
        q = torch.quantile(required, level, dim=0)
        if kind != "not_centred":
            q = q - q.mean()
        if kind == "added":
            q = b + q
        return q.to(scores.dtype)

    return fn


register(Exercise(
    id="moe.quantile_bias",
    title="Quantile Balancing",
    signature="quantile_bias(scores [T, E], bias [E], top_k) -> new bias [E]",
    reference=quantile_bias,
    make_cases=_quantile_cases,
    chapter=14,
    atol=1e-6,
    rtol=1e-5,
    mistakes=[
        Mistake("kth_cutoff", _mistake_quantile("kth_cutoff"),
                "your cutoff is each token's k-th largest biased score: that is the LAST expert "
                "it chose. The cutoff is the (k+1)-th, the best expert it did not choose: "
                "sort(descending).values[:, top_k]."),
        Mistake("unbiased_cutoff", _mistake_quantile("unbiased_cutoff"),
                "you ranked the unbiased scores for the cutoff: a token chooses by scores + bias, "
                "so its cutoff is a biased score (the required bias is then cutoff − the "
                "unbiased score)."),
        Mistake("flipped", _mistake_quantile("flipped"),
                "your required bias has the wrong sign: the bias expert e needs for token t "
                "solves scores[t, e] + b = cutoff_t, so it is cutoff_t − scores[t, e]."),
        Mistake("upper_quantile", _mistake_quantile("upper_quantile"),
                "you took the 1 − k/E quantile: an expert is chosen by the tokens whose required "
                "bias is BELOW its bias, and it should be chosen by a fraction k/E of them, so "
                "the new bias is the k/E quantile."),
        Mistake("not_centred", _mistake_quantile("not_centred"),
                "the result is not mean-centred: subtract the mean over experts (only "
                "differences between biases change a selection)."),
        Mistake("added", _mistake_quantile("added"),
                "you added the quantile to the old bias: the quantile IS the new bias (the "
                "required biases already contain the old one through the cutoff)."),
    ],
    hint="cutoff = (scores + bias).sort(dim=-1, descending=True).values[:, top_k:top_k+1]; "
         "required = cutoff − scores; q = torch.quantile(required, top_k / E, dim=0); return "
         "(q − q.mean()) in scores' dtype.",
))


# -- moe.layer_parameters -------------------------------------------------------------------------


def layer_parameters(d, n_experts, top_k, hidden, n_shared):
    """Reference: ``(total, active)`` parameters of one MoE layer of width ``d``: a router
    ``E·d`` (its bias is a buffer, not a parameter), ``E`` SwiGLU experts of hidden ``h``
    (``3·d·h`` each: gate, up and down projections, no biases) and a shared SwiGLU of hidden
    ``n_shared·h``. A token uses the router, the shared expert and ``top_k`` routed experts."""
    expert = 3 * d * hidden
    shared = 3 * d * hidden * n_shared
    router = n_experts * d
    return router + n_experts * expert + shared, router + top_k * expert + shared


def _param_cases(gen: torch.Generator) -> list[Case]:
    del gen  # fixed published sizes and small ones

    def case(d, E, k, h, s, label):
        return Case((d, E, k, h, s), label=f"d={d}, E={E}, top_k={k}, hidden={h}, "
                                           f"n_shared={s}: {label}")

    return [
        case(16, 8, 2, 32, 1, "a tiny layer"),
        case(64, 16, 4, 24, 0, "no shared expert"),
        case(7168, 256, 8, 2048, 1, "DeepSeek-V3"),
        case(7168, 384, 8, 2048, 1, "Kimi K2"),
        case(2304, 256, 8, 1024, 1, "Kimi Linear 48B"),
        case(48, 12, 3, 16, 2, "two shared experts"),
    ]


def _mistake_params(kind):
    def fn(d, E, k, h, s):
        per = (2 if kind == "two_matrices" else 3) * d * h
        shared = per * s
        router = 0 if kind == "no_router" else E * d + (E if kind == "bias_counted" else 0)
        total = router + E * per + shared
        if kind == "active_without_shared":
            return total, router + k * per
        return total, router + k * per + shared

    return fn


register(Exercise(
    id="moe.layer_parameters",
    title="an MoE layer's parameters",
    signature="layer_parameters(d, n_experts, top_k, hidden, n_shared) -> (total, active)",
    reference=layer_parameters,
    make_cases=_param_cases,
    chapter=14,
    mistakes=[
        Mistake("two_matrices", _mistake_params("two_matrices"),
                "your expert has two matrices: a SwiGLU expert has three, gate_proj and "
                "up_proj (d → h) and down_proj (h → d), 3·d·h."),
        Mistake("no_router", _mistake_params("no_router"),
                "the router is missing: its weight [E, d] is E·d parameters, and every token "
                "uses all of it."),
        Mistake("bias_counted", _mistake_params("bias_counted"),
                "you counted the router's bias: e_score_correction_bias gets no gradient and "
                "is a buffer, not a parameter."),
        Mistake("active_without_shared", _mistake_params("active_without_shared"),
                "the active count lacks the shared expert: every token runs it, so it counts "
                "in full."),
    ],
    hint="expert = 3·d·hidden; shared = n_shared·expert; router = n_experts·d; total = router + "
         "n_experts·expert + shared; active = router + top_k·expert + shared.",
))

"""Chapter 14's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants; and the
references against the library and against transformers' DeepSeek-V3 router.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import pytest
import torch

from helpers import import_without_fla, right, run, wrong
from tinyk3 import checks
from tinyk3.layers import moe

# -- moe.route ------------------------------------------------------------------------------------


def _learner_route(scores, bias, top_k, n_group, topk_group, scale, bug=None):
    """A learner's router, written the obvious way; `bug` names the one thing done wrong."""
    N, E = scores.shape
    biased = scores if bug == "no_bias" else scores + bias
    if n_group > 1 and bug != "no_groups":
        src = scores if bug == "groups_unbiased" else biased
        per_group = src.reshape(N, n_group, E // n_group)
        if bug == "groups_max":
            group_score = per_group.max(dim=-1).values
        else:
            best2, _ = torch.sort(per_group, dim=-1, descending=True)
            group_score = best2[..., 0] + best2[..., 1]
        top_groups = torch.topk(group_score, topk_group, dim=-1).indices  # [N, topk_group]
        group_mask = torch.zeros(N, n_group).scatter(1, top_groups, 1.0)
        expert_mask = group_mask[:, :, None].expand(N, n_group, E // n_group).reshape(N, E)
        fill = 0.0 if bug == "zero_mask" else float("-inf")
        biased = torch.where(expert_mask > 0, biased, torch.full_like(biased, fill))
    idx = torch.topk(biased, top_k, dim=-1).indices
    w = (biased if bug == "biased_weights" else scores).gather(1, idx)
    if bug == "softmax":
        w = torch.softmax(w, dim=-1)
    elif bug != "no_norm":
        w = w / w.sum(dim=-1, keepdim=True)
    if bug != "no_scale":
        w = w * scale
    gates = torch.zeros_like(scores)
    gates.scatter_(1, idx, w)
    return gates


def _bugged(bug):
    def fn(scores, bias, top_k, n_group, topk_group, scale):
        return _learner_route(scores, bias, top_k, n_group, topk_group, scale, bug=bug)

    fn.__name__ = f"rt_{bug}"
    return fn


@right("moe.route")
def rt_ok_per_token(scores, bias, top_k, n_group, topk_group, scale):
    """Token by token, in Python lists: the groups ranked by their two best biased scores."""
    N, E = scores.shape
    per = E // n_group
    gates = torch.zeros_like(scores)
    for n in range(N):
        b = (scores[n] + bias).tolist()
        groups = sorted(range(n_group), reverse=True,
                        key=lambda g: sum(sorted(b[g * per:(g + 1) * per])[-2:]))
        allowed = [e for g in groups[:topk_group] for e in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda e: b[e], reverse=True)[:top_k]
        total = sum(scores[n, e] for e in chosen)
        for e in chosen:
            gates[n, e] = scores[n, e] / total * scale
    return gates


@right("moe.route")
def rt_ok_lib(scores, bias, top_k, n_group, topk_group, scale):
    w, idx = moe.route(scores, top_k=top_k, bias=bias, n_group=n_group, topk_group=topk_group,
                       routed_scaling_factor=scale)
    return torch.zeros_like(scores).scatter(1, idx, w)


# -- moe.update_bias ------------------------------------------------------------------------------


def _learner_update(bias, indices, speed, *, bug=None):
    E = bias.shape[0]
    picked = indices[:, :1] if bug == "first_only" else indices
    load = torch.nn.functional.one_hot(picked, E).sum(dim=(0, 1)).to(bias.dtype)
    mean = indices.shape[0] / E if bug == "mean_N" else load.mean()
    if bug == "flipped":
        return bias + speed * torch.sign(load - mean)
    if bug == "where":
        return bias + torch.where(load > mean, -speed, speed)
    if bug == "proportional":
        return bias + speed * (mean - load)
    return bias + speed * torch.sign(mean - load)


def _bugged_update(bug):
    def fn(bias, indices, speed):
        return _learner_update(bias, indices, speed, bug=bug)

    fn.__name__ = f"ub_{bug}"
    return fn


@right("moe.update_bias")
def ub_ok_loop(bias, indices, speed):
    """Overloaded down, underloaded up, at the mean unchanged, one expert at a time."""
    E = bias.shape[0]
    load = [int((indices == e).sum()) for e in range(E)]
    mean = sum(load) / E
    new = bias.clone()
    for e in range(E):
        if load[e] > mean:
            new[e] -= speed
        elif load[e] < mean:
            new[e] += speed
    return new


@right("moe.update_bias")
def ub_ok_lib(bias, indices, speed):
    return moe.update_bias(bias, moe.expert_load(indices, bias.shape[0]), speed)


# -- moe.quantile_bias ------------------------------------------------------------------------------


def _learner_quantile(scores, bias, top_k, *, bug=None):
    """A learner's Quantile Balancing, with topk and a sort; `bug` names the one thing wrong."""
    T, E = scores.shape
    biased = scores if bug == "unbiased" else scores + bias
    k = top_k if bug == "kth" else top_k + 1
    cutoff = torch.topk(biased, k, dim=-1).values[:, -1]  # [T]
    required = (scores - cutoff[:, None]) if bug == "sign" else (cutoff[:, None] - scores)
    level = 1 - top_k / E if bug == "upper" else top_k / E
    new = torch.stack([torch.quantile(required[:, e], level) for e in range(E)])
    if bug != "no_centre":
        new = new - new.mean()
    if bug == "increment":
        new = bias + new
    return new


def _bugged_quantile(bug):
    def fn(scores, bias, top_k):
        return _learner_quantile(scores, bias, top_k, bug=bug)

    fn.__name__ = f"qb_{bug}"
    return fn


@right("moe.quantile_bias")
def qb_ok_sorted(scores, bias, top_k):
    """Token by token and expert by expert, with the interpolation written out."""
    T, E = scores.shape
    req = [[sorted((scores[t] + bias).tolist(), reverse=True)[top_k] - float(scores[t, e])
            for t in range(T)] for e in range(E)]
    out = []
    for r in req:
        r = sorted(r)
        pos = (T - 1) * top_k / E
        lo = int(pos)
        hi = min(lo + 1, T - 1)
        out.append(r[lo] + (pos - lo) * (r[hi] - r[lo]))
    mean = sum(out) / E
    return torch.tensor([o - mean for o in out], dtype=scores.dtype)


@right("moe.quantile_bias")
def qb_ok_lib(scores, bias, top_k):
    return moe.quantile_bias(scores, bias, top_k)


# -- moe.layer_parameters -------------------------------------------------------------------------


@wrong("moe.layer_parameters", "two_matrices")
def lp_two_matrices(d, E, k, h, s):
    expert = 2 * d * h  # forgot the gate: d·h in, h·d out
    return E * d + E * expert + s * expert, E * d + k * expert + s * expert


@wrong("moe.layer_parameters", "no_router")
def lp_no_router(d, E, k, h, s):
    expert = 3 * d * h
    return E * expert + s * expert, k * expert + s * expert


@wrong("moe.layer_parameters", "bias_counted")
def lp_with_bias(d, E, k, h, s):
    router = E * d + E  # weight and e_score_correction_bias
    expert = 3 * d * h
    return router + E * expert + s * expert, router + k * expert + s * expert


@wrong("moe.layer_parameters", "active_without_shared")
def lp_active_routed_only(d, E, k, h, s):
    expert = 3 * d * h
    return E * d + (E + s) * expert, E * d + k * expert


@right("moe.layer_parameters")
def lp_ok_lib(d, E, k, h, s):
    cfg = moe.MoEConfig(E, k, h, n_shared=s)
    return cfg.num_parameters(d), cfg.num_active_parameters(d)


@right("moe.layer_parameters")
def lp_ok_built(d, E, k, h, s):
    """Build a layer with the same shapes on the meta device and count; active by subtraction."""
    with torch.device("meta"):
        layer = moe.MoE(d, E, k, h, n_shared=s)
    total = sum(p.numel() for p in layer.parameters())
    return total, total - (E - k) * 3 * d * h


# -- the lists --------------------------------------------------------------------------------------

REALISTIC = [  # answers made by a factory: (exercise, answer, mistake)
    ("moe.route", _bugged("biased_weights"), "bias_in_weights"),
    ("moe.route", _bugged("no_bias"), "bias_ignored"),
    ("moe.route", _bugged("no_norm"), "no_renormalisation"),
    ("moe.route", _bugged("no_scale"), "no_scale"),
    ("moe.route", _bugged("groups_max"), "groups_by_max"),
    ("moe.route", _bugged("groups_unbiased"), "groups_unbiased"),
    ("moe.route", _bugged("no_groups"), "no_group_limit"),
    ("moe.route", _bugged("zero_mask"), "masked_with_zero"),
    ("moe.route", _bugged("softmax"), None),
    ("moe.update_bias", _bugged_update("flipped"), "wrong_direction"),
    ("moe.update_bias", _bugged_update("where"), "ties_pushed"),
    ("moe.update_bias", _bugged_update("first_only"), "first_choice_only"),
    ("moe.update_bias", _bugged_update("mean_N"), "mean_without_k"),
    ("moe.update_bias", _bugged_update("proportional"), "proportional"),
    ("moe.quantile_bias", _bugged_quantile("kth"), "kth_cutoff"),
    ("moe.quantile_bias", _bugged_quantile("unbiased"), "unbiased_cutoff"),
    ("moe.quantile_bias", _bugged_quantile("sign"), "flipped"),
    ("moe.quantile_bias", _bugged_quantile("upper"), "upper_quantile"),
    ("moe.quantile_bias", _bugged_quantile("no_centre"), "not_centred"),
    ("moe.quantile_bias", _bugged_quantile("increment"), "added"),
]

CORRECT = {  # answers made by a factory
    "moe.route": (_bugged(None),),
    "moe.update_bias": (_bugged_update(None),),
    "moe.quantile_bias": (_bugged_quantile(None),),
}


def test_the_route_cases_can_tell_each_mistake_apart():
    """The cases hold one group and several, scale 1 and not, both dtypes, a bias that flips
    selections, and biases all negative (where a 0 mask wins); group mistakes pass the one-group
    cases and fail a group-limited one."""
    cases = checks.EXERCISES["moe.route"].cases()
    assert {c.args[3] > 1 for c in cases} == {True, False}
    assert {c.args[5] == 1.0 for c in cases} == {True, False}
    assert {c.args[0].dtype for c in cases} == {torch.float32, torch.float64}
    assert any(float((c.args[0] + c.args[1]).max()) < 0 for c in cases)
    for bug, name in (("groups_max", "groups_by_max"), ("no_groups", "no_group_limit")):
        result = run("moe.route", _bugged(bug))
        assert result.mistake == name
        assert cases[result.failed_case - 1].args[3] > 1
        assert result.n_passed >= sum(c.args[3] == 1 for c in cases)
    flips = 0
    for c in cases:
        sel = rt_ok_lib(*c.args) > 0
        unbiased = _bugged("no_bias")(*c.args) > 0
        flips += int((sel != unbiased).any(dim=-1).sum())
    assert flips > 0


def test_the_route_reference_is_the_library_and_weights_sum_to_the_scale():
    for c in checks.EXERCISES["moe.route"].cases():
        ref = checks.EXERCISES["moe.route"].reference(*c.args)
        assert torch.allclose(ref, rt_ok_lib(*c.args), atol=1e-6, rtol=0)
        sums = ref.sum(-1).double()
        assert torch.allclose(sums, torch.full_like(sums, c.args[5]), atol=1e-5)
        assert int((ref > 0).sum(-1).min()) == c.args[2]


def test_the_route_reference_equals_transformers_deepseek_v3_router():
    """transformers' DeepseekV3TopkRouter with an identity weight scores sigmoid(x), so feeding
    it x = logit(scores) routes exactly the checker's scores."""
    pytest.importorskip("transformers")
    ds = import_without_fla("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    for c in checks.EXERCISES["moe.route"].cases():
        scores, bias = (a.float() for a in c.args[:2])
        top_k, n_group, topk_group, scale = c.args[2:]
        N, E = scores.shape
        cfg = DeepseekV3Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=top_k,
                               n_group=n_group, topk_group=topk_group,
                               routed_scaling_factor=scale, norm_topk_prob=True)
        router = ds.DeepseekV3TopkRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.eye(E))
            router.e_score_correction_bias.copy_(bias)
        _, w, idx = router(torch.logit(scores.double()).float())
        hf = torch.zeros(N, E).scatter(1, idx, w)
        ours = checks.EXERCISES["moe.route"].reference(scores, bias, *c.args[2:])
        assert (hf - ours).abs().max() < 1e-5, c.label


def test_the_update_reference_is_the_library_rule():
    for c in checks.EXERCISES["moe.update_bias"].cases():
        bias, idx, speed = c.args
        ref = checks.EXERCISES["moe.update_bias"].reference(bias, idx, speed)
        tol = 1e-12 if bias.dtype == torch.float64 else 1e-8  # float32: speed rounded first
        assert torch.allclose(ref, ub_ok_lib(bias, idx, speed), atol=tol, rtol=0)
        assert ref.dtype == bias.dtype
    tie = [c for c in checks.EXERCISES["moe.update_bias"].cases() if "exactly" in c.label]
    bias, idx, speed = tie[0].args
    assert len(set(idx[0].tolist())) == idx.shape[1]  # no expert twice in a token
    moved = (checks.EXERCISES["moe.update_bias"].reference(bias, idx, speed) != bias)
    assert int(moved.sum()) == 2  # only the one above and the one below the mean


def test_the_parameter_reference_counts_the_built_layer():
    for c in checks.EXERCISES["moe.layer_parameters"].cases():
        assert checks.EXERCISES["moe.layer_parameters"].reference(*c.args) == lp_ok_built(*c.args)


def test_the_quantile_reference_is_the_library():
    for c in checks.EXERCISES["moe.quantile_bias"].cases():
        ref = checks.EXERCISES["moe.quantile_bias"].reference(*c.args)
        assert ref.dtype == c.args[0].dtype
        assert torch.allclose(ref.double(), moe.quantile_bias(*c.args).double(), atol=1e-6, rtol=0)

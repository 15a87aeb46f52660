"""Chapter 16's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants; and the
references against the library (tinyk3.optim) and against inputs built to reach the bound.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import copy

import torch

from helpers import right, run, wrong
from tinyk3 import checks, optim
from tinyk3.layers import MultiHeadLatentAttention

# -- qk_norm.max_logit ----------------------------------------------------------------------------


def _normed(W, x):
    """RMSNorm without eps or gain: W x divided by its root-mean-square."""
    y = W @ x
    return y / y.pow(2).mean().sqrt()


@wrong("qk_norm.max_logit", "weights_too")
def ml_cauchy_schwarz_with_weights(W_q, W_k, gamma_q, gamma_k):
    d = gamma_q.numel()
    s_q, s_k = torch.linalg.svdvals(W_q)[0], torch.linalg.svdvals(W_k)[0]
    return float((gamma_q * gamma_k).abs().max() * s_q * s_k * d ** 0.5)


@wrong("qk_norm.max_logit", "separate_maxima")
def ml_each_gain_alone(W_q, W_k, gamma_q, gamma_k):
    d = gamma_q.numel()
    return float(gamma_q.abs().max() * gamma_k.abs().max() * d / d ** 0.5)


@wrong("qk_norm.max_logit", "gain_norms")
def ml_all_entries_one(W_q, W_k, gamma_q, gamma_k):
    d = gamma_q.numel()
    q = gamma_q * torch.ones(d, dtype=gamma_q.dtype)  # "every normed entry is ±1"
    k = gamma_k * torch.ones(d, dtype=gamma_k.dtype)
    return float(q.norm() * k.norm() / d ** 0.5)


@wrong("qk_norm.max_logit", "unit_length")
def ml_unit_vectors(W_q, W_k, gamma_q, gamma_k):
    d = gamma_q.numel()
    return float((gamma_q * gamma_k).abs().max()) / d ** 0.5


@wrong("qk_norm.max_logit", "signed")
def ml_largest_product(W_q, W_k, gamma_q, gamma_k):
    d = gamma_q.numel()
    return (gamma_q * gamma_k).max().item() * d ** 0.5


@wrong("qk_norm.max_logit", None)
def ml_sampled(W_q, W_k, gamma_q, gamma_k):
    """The largest logit over random inputs: always below the supremum."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(W_q.shape[1], 256, generator=g, dtype=W_q.dtype)
    q = W_q @ x
    q = q / q.pow(2).mean(0).sqrt() * gamma_q[:, None]
    k = W_k @ x
    k = k / k.pow(2).mean(0).sqrt() * gamma_k[:, None]
    return float((q.T @ k).abs().max()) / gamma_q.numel() ** 0.5


@right("qk_norm.max_logit")
def ml_ok_constructed(W_q, W_k, gamma_q, gamma_k):
    """Solve for the inputs that put q̂ and k̂ on each channel and run them through the head."""
    d = gamma_q.numel()
    best = 0.0
    for j in range(d):
        e = torch.zeros(d, dtype=W_q.dtype)
        e[j] = 1.0
        x = torch.linalg.lstsq(W_q, e[:, None]).solution[:, 0]
        x2 = torch.linalg.lstsq(W_k, e[:, None]).solution[:, 0]
        q, k = _normed(W_q, x) * gamma_q, _normed(W_k, x2) * gamma_k
        best = max(best, abs(float(q @ k)) / d ** 0.5)
    return best


@right("qk_norm.max_logit")
def ml_ok_operator_norm(W_q, W_k, gamma_q, gamma_k):
    """max over |q̂| = |k̂| = √d of q̂ᵀ diag(γ_q γ_k) k̂ / √d: d/√d times a spectral norm."""
    d = gamma_q.numel()
    return d ** 0.5 * torch.linalg.matrix_norm(torch.diag(gamma_q * gamma_k), 2).item()


# -- qk_clip.mla_scales ---------------------------------------------------------------------------


def _learner_scales(max_logits, tau, alpha, dn, dr, dv, bug=None):
    """Head by head, in Python lists; `bug` names the one thing done wrong."""
    q, kv = [], []
    for s in max_logits.tolist():
        if bug == "no_min":
            eta = tau / s
        elif bug == "inverted":
            eta = min(1.0, s / tau)
        else:
            eta = min(1.0, tau / s) if s > tau else 1.0
        aq, ak = (1 - alpha, alpha) if bug == "swap" else (alpha, 1 - alpha)
        if bug == "sqrt_all":  # the multi-head rule applied to MLA
            aq = ak = 0.5
        rope = {"rope_alpha": eta ** aq, "rope_one": 1.0}.get(bug, eta)
        if bug == "sqrt_all":
            rope = eta ** 0.5
        v = eta ** ak if bug == "v_too" else 1.0
        q += [eta ** aq] * dn + [rope] * dr
        kv += [eta ** ak] * dn + [v] * dv
    return (torch.tensor(q, dtype=max_logits.dtype), torch.tensor(kv, dtype=max_logits.dtype))


def _bugged_scales(bug):
    def fn(max_logits, tau, alpha, dn, dr, dv):
        return _learner_scales(max_logits, tau, alpha, dn, dr, dv, bug=bug)

    fn.__name__ = f"sc_{bug}"
    return fn


@right("qk_clip.mla_scales")
def sc_ok_lib(max_logits, tau, alpha, dn, dr, dv):
    """Read the scales off tinyk3.optim.qk_clip_ applied to an MLA layer whose weights are 1."""
    H = max_logits.shape[0]
    layer = MultiHeadLatentAttention(8, H, kv_lora_rank=4, qk_nope_head_dim=dn,
                                     qk_rope_head_dim=dr, v_head_dim=dv, q_lora_rank=3)
    layer = layer.to(max_logits.dtype)
    with torch.no_grad():
        layer.q_b_proj.weight.fill_(1.0)
        layer.kv_b_proj.weight.fill_(1.0)
    optim.qk_clip_(layer, max_logits, tau, alpha)
    return (layer.q_b_proj.weight[:, 0].detach().clone(),
            layer.kv_b_proj.weight[:, 0].detach().clone())


@right("qk_clip.mla_scales")
def sc_ok_broadcast(max_logits, tau, alpha, dn, dr, dv):
    eta = (tau / max_logits).clamp(max=1.0)
    eta = torch.where(max_logits > 0, eta, torch.ones_like(eta))  # a negative S_max: no clip
    q = torch.stack([eta ** alpha] * dn + [eta] * dr, dim=1)
    kv = torch.stack([eta ** (1 - alpha)] * dn + [torch.ones_like(eta)] * dv, dim=1)
    return q.flatten(), kv.flatten()


# -- the lists --------------------------------------------------------------------------------------

REALISTIC = [  # answers made by a factory: (exercise, answer, mistake)
    ("qk_clip.mla_scales", _bugged_scales("no_min"), "no_min"),
    ("qk_clip.mla_scales", _bugged_scales("inverted"), "inverted"),
    ("qk_clip.mla_scales", _bugged_scales("rope_alpha"), "rope_like_nope"),
    ("qk_clip.mla_scales", _bugged_scales("rope_one"), "rope_untouched"),
    ("qk_clip.mla_scales", _bugged_scales("v_too"), "values_scaled"),
    ("qk_clip.mla_scales", _bugged_scales("swap"), "alpha_swapped"),
    ("qk_clip.mla_scales", _bugged_scales("sqrt_all"), "mha_rule"),
]

CORRECT = {  # answers made by a factory
    "qk_clip.mla_scales": (_bugged_scales(None),),
}


def test_the_logit_reference_is_attained_and_never_exceeded():
    """At every case: inputs solved to put q̂ and k̂ on the best channel reach the reference
    through the head itself (to 1e-9), random inputs stay below it, and QK-Clip's rescaling of
    the weights (W_q·η^α, W_k·η^(1-α)) leaves it unchanged: the clip is a no-op here."""
    ex = checks.EXERCISES["qk_norm.max_logit"]
    g = torch.Generator().manual_seed(1)
    for c in ex.cases():
        W_q, W_k, gamma_q, gamma_k = c.args
        ref = ex.reference(*c.args)
        assert abs(ml_ok_constructed(*c.args) - ref) <= 1e-9 * max(1.0, ref), c.label
        x = torch.randn(W_q.shape[1], 512, generator=g, dtype=torch.float64)
        q = W_q @ x
        q = q / q.pow(2).mean(0).sqrt() * gamma_q[:, None]
        k = W_k @ x.flip(1)
        k = k / k.pow(2).mean(0).sqrt() * gamma_k[:, None]
        sampled = float((q.T @ k).abs().max()) / gamma_q.numel() ** 0.5
        assert sampled <= ref * (1 + 1e-12), c.label
        eta = 0.01
        assert abs(ex.reference(W_q * eta ** 0.5, W_k * eta ** 0.5, gamma_q, gamma_k) - ref) \
            <= 1e-12 * ref
    # the cases tell the pairing apart: the separate maxima pass the uniform-gain cases only
    assert 1 <= run("qk_norm.max_logit", ml_each_gain_alone).n_passed < len(ex.cases())


def test_the_scales_reference_clips_an_mla_layer_to_tau():
    """The reference's scales applied to a random MLA layer's rows: every head over τ ends at
    τ, the rest unchanged (the property QK-Clip is for)."""
    torch.manual_seed(0)
    layer = MultiHeadLatentAttention(16, 4, kv_lora_rank=8, qk_nope_head_dim=6,
                                     qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=5)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(3.0)
    x = 3 * torch.randn(1, 10, 16)
    m = optim.attention_max_logits(layer, x)
    tau = float(m.median())
    clipped = copy.deepcopy(layer)
    q_s, kv_s = checks.EXERCISES["qk_clip.mla_scales"].reference(m, tau, 0.5, 6, 4, 6)
    with torch.no_grad():
        clipped.q_b_proj.weight.mul_(q_s[:, None])
        clipped.kv_b_proj.weight.mul_(kv_s[:, None])
    after = optim.attention_max_logits(clipped, x)
    over = m > tau
    assert torch.allclose(after[over], torch.full_like(after[over], tau), rtol=1e-5)
    assert torch.equal(after[~over], m[~over])
    lib = copy.deepcopy(layer)
    optim.qk_clip_(lib, m, tau)
    assert torch.equal(lib.q_b_proj.weight, clipped.q_b_proj.weight)
    assert torch.equal(lib.kv_b_proj.weight, clipped.kv_b_proj.weight)


def test_the_scales_cases_tell_alpha_and_the_boundary_apart():
    cases = checks.EXERCISES["qk_clip.mla_scales"].cases()
    assert {c.args[2] == 0.5 for c in cases} == {True, False}
    assert any(bool((c.args[0] == c.args[1]).any()) for c in cases)  # a head exactly at τ
    assert any(bool((c.args[0] < 0).any()) for c in cases)
    assert any(c.args[4] == 0 for c in cases)
    for c in cases:
        assert bool((c.args[0] > c.args[1]).any()) and bool((c.args[0] < c.args[1]).any())
    result = run("qk_clip.mla_scales", _bugged_scales("swap"))
    assert cases[result.failed_case - 1].args[2] != 0.5

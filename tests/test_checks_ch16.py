"""Chapter 16's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants; and the
references against the library (tinyk3.optim) and torch.optim.Muon's Newton–Schulz.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import copy

import torch

from helpers import right, run
from tinyk3 import checks, optim
from tinyk3.layers import MultiHeadLatentAttention

# -- muon.newton_schulz ---------------------------------------------------------------------------


def _learner_ns(G, steps, a, b, c, bug=None):
    """A learner's Newton–Schulz, written the obvious way; `bug` names the one thing done wrong."""
    X = G.bfloat16() if bug == "bf16" else G.clone()
    transposed = False
    if X.size(0) > X.size(1):
        X = X.T
        transposed = True
    if bug == "spectral":
        X = X / torch.linalg.svdvals(X)[0]
    elif bug == "no_eps":
        X = X / torch.sqrt((X * X).sum())
    elif bug != "no_norm":
        X = X / max(X.norm(), 1e-7)
    n = steps - 1 if bug == "short" else steps
    for _ in range(n):
        A = X @ X.T
        if bug == "swap":
            B = c * A + b * A @ A
        else:
            B = b * A + c * A @ A
        X = a * X + B @ X
    if transposed and bug != "no_back":
        X = X.T
    if bug == "float32":
        return X.float()
    return X.to(G.dtype)


def _bugged_ns(bug):
    def fn(G, steps, a, b, c):
        return _learner_ns(G, steps, a, b, c, bug=bug)

    fn.__name__ = f"ns_{bug}"
    return fn


@right("muon.newton_schulz")
def ns_ok_right(G, steps, a, b, c):
    """Never transposes, and multiplies on the right with the other Gram matrix:
    p(X Xᵀ) X = X p(Xᵀ X), the same matrix."""
    X = G / G.norm().clamp_min(1e-7)
    for _ in range(steps):
        A = X.T @ X
        X = a * X + X @ (b * A + c * A @ A)
    return X


@right("muon.newton_schulz")
def ns_ok_lib(G, steps, a, b, c):
    return optim.newton_schulz(G, steps, (a, b, c))


@right("muon.newton_schulz")
def ns_ok_polynomial(G, steps, a, b, c):
    """Through the SVD: each singular value of G / ‖G‖_F through the scalar polynomial."""
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    s = S / max(G.double().norm(), 1e-7)
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return (U @ torch.diag(s) @ Vh).to(G.dtype)


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
    ("muon.newton_schulz", _bugged_ns("no_norm"), "no_normalisation"),
    ("muon.newton_schulz", _bugged_ns("spectral"), "spectral_norm"),
    ("muon.newton_schulz", _bugged_ns("no_eps"), "no_eps"),
    ("muon.newton_schulz", _bugged_ns("swap"), "b_and_c_swapped"),
    ("muon.newton_schulz", _bugged_ns("no_back"), "not_transposed_back"),
    ("muon.newton_schulz", _bugged_ns("short"), "one_step_short"),
    ("muon.newton_schulz", _bugged_ns("bf16"), None),  # bf16 rounding: no exact match
    ("qk_clip.mla_scales", _bugged_scales("no_min"), "no_min"),
    ("qk_clip.mla_scales", _bugged_scales("inverted"), "inverted"),
    ("qk_clip.mla_scales", _bugged_scales("rope_alpha"), "rope_like_nope"),
    ("qk_clip.mla_scales", _bugged_scales("rope_one"), "rope_untouched"),
    ("qk_clip.mla_scales", _bugged_scales("v_too"), "values_scaled"),
    ("qk_clip.mla_scales", _bugged_scales("swap"), "alpha_swapped"),
    ("qk_clip.mla_scales", _bugged_scales("sqrt_all"), "mha_rule"),
]

CORRECT = {  # answers made by a factory
    "muon.newton_schulz": (_bugged_ns(None),),
    "qk_clip.mla_scales": (_bugged_scales(None),),
}


def test_a_float32_answer_fails_only_the_float64_cases():
    result = run("muon.newton_schulz", _bugged_ns("float32"))
    assert result.status == "failed" and "wrong dtype" in result.report


def test_the_newton_schulz_reference_is_the_library_and_torch_muons_iteration():
    """The checker's reference against tinyk3.optim.newton_schulz (float64: to 1e-12), and,
    run in bf16, against torch.optim.Muon's own _zeropower_via_newtonschulz (bf16 rounding:
    about 1e-2 relative)."""
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

    ex = checks.EXERCISES["muon.newton_schulz"]
    for c in ex.cases():
        G, steps, a, b, cc = c.args
        ref = ex.reference(G, steps, a, b, cc)
        lib = optim.newton_schulz(G, steps, (a, b, cc))
        tol = 1e-12 if G.dtype == torch.float64 else 1e-5
        assert (ref - lib).abs().max() <= tol * max(1.0, float(ref.abs().max())), c.label
        if G.abs().max() > 0 and steps == 5 and cc != 0.0:
            theirs = torch_ns(G.float(), (a, b, cc), steps, 1e-7).double()
            rel = float((theirs - ref.double()).norm() / ref.double().norm())
            assert rel < 5e-2, (c.label, rel)


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

"""tinyk3.optim: Newton–Schulz against the SVD, Muon against torch.optim.Muon, QK-Clip on
multi-head attention and MLA (chapter 16)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tinyk3.layers import (
    GatedAttention,
    KDAConfig,
    MLAConfig,
    MultiHeadLatentAttention,
    SoftmaxAttention,
    SoftmaxAttentionConfig,
)
from tinyk3.models import LM, LMConfig
from tinyk3.optim import (
    NS_COEFFICIENTS,
    Muon,
    QKClip,
    attention_max_logits,
    max_logits_per_head,
    muon_lr_scale,
    muon_param_groups,
    newton_schulz,
    per_head_newton_schulz,
    per_head_projections,
    qk_clip_,
    qk_clip_factors,
    split_params_for_muon,
)

SHAPES = [(64, 32), (32, 64), (48, 48), (96, 17), (1, 8)]


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _scalar_iterate(sigma, steps, coefficients=NS_COEFFICIENTS):
    a, b, c = coefficients
    for _ in range(steps):
        sigma = a * sigma + b * sigma ** 3 + c * sigma ** 5
    return sigma


# -- Newton–Schulz --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
def test_newton_schulz_maps_singular_values_by_the_polynomial_and_keeps_the_vectors(shape):
    """X = U p⁵(Σ/‖G‖_F) Vᵀ exactly (float64): the iteration acts on singular values only."""
    G = _randn(*shape)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    X = newton_schulz(G)
    expected = U @ torch.diag(_scalar_iterate(S / G.norm(), 5)) @ Vh
    assert (X - expected).abs().max() < 1e-12


@pytest.mark.parametrize("shape", SHAPES[:4], ids=[f"{m}x{n}" for m, n in SHAPES[:4]])
def test_newton_schulz_singular_values_land_in_the_band(shape):
    """Random Gaussian matrices: every singular value of the result in [0.68, 1.2], the band
    the quintic's five-fold iterate gives on (σ_min/‖G‖_F, 1]; the polar factor U Vᵀ is then
    within 0.32 in spectral norm."""
    G = _randn(*shape, seed=1)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    X = newton_schulz(G)
    s = torch.linalg.svdvals(X)
    assert 0.68 <= float(s.min()) and float(s.max()) <= 1.2, s
    assert float(torch.linalg.matrix_norm(X - U @ Vh, ord=2)) <= 0.32


def test_newton_schulz_converges_to_the_polar_factor_with_the_cubic():
    """The classic cubic coefficients (1.5, −0.5, 0) converge to U Vᵀ (slowly from small σ):
    the iteration is Newton–Schulz, and the quintic trades exactness for speed."""
    G = _randn(40, 24, seed=2)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    dist = [float(torch.linalg.matrix_norm(newton_schulz(G, n, (1.5, -0.5, 0.0)) - U @ Vh, ord=2))
            for n in (5, 20, 40)]
    assert dist[0] > dist[1] > dist[2] and dist[2] < 1e-10, dist


def test_newton_schulz_dtypes_transpose_and_zero():
    G = _randn(20, 12, seed=3)
    X64 = newton_schulz(G)
    X32 = newton_schulz(G.float())
    assert X32.dtype == torch.float32 and (X32.double() - X64).abs().max() < 1e-5
    Xb = newton_schulz(G.float(), dtype=torch.bfloat16)  # computed in bf16, returned in float32
    assert Xb.dtype == torch.float32
    rel = float((Xb.double() - X64).norm() / X64.norm())
    assert 1e-3 < rel < 6e-2, rel  # bf16's 8-bit mantissa: about 1e-2, never float32's 1e-6
    assert torch.equal(newton_schulz(G.T), X64.T)  # a tall matrix is done transposed
    assert torch.equal(newton_schulz(torch.zeros(5, 7)), torch.zeros(5, 7))
    batch = torch.stack([G, 2 * G])
    assert (newton_schulz(batch) - torch.stack([X64, X64])).abs().max() < 1e-12


def test_newton_schulz_rejects_bad_input():
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.randn(5))
    with pytest.raises(TypeError, match="dtype="):
        newton_schulz(torch.randn(4, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="floating-point"):
        newton_schulz(torch.ones(4, 4, dtype=torch.long), dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype must be"):
        newton_schulz(torch.randn(4, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="three numbers"):
        newton_schulz(torch.randn(4, 4), coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(torch.randn(4, 4), steps=-1)
    with pytest.raises(TypeError, match="tensor"):
        newton_schulz([[1.0, 2.0]])


# -- Muon ---------------------------------------------------------------------------------------


def test_lr_scales():
    assert muon_lr_scale((64, 256)) == pytest.approx(0.2 * 16)
    assert muon_lr_scale((256, 64), "original") == pytest.approx(2.0)
    assert muon_lr_scale((64, 256), "original") == 1.0
    with pytest.raises(ValueError, match="adjust_lr"):
        muon_lr_scale((4, 4), "adamw")
    with pytest.raises(ValueError, match="matrices"):
        muon_lr_scale((4, 4, 4))
    # Moonshot's scale gives an orthogonal update the RMS 0.2, whatever the shape
    for A, B in ((64, 256), (256, 64), (100, 100)):
        U, _, Vh = torch.linalg.svd(_randn(A, B), full_matrices=False)
        rms = float((U @ Vh).pow(2).mean().sqrt())
        assert muon_lr_scale((A, B)) * rms == pytest.approx(0.2, rel=1e-12)


def _run_pair(make_ours, make_torch, steps=6, shapes=((64, 32), (32, 96), (40, 40)), seed=0):
    """The same parameters and gradients through both optimisers; per step and parameter the
    distance between the parameters relative to the size of the reference's total update."""
    W = [_randn(*s, seed=seed + i, dtype=torch.float32) for i, s in enumerate(shapes)]
    ours = [w.clone().requires_grad_() for w in W]
    theirs = [w.clone().requires_grad_() for w in W]
    opt_a, opt_b = make_ours(ours), make_torch(theirs)
    W = [w.detach() for w in W]
    g = torch.Generator().manual_seed(seed + 100)
    rel = []
    for _ in range(steps):
        for a, b in zip(ours, theirs):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
        rel.append(max(float((a.detach() - b.detach()).norm() / (b.detach() - w).norm())
                       for a, b, w in zip(ours, theirs, W)))
    return rel


CONFIGS = [
    dict(adjust_lr="match_rms_adamw", weight_decay=0.1),
    dict(adjust_lr="original", weight_decay=0.0),
    dict(adjust_lr="match_rms_adamw", weight_decay=0.0, nesterov=False, momentum=0.9),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["moonshot-wd", "original", "plain-momentum"])
def test_muon_in_bf16_equals_torch_muon_exactly(cfg):
    """With Newton–Schulz in bf16, the same operations in the same order as torch.optim.Muon
    (fused addmm, EMA momentum by lerp): the parameters agree bit for bit on the CPU."""
    cfg = dict(cfg)
    adjust = cfg.pop("adjust_lr")
    rel = _run_pair(lambda p: Muon(p, lr=0.02, ns_dtype=torch.bfloat16, adjust_lr=adjust, **cfg),
                    lambda p: torch.optim.Muon(p, lr=0.02, adjust_lr_fn=adjust, **cfg))
    assert max(rel) == 0.0, rel


@pytest.mark.parametrize("cfg", CONFIGS, ids=["moonshot-wd", "original", "plain-momentum"])
def test_muon_in_float32_is_within_bf16_rounding_of_torch_muon(cfg):
    """Our default runs Newton–Schulz in float32, torch's in bf16 (unit roundoff 2⁻⁸ ≈ 4e-3,
    through ten matrix products per step): the parameters differ by about 1e-2 of the update
    (measured 0.8 to 1.5e-2), well below the 1 a wrong scale or sign would give. Tolerance
    3e-2; and float32 against float64 agrees to 1e-5, so the gap is torch's bf16."""
    cfg = dict(cfg)
    adjust = cfg.pop("adjust_lr")
    rel = _run_pair(lambda p: Muon(p, lr=0.02, adjust_lr=adjust, **cfg),
                    lambda p: torch.optim.Muon(p, lr=0.02, adjust_lr_fn=adjust, **cfg))
    assert 1e-3 < max(rel) < 3e-2, rel
    rel64 = _run_pair(lambda p: Muon(p, lr=0.02, adjust_lr=adjust, **cfg),
                      lambda p: Muon(p, lr=0.02, adjust_lr=adjust, ns_dtype=torch.float64, **cfg))
    assert max(rel64) < 1e-5, rel64


def test_sum_momentum_gives_the_same_update_as_the_moving_average():
    """Keller Jordan's M ← μM + g, u = g + μM is 1/(1 − μ) times the EMA form; Newton–Schulz
    divides by the norm first, so the updates agree (float64, to rounding)."""
    mu, lr = 0.95, 0.05
    W = _randn(30, 20, seed=4)
    p = W.clone().requires_grad_()
    opt = Muon([p], lr=lr)
    w_ref, M = W.clone(), torch.zeros_like(W)
    for step in range(5):
        g = _randn(30, 20, seed=10 + step)
        p.grad = g.clone()
        opt.step()
        M = mu * M + g
        w_ref = w_ref - lr * muon_lr_scale(W.shape) * newton_schulz(g + mu * M)
        assert (p.detach() - w_ref).abs().max() < 1e-12


def test_muon_rejects_what_it_cannot_optimise():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1, adjust_lr="adamw")
    with pytest.raises(ValueError, match="momentum"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1, momentum=1.0)
    with pytest.raises(ValueError, match="lr"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], lr=-1.0)
    with pytest.raises(ValueError, match="weight_decay"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1, weight_decay=-0.1)


def test_muon_skips_parameters_without_gradients_and_runs_a_closure():
    a, b = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3, 3))
    opt = Muon([a, b], lr=0.1)
    a.grad = torch.eye(3)
    assert opt.step(lambda: 7.0) == 7.0
    assert not torch.equal(a.detach(), torch.ones(3, 3)) and torch.equal(b.detach(), torch.ones(3, 3))


def _lm(mixer, tie=True, n_layer=2, d=32):
    return LMConfig(vocab_size=64, block_size=16, n_embd=d, pattern="A" * n_layer,
                    mixers={"A": mixer}, tie_embeddings=tie, norm="rmsnorm")


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_split_params_for_muon(tie):
    torch.manual_seed(0)
    model = LM(_lm(SoftmaxAttentionConfig(n_head=4), tie=tie))
    muon, other = split_params_for_muon(model)
    all_params = list(model.parameters())
    assert len(muon) + len(other) == len(all_params)
    assert {id(p) for p in muon} | {id(p) for p in other} == {id(p) for p in all_params}
    assert all(p.dim() == 2 for p in muon)
    excluded = {id(model.transformer.wte.weight), id(model.transformer.wpe.weight),
                id(model.lm_head.weight)}
    assert not excluded & {id(p) for p in muon}
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted({names[id(p)].split(".")[-2] for p in muon}) == [
        "c_fc", "c_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
    Muon(muon, lr=0.02)  # accepted


# -- QK-Clip -------------------------------------------------------------------------------------


def test_max_logits_per_head_against_a_loop():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 3, 7, 4, generator=g)
    k[:, :, -1] = 50.0  # the last key is seen only by the last query (bottom-right causal mask)
    q[:, :, :-1] *= -1  # every other query is pushed away from it: its logits would be large
    got = max_logits_per_head(q, k)
    for h in range(3):
        best = max(float(q[b, h, i] @ k[b, h, j]) / 2.0
                   for b in range(2) for i in range(5) for j in range(7) if j <= i + 2)
        assert got[h].item() == pytest.approx(best, rel=1e-6)
    full = max_logits_per_head(q, k, causal=False)
    assert bool((full >= got).all())
    shared = max_logits_per_head(q, k[:, :1], scale=1.0)  # one key for all heads
    assert shared.shape == (3,)
    with pytest.raises(ValueError, match="keys"):
        max_logits_per_head(q, k[:, :, :3])
    with pytest.raises(ValueError, match=r"\[B=2"):
        max_logits_per_head(q, k[:1])


def test_clip_factors():
    m = torch.tensor([250.0, 100.0, 99.0, -5.0, 0.0, 400.0])
    eta = qk_clip_factors(m, 100.0)
    assert torch.equal(eta, torch.tensor([0.4, 1.0, 1.0, 1.0, 1.0, 0.25]))
    assert eta.dtype == m.dtype
    with pytest.raises(ValueError, match="tau"):
        qk_clip_factors(m, 0.0)
    with pytest.raises(ValueError, match="NaN"):
        qk_clip_factors(torch.tensor([float("nan")]))
    with pytest.raises(TypeError, match="float"):
        qk_clip_factors(torch.tensor([1, 2]))


def _layers():
    torch.manual_seed(0)
    return {
        "mha": SoftmaxAttention(32, 4),
        "mla-rope": MultiHeadLatentAttention(32, 4, 16, 8, 4, 6, q_lora_rank=12),
        "mla-full-q": MultiHeadLatentAttention(32, 4, 16, 8, 4, 6),
        "mla-nope": MultiHeadLatentAttention(32, 4, 16, 8, 4, 6, use_rope=False),
    }


def _big(layer, seed=0):
    """Weights scaled up so the logits spread over tens; an input of 12 tokens."""
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(3.0)
    return 3 * torch.randn(2, 12, layer.d_model, generator=torch.Generator().manual_seed(seed))


def _all_logits(layer, x):
    """Every head's full causal logit matrix [B, H, T, T] (masked entries 0)."""
    if isinstance(layer, SoftmaxAttention):
        q, k, _, _ = layer.qkv(x)
        s = q @ k.transpose(-1, -2) * layer.head_dim ** -0.5
    else:
        qn, qr = layer.queries(x)
        c, kr = layer.latents(x)
        kn, _ = layer.expand(c)
        s = (qn @ kn.transpose(-1, -2) + qr @ kr.unsqueeze(1).transpose(-1, -2)) * layer.scale
    return s.tril()


@pytest.mark.parametrize("name", list(_layers()))
def test_qk_clip_bounds_the_heads_above_tau_and_leaves_the_rest_bit_for_bit(name):
    layer = _layers()[name]
    x = _big(layer)
    with torch.no_grad():
        before = attention_max_logits(layer, x)
        logits_before = _all_logits(layer, x)
    v = before.sort().values
    tau = float(v[1] + v[2]) / 2  # between the 2nd and 3rd largest: 2 heads over
    over = before > tau
    assert int(over.sum()) == 2
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    eta = qk_clip_(layer, before, tau)
    with torch.no_grad():
        after = attention_max_logits(layer, x)
        logits_after = _all_logits(layer, x)
    assert torch.allclose(eta[over], tau / before[over])
    assert bool((eta[~over] == 1).all())
    # the heads above τ end at τ (to rounding), every logit of theirs multiplied by η
    assert torch.allclose(after[over], torch.full_like(after[over], tau), rtol=1e-5, atol=0)
    assert bool((after <= tau * (1 + 1e-5)).all())
    assert torch.allclose(logits_after, logits_before * eta[None, :, None, None],
                          rtol=1e-5, atol=1e-4)
    # the heads below: their logits bit for bit, and so the weights of their rows
    assert torch.equal(after[~over], before[~over])
    assert torch.equal(logits_after[:, ~over], logits_before[:, ~over])
    new = layer.state_dict()
    if name == "mha":
        D = layer.head_dim
        for key in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"):
            old_h, new_h = state[key].view(4, D, -1), new[key].view(4, D, -1)
            assert torch.equal(old_h[~over], new_h[~over]), key
            assert torch.allclose(new_h[over], old_h[over] * eta[over].sqrt()[:, None, None])
        changed = {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"}
    else:
        dn, dr, dv = 8, 4, 6
        qkey = "q_b_proj.weight" if layer.q_lora_rank else "q_proj.weight"
        q_old, q_new = state[qkey].view(4, dn + dr, -1), new[qkey].view(4, dn + dr, -1)
        e = eta[:, None]
        assert torch.allclose(q_new[:, :dn], q_old[:, :dn] * e[..., None].sqrt())  # η^α
        assert torch.allclose(q_new[:, dn:], q_old[:, dn:] * e[..., None])  # η
        kv_old = state["kv_b_proj.weight"].view(4, dn + dv, -1)
        kv_new = new["kv_b_proj.weight"].view(4, dn + dv, -1)
        assert torch.allclose(kv_new[:, :dn], kv_old[:, :dn] * e[..., None].sqrt())  # η^(1−α)
        assert torch.equal(kv_new[:, dn:], kv_old[:, dn:])  # W_UV untouched
        assert torch.equal(q_new[~over], q_old[~over]) and torch.equal(kv_new[~over], kv_old[~over])
        changed = {qkey, "kv_b_proj.weight"}
    # nothing else moved: values, output projection, the shared rope key, norms
    assert {k for k in state if not torch.equal(state[k], new[k])} == changed


@pytest.mark.parametrize("name", ["mha", "mla-rope"])
def test_qk_clip_alpha_moves_the_split_but_not_the_logits(name):
    layer = _layers()[name]
    x = _big(layer, seed=1)
    before = attention_max_logits(layer, x)
    tau = float(before.min())  # every head but the smallest over
    other = copy.deepcopy(layer)
    qk_clip_(layer, before, tau, alpha=0.5)
    qk_clip_(other, before, tau, alpha=0.2)
    a, b = attention_max_logits(layer, x), attention_max_logits(other, x)
    assert torch.allclose(a, b, rtol=1e-5)
    key = "q_proj.weight" if name == "mha" else "q_b_proj.weight"
    assert not torch.allclose(layer.state_dict()[key], other.state_dict()[key])


@pytest.mark.parametrize("name", list(_layers()))
def test_qk_clip_below_tau_writes_nothing(name):
    layer = _layers()[name]
    x = _big(layer)
    m = attention_max_logits(layer, x)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    eta = qk_clip_(layer, m, float(m.max()))  # the largest head is AT τ: not over
    assert bool((eta == 1).all())
    assert all(torch.equal(state[k], v) for k, v in layer.state_dict().items())


def test_qk_clip_rejects_what_it_cannot_clip():
    layer = _layers()["mha"]
    with pytest.raises(ValueError, match=r"\[H=4\]"):
        qk_clip_(layer, torch.ones(3) * 200, 100.0)
    with pytest.raises(ValueError, match="convolution"):
        qk_clip_(SoftmaxAttention(32, 4, conv_size=4), torch.ones(4) * 200)
    with pytest.raises(TypeError, match="GatedAttention"):
        qk_clip_(GatedAttention(32, 4, 2, 8), torch.ones(4) * 200)
    with pytest.raises(ValueError, match="alpha"):
        qk_clip_(layer, torch.ones(4) * 200, alpha=1.5)


@pytest.mark.parametrize("mixer", [SoftmaxAttentionConfig(n_head=4),
                                   MLAConfig(n_head=4, kv_lora_rank=16, qk_nope_head_dim=8,
                                             qk_rope_head_dim=4, v_head_dim=8)],
                         ids=["mha", "mla"])
def test_qkclip_records_in_training_forward_passes_and_clips_every_layer(mixer):
    torch.manual_seed(0)
    model = LM(_lm(mixer, tie=False))
    with torch.no_grad():
        for blk in model.transformer.h:  # large queries and keys: logits over τ = 5
            for p in blk.attn.parameters():
                p.mul_(4.0)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with QKClip(model, tau=5.0) as clip:
        assert sorted(clip.layers) == ["transformer.h.0.attn", "transformer.h.1.attn"]
        model.eval()
        model(idx)
        assert clip.max_logits == {}  # eval passes are not recorded
        model.train()
        model(idx)
        first = {n: m.clone() for n, m in clip.max_logits.items()}
        blk = model.transformer.h[0]
        x0 = blk.ln_1(model.transformer.wte(idx) + model.transformer.wpe(torch.arange(16)))
        assert torch.allclose(first["transformer.h.0.attn"], attention_max_logits(blk.attn, x0))
        assert clip.largest() == max(float(m.max()) for m in first.values())
        clip.tau = tau = 0.5 * clip.largest()  # some heads over τ
        etas = clip.clip_()
        assert clip.max_logits == {}
        assert set(etas) == set(first)
        model(idx)  # layer 0 sees the same input: its heads are now at most τ
        assert float(clip.max_logits["transformer.h.0.attn"].max()) <= tau * (1 + 1e-5)
        assert bool((etas["transformer.h.0.attn"] < 1).any())
    assert not model.transformer.h[0].attn._forward_pre_hooks  # removed on exit
    with pytest.raises(ValueError, match="no SoftmaxAttention"):
        QKClip(torch.nn.Linear(3, 3))
    assert math.isinf(QKClip(model).largest())


# -- Per-Head Muon (Kimi K3) ------------------------------------------------------------------


@pytest.mark.parametrize("heads, d, n", [(4, 8, 32), (3, 16, 5), (1, 6, 6), (8, 1, 10)])
def test_per_head_newton_schulz_is_each_block_on_its_own(heads, d, n):
    G = _randn(heads * d, n, seed=heads + d + n)
    G[:d] *= 1e-3  # one head's gradient far smaller than the others'
    out = per_head_newton_schulz(G, heads)
    loop = torch.cat([newton_schulz(G[h * d:(h + 1) * d]) for h in range(heads)])
    assert out.shape == G.shape and (out - loop).abs().max() < 1e-13
    whole = newton_schulz(G)
    if heads > 1 and min(d, n) > 1:
        # per head, the small head's block is as large as the others; in the whole matrix not
        assert torch.linalg.svdvals(out[:d]).max() > 0.6
        assert torch.linalg.svdvals(whole[:d]).max() < 0.1
    G32 = G.float()
    assert (per_head_newton_schulz(G32, heads) - loop.float()).abs().max() < 1e-4
    assert per_head_newton_schulz(G32, heads, dtype=torch.bfloat16).dtype == torch.float32


def test_per_head_newton_schulz_rejects_bad_input():
    with pytest.raises(ValueError, match="do not split into 3 heads"):
        per_head_newton_schulz(_randn(8, 4), 3)
    with pytest.raises(ValueError, match="heads"):
        per_head_newton_schulz(_randn(8, 4), 0)
    with pytest.raises(ValueError, match=r"matrix \[heads"):
        per_head_newton_schulz(_randn(2, 8, 4), 2)


def test_muon_with_a_heads_group_steps_each_block_on_its_own():
    """One step, written out: momentum, Nesterov, per-head Newton–Schulz, the block's scale."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(_randn(4 * 6, 20, seed=1))
    v = torch.nn.Parameter(_randn(10, 20, seed=2))
    w0, v0 = w.detach().clone(), v.detach().clone()
    opt = Muon([{"params": [w], "heads": 4}, {"params": [v]}], lr=0.1, momentum=0.9,
               weight_decay=0.01)
    gw, gv = _randn(24, 20, seed=3), _randn(10, 20, seed=4)
    w.grad, v.grad = gw.clone(), gv.clone()
    opt.step()
    for p, p0, g, heads in ((w, w0, gw, 4), (v, v0, gv, None)):
        m = 0.1 * g  # the moving average after one step, from zero
        u = 0.1 * g + 0.9 * m
        if heads:
            O = torch.cat([newton_schulz(b) for b in u.split(6)])
            scale = 0.2 * math.sqrt(max(6, 20))
        else:
            O, scale = newton_schulz(u), 0.2 * math.sqrt(max(10, 20))
        want = p0 * (1 - 0.1 * 0.01) - 0.1 * scale * O
        assert (p.detach() - want).abs().max() < 1e-13
    with pytest.raises(ValueError, match="heads=5"):
        Muon([{"params": [w], "heads": 5}], lr=0.1)


def test_per_head_projections_and_groups():
    torch.manual_seed(0)
    mla = MLAConfig(n_head=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                    qk_rope_head_dim=2, v_head_dim=4)
    model = LM(LMConfig(vocab_size=32, block_size=16, n_embd=16,
                        pattern=(mla, KDAConfig(n_head=2, head_dim=8),
                                 SoftmaxAttentionConfig(n_head=4)),
                        pos_emb=False, norm="rmsnorm", tie_embeddings=False))
    heads = per_head_projections(model)
    assert heads == {
        "transformer.h.0.attn.q_b_proj.weight": 2, "transformer.h.0.attn.kv_b_proj.weight": 2,
        "transformer.h.1.attn.q_proj.weight": 2, "transformer.h.1.attn.k_proj.weight": 2,
        "transformer.h.1.attn.v_proj.weight": 2,
        "transformer.h.2.attn.q_proj.weight": 4, "transformer.h.2.attn.k_proj.weight": 4,
        "transformer.h.2.attn.v_proj.weight": 4}
    names = {id(p): n for n, p in model.named_parameters()}
    groups, rest = muon_param_groups(model)
    muon, other = split_params_for_muon(model)
    assert [id(p) for p in rest] == [id(p) for p in other]
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in muon)
    for g in groups:
        for p in g["params"]:
            assert heads.get(names[id(p)]) == g["heads"]
    assert {g["heads"] for g in groups} == {None, 2, 4}
    plain, _ = muon_param_groups(model, per_head=False)
    assert len(plain) == 1 and "heads" not in plain[0]
    opt = Muon(groups, lr=0.02)
    x = torch.randint(0, 32, (2, 8))
    model(x).square().mean().backward()
    before = model.transformer.h[0].attn.kv_b_proj.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.transformer.h[0].attn.kv_b_proj.weight)

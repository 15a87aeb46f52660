"""Load balancing of the mixture of experts while it trains: Kimi K3's Quantile Balancing
(``moe.quantile_bias``) against the report's rule written out independently here (numpy, one
expert and one token at a time), both forms (exact and histogram); the auxiliary loss against
its formula; the ``Balancer`` that trains an MoE with each rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tinyk3.layers import moe


def _report_rule(scores: np.ndarray, bias: np.ndarray, k: int, num_bins=None) -> np.ndarray:
    """Kimi K3 report §2.3.3 as its readers quote it, token by token: cutoff = the (k+1)-th
    largest biased score; required bias = cutoff − score; new bias = the k/E quantile of each
    expert's required biases (numpy's linear quantile, or the 1,000-bin histogram over
    [min b − 1, max b + 1] with linear interpolation inside the bin), mean-centred."""
    T, E = scores.shape
    required = np.empty((T, E))
    for t in range(T):
        biased = sorted(scores[t] + bias, reverse=True)
        cutoff = biased[k]  # 0-based: the (k+1)-th largest
        required[t] = cutoff - scores[t]
    out = np.empty(E)
    for e in range(E):
        if num_bins is None:
            out[e] = np.quantile(required[:, e], k / E)
            continue
        lo, hi = bias.min() - 1.0, bias.max() + 1.0
        width = (hi - lo) / num_bins
        counts = [0] * num_bins
        for r in required[:, e]:
            counts[min(max(int(math.floor((r - lo) / width)), 0), num_bins - 1)] += 1
        target, seen = T * k / E, 0
        for j, c in enumerate(counts):
            if seen + c >= target:
                out[e] = lo + width * (j + (target - seen) / c)
                break
            seen += c
    return out - out.mean()


def _skewed(T, E, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=dtype)
    logits[:, : max(1, E // 8)] += 1.5
    return torch.sigmoid(logits), 0.05 * torch.randn(E, generator=g, dtype=dtype)


@pytest.mark.parametrize("T, E, k", [(200, 8, 2), (513, 16, 4), (64, 32, 1), (300, 6, 5)])
@pytest.mark.parametrize("num_bins", [None, 1000, 37])
def test_quantile_bias_equals_the_report_rule(T, E, k, num_bins):
    scores, bias = _skewed(T, E, seed=T + E + k)
    ours = moe.quantile_bias(scores, bias, k, num_bins=num_bins)
    ref = _report_rule(scores.numpy(), bias.numpy(), k, num_bins)
    assert ours.dtype == torch.float64 and ours.shape == (E,)
    assert np.abs(ours.numpy() - ref).max() < 1e-12
    assert abs(float(ours.sum())) < 1e-12  # mean-centred


def test_histogram_estimate_approaches_the_exact_quantile():
    scores, bias = _skewed(4000, 16, seed=1)
    exact = moe.quantile_bias(scores, bias, 2)
    errs = [float((moe.quantile_bias(scores, bias, 2, num_bins=n) - exact).abs().max())
            for n in (10, 100, 1000)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 2e-3  # one bin is 2.1e-3 wide here


def test_one_update_balances_most_of_the_load():
    """Each expert's new bias is where its load on this batch would be k/E with the other
    biases held: applied together (and mean-centred) they get most of the way at once."""
    scores, _ = _skewed(4096, 32, seed=2, dtype=torch.float32)
    bias = torch.zeros(32)
    k = 4
    before = moe.expert_load(moe.route(scores, top_k=k, bias=bias)[1], 32).float()
    ratios = []
    for _ in range(2):
        bias = moe.quantile_bias(scores, bias, k)
        load = moe.expert_load(moe.route(scores, top_k=k, bias=bias)[1], 32).float()
        ratios.append(float(load.max() / load.mean()))
    # measured: 4.11 before, 1.30 after one update, 1.07 after two
    assert before.max() / before.mean() > 4 and ratios[0] < 1.35 and ratios[1] < 1.1


def test_quantile_bias_bad_input():
    s, b = torch.rand(10, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="top_k must be in 1"):
        moe.quantile_bias(s, b, 8)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        moe.quantile_bias(s[0], b, 2)
    with pytest.raises(ValueError, match=r"bias must be a float tensor \[E=8\]"):
        moe.quantile_bias(s, torch.zeros(7), 2)
    with pytest.raises(ValueError, match="num_bins"):
        moe.quantile_bias(s, b, 2, num_bins=0)
    with pytest.raises(ValueError, match="top_k"):
        moe.quantile_bias(s, b, True)


def test_balance_loss_formula():
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    idx = scores.detach().topk(2, dim=-1).indices
    loss = moe.balance_loss(scores, idx, 2)
    f = [sum(int(e in row) for row in idx.tolist()) * 8 / (2 * 50) for e in range(8)]
    p = (scores / scores.sum(-1, keepdim=True)).mean(0).tolist()
    assert abs(loss.item() - sum(fi * pi for fi, pi in zip(f, p))) < 1e-12
    loss.backward()
    assert scores.grad.abs().sum() > 0
    uniform = torch.full((8, 8), 0.5, dtype=torch.float64)
    assert float(moe.balance_loss(uniform, torch.arange(8).reshape(4, 2).repeat(2, 1), 2)) == 1.0


def _train(rule, steps=60, seed=0, **kw):
    """An MoE regression on skewed inputs (a constant shared channel that every expert's
    router weight sees): task loss and the busiest expert's load over the mean, per step."""
    torch.manual_seed(seed)
    layer = moe.MoE(16, 8, 2, 16)
    with torch.no_grad():
        layer.router.weight[:2, 0] += 2.0  # two favoured experts
    model = torch.nn.Sequential(layer)
    bal = None if rule == "none" else moe.Balancer(model, rule, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(16, 16, generator=g)
    hist = []
    for _ in range(steps):
        x = torch.randn(256, 16, generator=g)
        x[:, 0] = 1.0
        loss = F.mse_loss(layer(x), torch.tanh(x @ target))
        total = loss + (bal.loss() if bal else 0.0)
        opt.zero_grad()
        total.backward()
        opt.step()
        load = moe.expert_load(layer.last_indices, 8).float()
        hist.append(float(load.max() / load.mean()))
        if bal:
            bal.step()
    return hist


def test_balancer_rules_balance_a_trainable_router():
    none = _train("none")
    quant = _train("quantile")
    sign = _train("sign", speed=1e-2)
    aux = _train("aux", alpha=1.0)
    assert min(none[-10:]) > 2.0  # left alone, the two favoured experts stay overloaded
    assert max(quant[-10:]) < 1.5
    assert max(sign[-10:]) < 1.8
    assert sum(aux[-10:]) / 10 < sum(none[-10:]) / 10


def test_balancer_step_applies_the_rules():
    torch.manual_seed(0)
    layer = moe.MoE(8, 6, 2, 4)
    with torch.no_grad():
        layer.router.e_score_correction_bias.copy_(0.1 * torch.randn(6))
    xs = [torch.randn(20, 8) for _ in range(2)]
    for rule, kw in (("quantile", {"num_bins": 50}), ("sign", {"speed": 0.01})):
        bal = moe.Balancer(layer, rule, **kw)
        bias = layer.router.e_score_correction_bias.clone()
        scores, idx = [], []
        layer.train()
        for x in xs:
            layer(x)
            scores.append(layer.router.scores(x))
            idx.append(layer.last_indices)
        load = moe.expert_load(torch.cat(idx), 6)
        want = (moe.quantile_bias(torch.cat(scores), bias, 2, num_bins=50) if rule == "quantile"
                else moe.update_bias(bias, load, 0.01))
        loads = bal.step()
        assert torch.equal(loads[""], load)
        assert torch.allclose(layer.router.e_score_correction_bias, want, atol=1e-7)
        layer.eval()
        layer(xs[0])  # eval mode records nothing
        assert bal.step() == {}
        bal.remove()
    with pytest.raises(ValueError, match="one group"):
        moe.Balancer(moe.MoE(8, 8, 2, 4, n_group=2), "quantile")
    with pytest.raises(ValueError, match="rule"):
        moe.Balancer(layer, "bogus")
    with pytest.raises(ValueError, match="no MoE"):
        moe.Balancer(torch.nn.Linear(2, 2), "sign")

"""Oracles from ``transformers``: the pure-PyTorch forms its Qwen3-Next and Kimi Linear models
fall back to without fla (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``
in ``models/qwen3_next``; ``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention`` in
``models/kimi_linear``), against our loops and chunked forms.

Traps, handled here: layout ``[B, T, H, D]``; q is scaled by ``Dk^-0.5`` inside
(we pass ``q · √Dk``); ``g, beta`` in that order; with fla installed, the modelling modules bind
fla's Triton kernels when imported, so fla and causal_conv1d are hidden while they are imported
(and restored afterwards). Computed in float32: tolerance 1e-5 relative (measured ≤ 6e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import import_without_fla
from tinyk3.ops import gated_delta_rule, kda

TOL = 1e-5


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    return (import_without_fla("transformers.models.qwen3_next.modeling_qwen3_next"),
            import_without_fla("transformers.models.kimi_linear.modeling_kimi_linear"))


def _inputs(T, per_channel, seed, B=2, H=2, Dk=16, Dv=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=gen)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen)
    beta = torch.rand(B, H, T, generator=gen)
    g = -2.0 * torch.rand(*((B, H, T, Dk) if per_channel else (B, H, T)), generator=gen)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen)
    return q, k, v, beta, g, S0


def _t(x):
    return x.transpose(1, 2).contiguous()


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1.0)).item()


def _hf_args(q, k, v, beta, g):
    return _t(q) * q.shape[-1] ** 0.5, _t(k), _t(v), _t(g), _t(beta)


@pytest.mark.parametrize("T", [45, 128])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_gated_delta_rule_equals_qwen3_next_torch_forms(hf, form, T):
    q3, _ = hf
    q, k, v, beta, g, S0 = _inputs(T, False, seed=T)
    ref = q3.torch_chunk_gated_delta_rule if form == "chunk" else q3.torch_recurrent_gated_delta_rule
    kw = {"chunk_size": 64} if form == "chunk" else {}
    o_ref, S_ref = ref(*_hf_args(q, k, v, beta, g), initial_state=S0, output_final_state=True, **kw)
    for o, S in (gated_delta_rule.recurrent(q, k, v, beta, g, initial_state=S0),
                 gated_delta_rule.chunked(q, k, v, beta, g, chunk_size=32, initial_state=S0)):
        assert _rel(_t(o), o_ref) < TOL and _rel(S, S_ref) < TOL


@pytest.mark.parametrize("T", [64, 128])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_kda_equals_kimi_linear_torch_forms(hf, form, T):
    _, kl = hf
    q, k, v, beta, g, S0 = _inputs(T, True, seed=T)
    if form == "chunk":
        o_ref, S_ref = kl.chunk_kimi_delta_attention(*_hf_args(q, k, v, beta, g), chunk_size=64,
                                                     initial_state=S0, output_final_state=True)
    else:
        o_ref, S_ref = kl.recurrent_kimi_delta_attention(*_hf_args(q, k, v, beta, g), S0, True)
    for o, S in (kda.recurrent(q, k, v, beta, g, initial_state=S0),
                 kda.chunked(q, k, v, beta, g, chunk_size=64, initial_state=S0)):
        assert _rel(_t(o), o_ref) < TOL and _rel(S, S_ref) < TOL


@pytest.mark.parametrize("rule", ["gated_delta_rule", "kda"])
def test_chunked_backward_equals_autograd_through_the_torch_chunk_forms(hf, rule):
    """Chapter 20's oracle: autograd through transformers' chunked torch forms (float32) against
    our derived backward (measured ≤ 2e-6 relative to max(1, max |grad|))."""
    q3, kl = hf
    per_channel = rule == "kda"
    q, k, v, beta, g, S0 = _inputs(128, per_channel, seed=5)
    gen = torch.Generator().manual_seed(6)
    dO, dS = torch.randn(*v.shape, generator=gen), torch.randn(*S0.shape, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    ref_fn = kl.chunk_kimi_delta_attention if per_channel else q3.torch_chunk_gated_delta_rule
    o, S = ref_fn(*_hf_args(*leaves[:5]), chunk_size=64, initial_state=leaves[5],
                  output_final_state=True)
    ref = torch.autograd.grad((o * _t(dO)).sum() + (S * dS).sum(), leaves)
    mod = kda if per_channel else gated_delta_rule
    got = mod.chunked_backward(q, k, v, beta, g, dO, dS, chunk_size=64, initial_state=S0)
    for field, a, b in zip(got._fields, got, ref):
        assert _rel(a, b) < TOL, f"{rule} {field}: {_rel(a, b):.1e}"

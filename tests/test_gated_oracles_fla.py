"""Oracles written by someone else for the gated rules: flash-linear-attention's reference code
(``fla/ops/gated_delta_rule/naive.py``: ``naive_recurrent_gated_delta_rule`` and
``naive_chunk_gated_delta_rule``; ``fla/ops/kda/naive.py``: ``naive_recurrent_kda`` and
``naive_chunk_kda``) against our token loops and chunked forms.

Traps, handled here: fla's layout is ``[B, T, H, D]``; it scales q by
``Dk^-0.5`` unless ``scale`` is given (we pass ``scale=1.0``); its recurrent GDN takes
``beta, g`` and its chunked GDN ``g, beta``; ``naive_chunk_kda`` needs T divisible by the chunk.
Its states are ``[B, H, Dk, Dv]`` like ours. fla computes in float32: the tolerance is float32's
(1e-5 relative to max(1, max |o|); measured ≤ 6e-6). fla is optional: without it, skipped.

The backward (chapter 20): autograd through fla's naive chunked forms is an oracle for our
derived ``chunked_backward`` (float32; measured ≤ 1.3e-6 relative to max(1, max |grad|)).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from tinyk3.ops import gated_delta_rule, kda

pytestmark = pytest.mark.triton  # fla imports triton: rerun with Triton hidden by unit-no-triton

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fla.ops.gated_delta_rule.naive as gdn_naive
        import fla.ops.kda.naive as kda_naive
except ImportError as exc:
    pytest.skip(f"flash-linear-attention cannot be imported: {exc}", allow_module_level=True)

TOL = 1e-5


def _inputs(T, per_channel, seed, B=1, H=2, Dk=16, Dv=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=gen)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen)
    beta = torch.rand(B, H, T, generator=gen)
    g = -2.0 * torch.rand(*((B, H, T, Dk) if per_channel else (B, H, T)), generator=gen)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen)
    return q, k, v, beta, g, S0


def _t(x):  # [B, H, T, ...] <-> [B, T, H, ...]
    return x.transpose(1, 2).contiguous()


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1.0)).item()


@pytest.mark.parametrize("T", [37, 128])
def test_gated_delta_rule_equals_fla_token_loop(T):
    q, k, v, beta, g, S0 = _inputs(T, False, seed=T)
    o_ref, S_ref = gdn_naive.naive_recurrent_gated_delta_rule(
        _t(q), _t(k), _t(v), _t(beta), _t(g), scale=1.0, initial_state=S0, output_final_state=True)
    for o, S in (gated_delta_rule.recurrent(q, k, v, beta, g, initial_state=S0),
                 gated_delta_rule.chunked(q, k, v, beta, g, chunk_size=16, initial_state=S0)):
        assert _rel(_t(o), o_ref) < TOL and _rel(S, S_ref) < TOL


def test_gated_delta_rule_equals_fla_chunked_reference():
    q, k, v, beta, g, S0 = _inputs(128, False, seed=1)
    o_ref, S_ref = gdn_naive.naive_chunk_gated_delta_rule(  # note: g before beta here
        _t(q), _t(k), _t(v), _t(g), _t(beta), chunk_size=64, scale=1.0, initial_state=S0,
        output_final_state=True)
    o, S = gated_delta_rule.chunked(q, k, v, beta, g, chunk_size=64, initial_state=S0)
    assert _rel(_t(o), o_ref) < TOL and _rel(S, S_ref) < TOL


@pytest.mark.parametrize("T", [37, 128])
def test_kda_equals_fla_token_loop(T):
    q, k, v, beta, g, S0 = _inputs(T, True, seed=T)
    o_ref, S_ref = kda_naive.naive_recurrent_kda(
        _t(q), _t(k), _t(v), _t(g), _t(beta), scale=1.0, initial_state=S0, output_final_state=True)
    for o, S in (kda.recurrent(q, k, v, beta, g, initial_state=S0),
                 kda.chunked(q, k, v, beta, g, chunk_size=32, initial_state=S0)):
        assert _rel(_t(o), o_ref) < TOL and _rel(S, S_ref) < TOL


def test_kda_equals_fla_chunked_reference():
    q, k, v, beta, g, S0 = _inputs(128, True, seed=2)  # T divisible by the chunk (fla needs it)
    o_ref, S_ref = kda_naive.naive_chunk_kda(
        _t(q), _t(k), _t(v), _t(g), _t(beta), scale=1.0, initial_state=S0, output_final_state=True,
        chunk_size=64)
    o, S = kda.chunked(q, k, v, beta, g, chunk_size=64, initial_state=S0)
    assert _rel(_t(o), o_ref) < TOL and _rel(S, S_ref) < TOL


def _grad_oracle(fla_chunk, mod, per_channel, seed):
    q, k, v, beta, g, S0 = _inputs(128, per_channel, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dO, dS = torch.randn(*v.shape, generator=gen), torch.randn(*S0.shape, generator=gen)
    leaves = [_t(x).requires_grad_() for x in (q, k, v, beta, g)] + [S0.clone().requires_grad_()]
    o, S = fla_chunk(*leaves)
    ref = torch.autograd.grad((o * _t(dO)).sum() + (S * dS).sum(), leaves)
    ref = [_t(r) for r in ref[:5]] + [ref[5]]
    got = mod.chunked_backward(q, k, v, beta, g, dO, dS, chunk_size=64, initial_state=S0)
    for field, a, b in zip(got._fields, got, ref):
        assert _rel(a, b) < TOL, f"{field}: {_rel(a, b):.1e}"


def test_gated_delta_rule_backward_equals_autograd_through_fla_chunked_reference():
    _grad_oracle(lambda q, k, v, beta, g, S0: gdn_naive.naive_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=64, scale=1.0, initial_state=S0, output_final_state=True),
        gated_delta_rule, False, seed=3)


def test_kda_backward_equals_autograd_through_fla_chunked_reference():
    _grad_oracle(lambda q, k, v, beta, g, S0: kda_naive.naive_chunk_kda(
        q, k, v, g, beta, scale=1.0, initial_state=S0, output_final_state=True, chunk_size=64),
        kda, True, seed=4)

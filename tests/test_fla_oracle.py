"""An oracle written by someone else: flash-linear-attention's reference delta rule
(``fla/ops/delta_rule/naive.py``: ``delta_rule_recurrence``, a token loop with an initial state,
and ``delta_rule_chunkwise``, its chunked form without one) against our token loop, our chunked
PyTorch form and our Triton kernel (under the interpreter on CPU).

fla is optional (requirements/ci.txt pins it, so CI runs these): without it they are skipped.
Its references scale ``q`` by ``Dk^-0.5`` inside and compute in float32, so ``q`` goes in
multiplied by ``√Dk`` and the tolerance is float32's (1e-5 relative to max(1, max |o|), the bound
of tests/test_delta_rule.py; measured ≤ 1e-6). Its layout is ours: ``[B, H, T, D]``,
``S [B, H, Dk, Dv]``, ``o_t = q_t S_t``.
"""

from __future__ import annotations

import warnings

import pytest

import tinyk3.kernels as kernels
from helpers import delta_rule_inputs
from tinyk3.ops import delta_rule

# Reaches Triton, tinyk3.kernels or fla: rerun with Triton hidden by `make unit-no-triton`.
pytestmark = pytest.mark.triton

try:
    with warnings.catch_warnings():  # "Triton is not supported on current platform, roll back to CPU"
        warnings.simplefilter("ignore")
        import fla.ops.delta_rule.naive as naive
except ImportError as exc:  # fla not installed, or installed without triton (which it imports)
    pytest.skip(f"flash-linear-attention cannot be imported: {exc}", allow_module_level=True)

TOL = 1e-5


def _inputs(B, H, T, Dk, Dv, seed):
    return delta_rule_inputs(B, H, T, Dk, Dv, seed=seed)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1.0)).item()


def _fla_loop(q, k, v, beta, S0):
    return naive.delta_rule_recurrence(q * q.shape[-1] ** 0.5, k, v, beta, initial_state=S0)


# (B, H, T, Dk, Dv, C): T not a multiple of C, Dk ≠ Dv
CASES = [(1, 2, 37, 16, 8, 16), (2, 1, 64, 8, 16, 32), (1, 1, 100, 32, 32, 64)]


@pytest.mark.parametrize("B,H,T,Dk,Dv,C", CASES)
def test_recurrent_and_chunked_equal_fla_token_loop_with_initial_state(B, H, T, Dk, Dv, C):
    q, k, v, beta, S0 = _inputs(B, H, T, Dk, Dv, seed=T)
    o_ref, S_ref = _fla_loop(q, k, v, beta, S0)
    for o, S in (delta_rule.recurrent(q, k, v, beta, initial_state=S0),
                 delta_rule.chunked(q, k, v, beta, chunk_size=C, initial_state=S0)):
        assert _rel(o, o_ref) < TOL and _rel(S, S_ref) < TOL


def test_chunked_equals_fla_chunkwise():
    """fla's chunked reference (no initial state, T a multiple of C) against ours."""
    q, k, v, beta, _ = _inputs(2, 2, 128, 32, 16, seed=1)
    o_ref, S_ref = naive.delta_rule_chunkwise(q * 32**0.5, k, v, beta, chunk_size=32)
    o, S = delta_rule.chunked(q, k, v, beta, chunk_size=32)
    assert _rel(o, o_ref) < TOL and _rel(S, S_ref) < TOL


def test_chunked_backward_equals_autograd_through_fla_token_loop():
    """Chapter 19's oracle: autograd through fla's token loop (float32) against our derived
    backward, every input and the initial state (measured ≤ 1e-6)."""
    import torch

    q, k, v, beta, S0 = _inputs(1, 2, 45, 16, 8, seed=9)
    gen = torch.Generator().manual_seed(10)
    dO, dS = torch.randn(*v.shape, generator=gen), torch.randn(*S0.shape, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, S0)]
    o, S = _fla_loop(*leaves)
    ref = torch.autograd.grad((o * dO).sum() + (S * dS).sum(), leaves)
    got = delta_rule.chunked_backward(q, k, v, beta, dO, dS, chunk_size=16, initial_state=S0)
    for field, a, b in zip(got._fields, got, ref):
        assert _rel(a, b) < TOL, f"{field}: {_rel(a, b):.1e}"


@pytest.mark.skipif(not kernels.AVAILABLE, reason=f"tinyk3.kernels: {kernels.REASON}")
def test_triton_kernel_equals_fla_token_loop_with_initial_state():
    from tinyk3.kernels import delta_rule as kd

    q, k, v, beta, S0 = _inputs(1, 2, 45, 16, 16, seed=7)  # T = 45: the last chunk of 16 is partial
    o_ref, S_ref = _fla_loop(q, k, v, beta, S0)
    o, S = kd.chunked(q, k, v, beta, chunk_size=16, initial_state=S0)
    assert _rel(o, o_ref) < TOL and _rel(S, S_ref) < TOL

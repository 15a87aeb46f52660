"""tinyk3.gates: the two gate forms, fla's initialisation, the half-life."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tinyk3 import gates


def test_softplus_gate_matches_its_formula_per_head_and_per_channel():
    gen = torch.Generator().manual_seed(0)
    B, H, T, Dk = 2, 3, 5, 4
    A_log, dt_head, dt_ch = torch.randn(H, generator=gen), torch.randn(H, generator=gen), torch.randn(
        H, Dk, generator=gen)
    x = torch.randn(B, H, T, generator=gen)
    want = -A_log.exp().view(H, 1) * F.softplus(x + dt_head.view(H, 1))
    assert torch.allclose(gates.softplus_gate(x, A_log, dt_head), want)
    x4 = torch.randn(B, H, T, Dk, generator=gen)
    want4 = -A_log.exp().view(H, 1, 1) * F.softplus(x4 + dt_ch.view(H, 1, Dk))
    assert torch.allclose(gates.softplus_gate(x4, A_log, dt_ch), want4)
    assert (gates.softplus_gate(x4 - 50, A_log, dt_ch) <= 0).all()


def test_lower_bound_gate_stays_inside_its_bound():
    gen = torch.Generator().manual_seed(1)
    H, Dk = 4, 8
    x = 30 * torch.randn(2, H, 16, Dk, generator=gen)
    A_log, dt = torch.randn(H, generator=gen), torch.randn(H, Dk, generator=gen)
    g = gates.lower_bound_gate(x, A_log, dt)
    want = -5.0 * torch.sigmoid(A_log.exp().view(H, 1, 1) * (x + dt.view(H, 1, Dk)))
    assert torch.allclose(g, want)
    assert g.min().item() >= -5.0 and g.max().item() <= 0.0
    assert gates.lower_bound_gate(x, A_log, dt, lower_bound=-2.0).min().item() >= -2.0
    with pytest.raises(ValueError, match="negative"):
        gates.lower_bound_gate(x, A_log, dt, lower_bound=1.0)


def test_init_dt_bias_inverts_softplus_into_the_log_uniform_range():
    gen = torch.Generator().manual_seed(2)
    b = gates.init_dt_bias(10_000, generator=gen)
    dt = F.softplus(b)
    assert dt.min().item() >= 1e-3 * (1 - 1e-5) and dt.max().item() <= 1e-1 * (1 + 1e-5)
    # log-uniform: the median of log dt is the midpoint of [log 1e-3, log 1e-1]
    assert abs(dt.log().median().item() - math.log(1e-2)) < 0.1
    assert gates.init_dt_bias(3, 4, generator=gen).shape == (3, 4)


def test_init_A_log_is_log_of_a_uniform_draw():
    gen = torch.Generator().manual_seed(3)
    A = gates.init_A_log(20_000, generator=gen).exp()
    assert A.min().item() > 0 and A.max().item() <= 16.0
    assert abs(A.mean().item() - 8.0) < 0.2
    A1 = gates.init_A_log(1000, low=1.0, generator=gen).exp()
    assert A1.min().item() >= 1.0


def test_half_life():
    assert abs(gates.half_life(math.log(0.5)).item() - 1.0) < 1e-12
    g = torch.tensor([-0.01, -0.1])
    assert torch.allclose(torch.exp(g.double() * gates.half_life(g)), torch.full((2,), 0.5,
                                                                                 dtype=torch.float64))
    assert math.isinf(gates.half_life(0.0).item())


@pytest.mark.parametrize("call", [
    lambda: gates.softplus_gate(torch.zeros(2, 3, 4), torch.zeros(2), torch.zeros(3)),
    lambda: gates.softplus_gate(torch.zeros(2, 3, 4), torch.zeros(3), torch.zeros(3, 4)),
    lambda: gates.softplus_gate(torch.zeros(3, 4), torch.zeros(3), torch.zeros(3)),
    lambda: gates.init_dt_bias(),
    lambda: gates.init_dt_bias(4, dt_min=0.1, dt_max=0.01),
    lambda: gates.init_A_log(0),
    lambda: gates.init_A_log(4, low=5.0, high=1.0),
])
def test_bad_arguments_fail_clearly(call):
    with pytest.raises(ValueError):
        call()

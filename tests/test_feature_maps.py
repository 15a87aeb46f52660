"""tinyk3.ops.feature_maps: signs, shapes, the taylor2 kernel identity, and the name registry."""

from __future__ import annotations

import math

import pytest
import torch

from tinyk3.ops import feature_maps
from tinyk3.ops.feature_maps import elu_plus_one, identity, relu, softplus, taylor2

ELEMENTWISE = {"elu+1": elu_plus_one, "relu": relu, "softplus": softplus, "identity": identity}
DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ["f64", "f32"]
LEADING = [(), (5,), (2, 3, 7), (2, 3, 0)]  # [D], [T, D], [B, H, T, D], an empty sequence


def _grid(lo, hi, dtype, n=2001):
    return torch.linspace(lo, hi, n, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("lead", LEADING, ids=str)
@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_maps_keep_shape_and_dtype(name, lead, dtype):
    x = torch.randn(*lead, 6, dtype=dtype)
    y = ELEMENTWISE[name](x)
    assert y.shape == x.shape and y.dtype == dtype


# Ranges where the result is representable: elu+1 = exp(x) for x ≤ 0 is computed as
# 1 + expm1(x), which rounds to 0 once exp(x) < ulp(1)/2 (x < -17 in float32, x < -37 in float64);
# see test_elu_plus_one_stays_positive_where_exp_is_representable.
POSITIVE_RANGE = {torch.float32: 15.0, torch.float64: 30.0}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_elu_plus_one_is_strictly_positive_and_exact_formula(dtype):
    r = POSITIVE_RANGE[dtype]
    x = torch.cat([_grid(-r, r, dtype), torch.randn(4, 3, 100, dtype=dtype).flatten()])
    y = elu_plus_one(x)
    assert (y > 0).all()
    pos = x > 0
    assert torch.equal(y[pos], x[pos] + 1)  # identity plus one for x > 0
    atol = {torch.float32: 1.2e-7, torch.float64: 2.3e-16}[dtype]  # one rounding of 1 + expm1(x)
    assert (y[~pos] - x[~pos].double().exp().to(dtype)).abs().max().item() <= atol  # exp(x) for x ≤ 0
    assert elu_plus_one(torch.zeros((), dtype=dtype)).item() == 1.0


# F.elu(x) + 1 = 1 + expm1(x) rounded to 0 below x ≈ -17.3 in float32; exp/clamp form fixes it.
def test_elu_plus_one_stays_positive_where_exp_is_representable():
    x = _grid(-80.0, 0.0, torch.float32)  # exp(-80) ≈ 1.8e-35 is a normal float32
    y = elu_plus_one(x)
    assert (y > 0).all()
    assert ((y.double() - x.double().exp()).abs() / x.double().exp()).max().item() <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_relu_is_non_negative_and_can_be_exactly_zero(dtype):
    x = torch.cat([_grid(-10, 10, dtype), torch.randn(500, dtype=dtype)])
    y = relu(x)
    assert (y >= 0).all()
    assert torch.equal(y, torch.where(x > 0, x, torch.zeros_like(x)))
    assert (y[x < 0] == 0).all()  # so a query can score 0 against every key


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softplus_is_strictly_positive_smooth_relu(dtype):
    x = torch.cat([_grid(-30, 30, dtype), torch.randn(500, dtype=dtype)])
    y = softplus(x)
    assert (y > 0).all()
    assert (y >= relu(x)).all() and (y - relu(x)).max().item() <= math.log(2) + 1e-7  # at x = 0
    small = x.abs() < 15
    ref = torch.log1p(torch.exp(x[small].double()))
    assert ((y[small].double() - ref).abs() / ref).max().item() <= {torch.float32: 1e-6,
                                                                     torch.float64: 1e-14}[dtype]


def test_identity_returns_its_input():
    x = torch.randn(2, 3, 4, 5)
    assert torch.equal(identity(x), x)


# -- taylor2 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("D", [1, 3, 8])
@pytest.mark.parametrize("lead", LEADING, ids=str)
def test_taylor2_shape_and_layout(lead, D):
    x = torch.randn(*lead, D, dtype=torch.float64)
    y = taylor2(x)
    assert y.shape == (*lead, 1 + D + D * D) and y.dtype == torch.float64
    assert torch.equal(y[..., 0], torch.ones(lead, dtype=torch.float64))
    assert torch.equal(y[..., 1:1 + D], x)
    outer = (x[..., :, None] * x[..., None, :]).flatten(-2) / math.sqrt(2)
    assert torch.allclose(y[..., 1 + D:], outer, rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D", [1, 4, 16])
def test_taylor2_kernel_identity(D, dtype):
    """φ(q)·φ(k) = 1 + q·k + (q·k)²/2 for every pair, and ≥ 1/2 (its minimum, at q·k = −1)."""
    g = torch.Generator().manual_seed(D)
    q = torch.randn(3, 2, 11, D, generator=g, dtype=dtype)
    k = torch.randn(3, 2, 13, D, generator=g, dtype=dtype)
    kernel = taylor2(q) @ taylor2(k).transpose(-1, -2)  # [3, 2, 11, 13]
    s = (q.double() @ k.double().transpose(-1, -2))
    expected = 1 + s + s**2 / 2
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    rel = ((kernel.double() - expected).abs() / expected.abs().clamp(min=1.0)).max().item()
    assert rel <= tol, f"relative error {rel:.3g}"
    assert kernel.min().item() >= 0.5 - tol


def test_taylor2_approximates_exp_for_small_scores():
    """Scaled by D^{-1/4}, φ(q)·φ(k) ≈ exp(q·k/√D); the error is the Taylor remainder ≈ s³/6."""
    D = 16
    g = torch.Generator().manual_seed(1)
    q, k = (0.3 * torch.randn(50, D, generator=g, dtype=torch.float64) for _ in range(2))
    c = D**-0.25
    kernel = (taylor2(c * q) * taylor2(c * k)).sum(-1)
    s = (q * k).sum(-1) / math.sqrt(D)
    assert ((kernel - s.exp()).abs() <= s.abs() ** 3 / 6 * math.exp(s.abs().max().item()) + 1e-15).all()
    assert (kernel - s.exp()).abs().max().item() > 0  # not exact


def test_taylor2_gradcheck():
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(taylor2, (x,), eps=1e-6, atol=1e-7)


# -- registry -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name,fn",
    [("elu+1", elu_plus_one), ("relu", relu), ("softplus", softplus), ("identity", identity),
     ("taylor2", taylor2)],
)
def test_get_returns_the_function(name, fn):
    assert feature_maps.get(name) is fn
    assert feature_maps.FEATURE_MAPS[name] is fn


def test_every_registered_map_is_gettable_and_maps_the_last_dim():
    x = torch.randn(2, 3, 4, 5)
    for name, fn in feature_maps.FEATURE_MAPS.items():
        assert feature_maps.get(name) is fn
        assert fn(x).shape[:-1] == x.shape[:-1], name


@pytest.mark.parametrize("bad", ["elu", "ELU+1", "", "softmax"])
def test_get_unknown_name_lists_the_options(bad):
    with pytest.raises(ValueError, match="unknown feature map") as info:
        feature_maps.get(bad)
    msg = str(info.value)
    assert repr(bad) in msg
    for name in feature_maps.FEATURE_MAPS:
        assert repr(name) in msg, f"option {name!r} not named in: {msg}"

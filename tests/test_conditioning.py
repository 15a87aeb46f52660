"""tinyk3.conditioning: the test keys have the properties claimed, the measurements agree with
direct computations, and the bound |T_ij| ≤ β_i β_j holds for unit keys (chapter 7)."""

from __future__ import annotations

import pytest
import torch

from tinyk3 import conditioning
from tinyk3.ops import wy


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_unit_keys_have_unit_norm_and_random_directions():
    k = conditioning.chunk_keys("unit", 4, 64, 128, generator=_gen())
    assert k.shape == (4, 64, 128) and k.dtype == torch.float64
    assert (k.norm(dim=-1) - 1).abs().max().item() < 1e-12
    cos = (k @ k.mT).tril(-1)
    assert cos.abs().sum().item() / (4 * 64 * 63 / 2) < 0.1  # E|cos| ≈ √(2/(πD)) ≈ 0.07


@pytest.mark.parametrize("target", [0.5, 0.9])
def test_correlated_keys_have_the_requested_cosine(target):
    k = conditioning.chunk_keys("correlated", 8, 32, 128, cos=target, generator=_gen(1))
    assert (k.norm(dim=-1) - 1).abs().max().item() < 1e-12
    cos = (k @ k.mT)[:, torch.ones(32, 32, dtype=torch.bool).tril(-1)]
    assert abs(cos.mean().item() - target) < 0.03


def test_raw_keys_are_gaussian():
    k = conditioning.chunk_keys("raw", 8, 64, 128, generator=_gen(2), dtype=torch.float32)
    assert k.dtype == torch.float32
    assert abs(k.pow(2).sum(-1).mean().item() / 128 - 1) < 0.02


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind must be one of"):
        conditioning.chunk_keys("orthogonal", 1, 4, 4)
    with pytest.raises(ValueError, match="cos must be in"):
        conditioning.chunk_keys("correlated", 1, 4, 4, cos=1.0)
    for args in ((True, 4, 4), (1, 0, 4), (1, 4, 2.0)):  # n, C, D
        with pytest.raises(ValueError, match="chunk_keys: .* must be a positive int"):
            conditioning.chunk_keys("unit", *args)


def test_condition_number_and_relative_error_by_hand():
    A = torch.diag(torch.tensor([1.0, 4.0, 0.5])).expand(2, 3, 3)
    assert torch.allclose(conditioning.condition_number(A), torch.tensor([8.0, 8.0], dtype=torch.float64))
    exact = torch.tensor([[2.0, -4.0], [1.0, 0.0]])
    approx = exact + torch.tensor([[0.0, 0.1], [-0.2, 0.0]])
    assert conditioning.max_relative_error(approx, exact).item() == pytest.approx(0.05)
    bad = approx.clone()
    bad[0, 0] = float("inf")
    assert conditioning.max_relative_error(bad, exact).item() == float("inf")


def test_ut_precision_float64_is_exact_and_float32_is_close():
    k = conditioning.chunk_keys("unit", 4, 64, 32, generator=_gen(3))
    beta = torch.rand(4, 64, generator=_gen(4), dtype=torch.float64)
    r64 = conditioning.ut_precision(k, beta, dtype=torch.float64)
    assert r64.error.max().item() < 1e-14
    assert r64.cond.shape == (4,) and (r64.cond >= 1).all()
    assert torch.allclose(r64.cond, torch.linalg.cond(wy.ut_matrix(k, beta)))
    for method in ("solve", "forward", "block"):
        r32 = conditioning.ut_precision(k, beta, method=method)
        assert 0 < r32.error.max().item() < 1e-5
    r16 = conditioning.ut_precision(k, beta, input_dtype=torch.bfloat16)
    assert r16.error.min().item() > 10 * r32.error.max().item()  # rounding the keys dominates


@pytest.mark.parametrize("kind", ["unit", "correlated"])
@pytest.mark.parametrize("beta_max", [1.0, 2.0])
def test_entries_of_T_are_bounded_by_the_write_strengths_for_unit_keys(kind, beta_max):
    """Column j of T is the deltas of a chunk in which only token j writes (value 1), and every
    later transition I − β kᵀk has norm ≤ 1 when ‖k‖ = 1 and β ≤ 2: |T_ij| ≤ β_i β_j below
    the diagonal, and T_jj = β_j."""
    k = conditioning.chunk_keys(kind, 16, 128, 64, generator=_gen(5))
    beta = beta_max * torch.rand(16, 128, generator=_gen(6), dtype=torch.float64)
    T = wy.ut_transform(k, beta)
    bound = beta.unsqueeze(-1) * beta.unsqueeze(-2)  # β_i β_j
    assert (T.tril(-1).abs() <= bound * (1 + 1e-12) + 1e-15).all()
    assert torch.allclose(T.diagonal(dim1=-2, dim2=-1), beta, rtol=0, atol=1e-15)


def test_raw_keys_break_the_bound():
    k = conditioning.chunk_keys("raw", 4, 32, 64, generator=_gen(7))
    r = conditioning.ut_precision(k, torch.full((4, 32), 0.5, dtype=torch.float64))
    assert r.t_max.min().item() > 1e6

"""The WY representation and the UT transform (tinyk3.ops.wy), chapter 7."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinyk3.ops import delta_rule, wy


def _chunk(C, Dk=8, Dv=5, batch=(2, 3), seed=0, dtype=torch.float64, unit=True):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(*batch, C, Dk, generator=g, dtype=dtype)
    if unit:
        k = F.normalize(k, dim=-1)
    v = torch.randn(*batch, C, Dv, generator=g, dtype=dtype)
    beta = torch.rand(*batch, C, generator=g, dtype=dtype)
    return k, v, beta


@pytest.mark.parametrize("C", [1, 2, 5, 16, 33, 64])
@pytest.mark.parametrize("unit", [True, False], ids=["unit-keys", "raw-keys"])
def test_product_of_rank_one_updates_equals_its_wy_form(C, unit):
    k, v, beta = _chunk(C, unit=unit)
    P = wy.transition_product(k, beta)  # C explicit Dk x Dk products
    W, _ = wy.wy_factors(k, v, beta)
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    assert (P - (eye - k.transpose(-1, -2) @ W)).abs().max().item() <= 1e-12 * max(1.0, P.abs().max().item())


def test_transition_product_is_the_recurrence_without_writes():
    k, v, beta = _chunk(9)
    S0 = torch.randn(2, 3, 8, 5, dtype=torch.float64)
    _, S = delta_rule.recurrent(k, k, torch.zeros_like(v), beta, initial_state=S0)  # v = 0: no writes
    assert (S - wy.transition_product(k, beta) @ S0).abs().max().item() <= 1e-13


@pytest.mark.parametrize("C", [1, 7, 16, 40])
def test_a_chunk_of_writes_is_kT_U_and_the_state_is_S0_plus_kT_U_minus_WS0(C):
    k, v, beta = _chunk(C, seed=1)
    S0 = torch.randn(2, 3, 8, 5, dtype=torch.float64)
    W, U = wy.wy_factors(k, v, beta)
    _, S_from_zero = delta_rule.recurrent(k, k, v, beta)
    _, S = delta_rule.recurrent(k, k, v, beta, initial_state=S0)
    assert (S_from_zero - k.transpose(-1, -2) @ U).abs().max().item() <= 1e-12
    assert (S - (S0 + k.transpose(-1, -2) @ (U - W @ S0))).abs().max().item() <= 1e-12


def test_papers_transposed_convention_agrees():
    """Papers keep S as [Dv, Dk]: the product runs the other way and reads I - W^T K."""
    k, v, beta = _chunk(12, seed=2)
    eye = torch.eye(8, dtype=torch.float64)
    P_paper = eye.expand(2, 3, 8, 8)
    for t in range(12):  # S_t = S_{t-1} (I - b k k^T): later tokens multiply on the right
        kt = k[..., t, :]
        P_paper = P_paper @ (eye - beta[..., t, None, None] * kt.unsqueeze(-1) * kt.unsqueeze(-2))
    W, _ = wy.wy_factors(k, v, beta)
    assert (P_paper - (eye - W.transpose(-1, -2) @ k)).abs().max().item() <= 1e-12
    assert (P_paper - wy.transition_product(k, beta).transpose(-1, -2)).abs().max().item() <= 1e-12


@pytest.mark.parametrize("C", [1, 3, 16, 17, 64, 100])
@pytest.mark.parametrize("block", [1, 4, 16])
def test_forward_substitution_and_block_inverse_equal_the_matrix_inverse(C, block):
    k, _, beta = _chunk(C, seed=3)
    A = wy.ut_matrix(k, beta)
    assert torch.equal(A.diagonal(dim1=-2, dim2=-1), torch.ones(2, 3, C, dtype=A.dtype))
    assert torch.equal(A.triu(1), torch.zeros_like(A))  # unit lower triangular
    ref = torch.linalg.inv(A)
    scale = max(1.0, ref.abs().max().item())
    assert (wy.forward_substitution(A) - ref).abs().max().item() <= 1e-11 * scale
    assert (wy.block_inverse(A, block) - ref).abs().max().item() <= 1e-11 * scale


@pytest.mark.parametrize("method", ["solve", "forward", "block"])
def test_ut_transform_methods_agree_in_float32(method):
    k, _, beta = _chunk(64, seed=4, dtype=torch.float32)
    ref = wy.ut_transform(k.double(), beta.double(), "solve")
    got = wy.ut_transform(k, beta, method)
    assert got.dtype == torch.float32
    assert (got.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_ut_transform_is_lower_triangular_with_beta_on_the_diagonal():
    k, _, beta = _chunk(10, seed=5)
    T = wy.ut_transform(k, beta)
    assert torch.equal(T.triu(1), torch.zeros_like(T))
    assert (T.diagonal(dim1=-2, dim2=-1) - beta).abs().max().item() <= 1e-15


def test_bad_arguments():
    k, v, beta = _chunk(4)
    with pytest.raises(ValueError, match="method must be"):
        wy.ut_transform(k, beta, "cholesky")
    A = wy.ut_matrix(k, beta)
    for bad in (0, -2, True, 2.0, "4"):  # True is an int to Python, never a block size
        with pytest.raises(ValueError, match=r"wy.block_inverse: block must be a positive int"):
            wy.block_inverse(A, bad)

"""Chapter 7's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import torch

from helpers import right, wrong
from tinyk3 import checks

# -- wy.forward_substitution ----------------------------------------------------------------------


@wrong("wy.forward_substitution", "wrong_sign")
def fs_plus_sign(A):
    C = A.shape[-1]
    X = torch.zeros_like(A)
    for i in range(C):
        X[..., i, :] = torch.eye(C, dtype=A.dtype)[i] + (A[..., i, None, :i] @ X[..., :i, :]).squeeze(-2)
    return X


@wrong("wy.forward_substitution", "transposed")
def fs_columns_as_rows(A):
    """Solve A x = e_m for each column m, then stack the columns along the wrong axis."""
    C = A.shape[-1]
    cols = []
    for m in range(C):
        x = torch.zeros(*A.shape[:-1], dtype=A.dtype)  # [..., C]
        for i in range(C):
            x[..., i] = float(i == m) - (A[..., i, :i] * x[..., :i]).sum(-1)
        cols.append(x)
    return torch.stack(cols, dim=-2)  # should be dim=-1


@wrong("wy.forward_substitution", "transposed")
def fs_upper_solve(A):
    eye = torch.eye(A.shape[-1], dtype=A.dtype).expand_as(A)
    return torch.linalg.solve_triangular(A.transpose(-1, -2), eye, upper=True)


@wrong("wy.forward_substitution", "previous_row_only")
def fs_last_row_only(A):
    C = A.shape[-1]
    X = torch.eye(C, dtype=A.dtype).repeat(*A.shape[:-2], 1, 1)
    for i in range(1, C):
        X[..., i, :] = X[..., i, :] - A[..., i, i - 1].unsqueeze(-1) * X[..., i - 1, :]
    return X


@wrong("wy.forward_substitution", "first_order")
def fs_one_neumann_term(A):
    L = A - torch.eye(A.shape[-1], dtype=A.dtype)  # strictly lower part
    return torch.eye(A.shape[-1], dtype=A.dtype) - L  # (I + L)⁻¹ ≈ I − L


@wrong("wy.forward_substitution", "no_identity")
def fs_in_place_without_identity(A):
    """The kernels' in-place loop on N = −tril(A, −1), without adding I at the end."""
    N = -A.tril(-1)
    for i in range(1, A.shape[-1]):
        N[..., i, :i] = N[..., i, :i] + (N[..., i, :i, None] * N[..., :i, :i]).sum(-2)
    return N


@wrong("wy.forward_substitution", "includes_diagonal")
def fs_whole_row(A):
    X = torch.eye(A.shape[-1], dtype=A.dtype).repeat(*A.shape[:-2], 1, 1)
    for i in range(A.shape[-1]):
        X[..., i, :] = X[..., i, :] - (A[..., i, None, :] @ X).squeeze(-2)  # j over every column
    return X


@right("wy.forward_substitution")
def fs_ok_inverse(A):
    return torch.linalg.inv(A)


@right("wy.forward_substitution")
def fs_ok_solve(A):
    eye = torch.eye(A.shape[-1], dtype=A.dtype).expand_as(A)
    return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)


@right("wy.forward_substitution")
def fs_ok_columns(A):
    return fs_columns_as_rows(A).transpose(-1, -2)


@right("wy.forward_substitution")
def fs_ok_in_place(A):
    return fs_in_place_without_identity(A) + torch.eye(A.shape[-1], dtype=A.dtype)


# -- wy.merge_block_inverse -----------------------------------------------------------------------


def _cat(X11, X21, X22):
    m, n = X11.shape[-1], X22.shape[-1]
    out = X11.new_zeros(*X11.shape[:-2], m + n, m + n)
    out[..., :m, :m], out[..., m:, :m], out[..., m:, m:] = X11, X21, X22
    return out


@wrong("wy.merge_block_inverse", "wrong_sign")
def mb_plus(A11_inv, A21, A22_inv):
    return _cat(A11_inv, A22_inv @ A21 @ A11_inv, A22_inv)


@wrong("wy.merge_block_inverse", "order_reversed")
def mb_reversed(A11_inv, A21, A22_inv):
    return _cat(A11_inv, -(A11_inv @ A21 @ A22_inv), A22_inv)


@wrong("wy.merge_block_inverse", "no_inverses")
def mb_minus_A21(A11_inv, A21, A22_inv):
    return _cat(A11_inv, -A21, A22_inv)


@wrong("wy.merge_block_inverse", "missing_A22_inv")
def mb_right_inverse_only(A11_inv, A21, A22_inv):
    return _cat(A11_inv, -A21 @ A11_inv, A22_inv)


@wrong("wy.merge_block_inverse", "missing_A11_inv")
def mb_left_inverse_only(A11_inv, A21, A22_inv):
    return _cat(A11_inv, -(A22_inv @ A21), A22_inv)


@wrong("wy.merge_block_inverse")
def mb_block_diagonal(A11_inv, A21, A22_inv):
    return _cat(A11_inv, torch.zeros_like(A21), A22_inv)  # "the inverse is block diagonal"


@right("wy.merge_block_inverse")
def mb_ok_slices(A11_inv, A21, A22_inv):
    return _cat(A11_inv, -A22_inv @ (A21 @ A11_inv), A22_inv)


@right("wy.merge_block_inverse")
def mb_ok_invert_everything(A11_inv, A21, A22_inv):
    A = _cat(torch.linalg.inv(A11_inv), A21, torch.linalg.inv(A22_inv))
    return torch.linalg.inv(A)


# -- wy.wy_factors --------------------------------------------------------------------------------


def _I(k):
    return torch.eye(k.shape[-2], dtype=k.dtype)


@wrong("wy.wy_factors", "no_beta_diag")
def wf_forgets_beta_on_the_right(k, v, beta):
    A = _I(k) + torch.tril(beta[..., None] * (k @ k.mT), diagonal=-1)
    return torch.linalg.solve(A, k), torch.linalg.solve(A, v)


@wrong("wy.wy_factors", "diagonal_in_tril")
def wf_tril_with_diagonal(k, v, beta):
    A = _I(k) + torch.tril(beta[..., None] * (k @ k.mT))
    T = torch.linalg.inv(A) * beta[..., None, :]
    return T @ k, T @ v


@wrong("wy.wy_factors", "beta_missing_in_A")
def wf_plain_gram(k, v, beta):
    A = _I(k) + torch.tril(k @ k.mT, diagonal=-1)
    return torch.linalg.solve(A, beta[..., None] * k), torch.linalg.solve(A, beta[..., None] * v)


@wrong("wy.wy_factors", "beta_on_columns")
def wf_k_beta_on_the_wrong_side(k, v, beta):
    k_beta = k * beta[..., None]
    A = _I(k) + (k @ k_beta.mT).tril(-1)
    return torch.linalg.solve(A, k_beta), torch.linalg.solve(A, v * beta[..., None])


@wrong("wy.wy_factors", "beta_scales_rows")
def wf_beta_times_inverse(k, v, beta):
    A = _I(k) + (beta[..., None] * (k @ k.mT)).tril(-1)
    T = beta[..., None] * torch.linalg.inv(A)
    return T @ k, T @ v


@wrong("wy.wy_factors", "wrong_sign")
def wf_minus_sign(k, v, beta):
    A = _I(k) - (beta[..., None] * (k @ k.mT)).tril(-1)
    T = torch.linalg.inv(A) * beta[..., None, :]
    return T @ k, T @ v


@wrong("wy.wy_factors", "transposed_T")
def wf_T_transposed(k, v, beta):
    A = _I(k) + (beta[..., None] * (k @ k.mT)).tril(-1)
    T = torch.linalg.inv(A) * beta[..., None, :]
    return T.mT @ k, T.mT @ v


@right("wy.wy_factors")
def wf_ok_recursion(k, v, beta):
    ws, us = [], []
    for r in range(k.shape[-2]):
        w, u = k[..., r, :].clone(), v[..., r, :].clone()
        for i in range(r):
            dot = (k[..., r, :] * k[..., i, :]).sum(-1, keepdim=True)  # k_r · k_i
            w, u = w - dot * ws[i], u - dot * us[i]
        ws.append(beta[..., r, None] * w)
        us.append(beta[..., r, None] * u)
    return torch.stack(ws, dim=-2), torch.stack(us, dim=-2)


@right("wy.wy_factors")
def wf_ok_kernel_style(k, v, beta):
    """Strictly lower A, (I + A)⁻¹, then β folded into K and V."""
    A = (beta[..., None] * (k @ k.mT)).tril(-1)
    eye = _I(k).expand_as(A)
    Ai = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
    return Ai @ (k * beta[..., None]), Ai @ (v * beta[..., None])


def test_reversed_products_run_only_on_equal_blocks():
    """A₁₁⁻¹ A₂₁ A₂₂⁻¹ has the right shape only when m = n: elsewhere it raises, and is reported."""
    result = checks.run("wy.merge_block_inverse", mb_reversed, verbose=False)
    assert result.mistake == "order_reversed"
    assert "raised RuntimeError" in result.report


def test_first_order_and_previous_row_are_exact_for_two_tokens():
    """For C ≤ 2 the Neumann guess and the one-row recursion are right: only the C = 2 case passes."""
    cases = checks.EXERCISES["wy.forward_substitution"].cases()
    small = [i for i, c in enumerate(cases) if c.args[0].shape[-1] <= 2]
    assert small
    for fn in (fs_one_neumann_term, fs_last_row_only):
        result = checks.run("wy.forward_substitution", fn, verbose=False)
        assert result.n_passed == len(small)


def test_the_single_token_case_separates_the_beta_mistakes():
    """With C = 1, W = β k: forgetting diag(β) or adding the diagonal fails there; the rest pass."""
    cases = checks.EXERCISES["wy.wy_factors"].cases()
    (single,) = [i for i, c in enumerate(cases) if c.args[0].shape[-2] == 1]
    k, v, beta = cases[single].args
    ref_W, ref_U = checks.EXERCISES["wy.wy_factors"].reference(k, v, beta)
    assert torch.allclose(ref_W, beta[..., None] * k) and torch.allclose(ref_U, beta[..., None] * v)
    for fn, passes in ((wf_forgets_beta_on_the_right, False), (wf_tril_with_diagonal, False),
                       (wf_minus_sign, True), (wf_T_transposed, True), (wf_beta_times_inverse, True)):
        W, U = fn(k, v, beta)
        assert torch.allclose(W, ref_W, atol=1e-6) == passes, fn.__name__

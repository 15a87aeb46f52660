"""Chapter 7 exercises: forward substitution, merging block inverses, and the WY factors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import wy as wy_ops
from .core import Case, Exercise, Mistake, register

# -- wy.forward_substitution ---------------------------------------------------------------------


def forward_substitution(A: torch.Tensor) -> torch.Tensor:
    """``A⁻¹`` for a unit lower-triangular ``A [..., C, C]`` (reference)."""
    return wy_ops.forward_substitution(A)


def _rows(A, step):
    """Build X row by row: ``X_i = step(A, X_0..X_{i-1}, i)``; rows are ``[..., C]``."""
    C = A.shape[-1]
    eye = torch.eye(C, dtype=A.dtype).expand(*A.shape[:-2], C, C)
    rows = []
    for i in range(C):
        rows.append(step(A, rows, i, eye[..., i, :]))
    return torch.stack(rows, dim=-2)


def _prev_sum(A, rows, i):
    """``Σ_{j<i} A_ij X_j``  ``[..., C]``."""
    if not i:
        return torch.zeros_like(A[..., 0, :])
    return (A[..., i, :i].unsqueeze(-2) @ torch.stack(rows, dim=-2)).squeeze(-2)


def _fs_wrong_sign(A):
    return _rows(A, lambda A, rows, i, e: e + _prev_sum(A, rows, i))


def _fs_previous_row_only(A):
    return _rows(A, lambda A, rows, i, e: e - A[..., i, i - 1, None] * rows[-1] if i else e)


def _fs_includes_diagonal(A):
    """The sum runs over j ≤ i with X initialised to the identity: the A_ii X_i term is e_i."""
    X = torch.eye(A.shape[-1], dtype=A.dtype).expand_as(A).clone()
    for i in range(A.shape[-1]):
        X[..., i, :] = X[..., i, :] - (A[..., i, : i + 1].unsqueeze(-2) @ X[..., : i + 1, :]).squeeze(-2)
    return X


def _fs_cases(g: torch.Generator) -> list[Case]:
    def unit_lower(shape, C, scale=1.0, dtype=torch.float32):
        L = scale * torch.randn(*shape, C, C, generator=g, dtype=dtype)
        return torch.eye(C, dtype=dtype) + L.tril(-1)  # [*shape, C, C]

    def from_keys(shape, C, D):
        k = F.normalize(torch.randn(*shape, C, D, generator=g), dim=-1)
        return wy_ops.ut_matrix(k, torch.rand(*shape, C, generator=g))  # I + tril(diag(β) K Kᵀ, -1)

    return [
        Case((unit_lower((), 4),), label="a 4 x 4 unit lower-triangular matrix"),
        Case((from_keys((2, 3), 8, 16),), label="a batch [2, 3] of 8 x 8 A = I + tril(diag(β) K Kᵀ, -1)"),
        Case((unit_lower((), 2),), label="C = 2: one entry below the diagonal"),
        Case((from_keys((), 33, 16),), label="C = 33, from 33 unit keys in 16 dimensions"),
        Case((unit_lower((3,), 6, 0.5),), label="a batch of three 6 x 6 matrices"),
        Case((unit_lower((), 5, dtype=torch.float64),), label="float64: keep the dtype"),
    ]


register(Exercise(
    id="wy.forward_substitution",
    title="the inverse of a unit lower-triangular matrix, row by row",
    signature="forward_substitution(A [..., C, C]) -> A⁻¹ [..., C, C]",
    reference=forward_substitution,
    make_cases=_fs_cases,
    chapter=7,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("wrong_sign", _fs_wrong_sign,
                "the rows have the wrong sign: A X = I gives X_i = e_i − Σ_{j<i} A_ij X_j (move the "
                "known rows to the right-hand side, which flips their sign). Yours adds them: it "
                "inverts 2I − A instead of A."),
        Mistake("transposed", lambda A: forward_substitution(A).transpose(-1, -2),
                "your result is upper triangular: it is A⁻¹ transposed (you built columns and "
                "stacked them as rows, or solved with Aᵀ). The inverse of a lower-triangular matrix is "
                "lower triangular: row i of X depends on rows 0..i−1."),
        Mistake("previous_row_only", _fs_previous_row_only,
                "each row uses only the row just above it (X_i = e_i − A_{i,i−1} X_{i−1}), which is "
                "right only for a bidiagonal A. Row i needs every earlier row: "
                "X_i = e_i − Σ_{j<i} A_ij X_j."),
        Mistake("first_order", lambda A: 2 * torch.eye(A.shape[-1], dtype=A.dtype) - A,
                "you returned I − L (L the strictly lower part): the first two terms of "
                "(I + L)⁻¹ = I − L + L² − …, exact only for C ≤ 2. Substitute row by row: "
                "X_i = e_i − Σ_{j<i} A_ij X_j uses the finished rows X_j, not e_j."),
        Mistake("includes_diagonal", _fs_includes_diagonal,
                "your rows come out zero: the sum includes j = i, and A_ii X_i = e_i (X starts as "
                "the identity) cancels the e_i. Sum over the strictly lower part only, j < i."),
        Mistake("no_identity", lambda A: forward_substitution(A) - torch.eye(A.shape[-1], dtype=A.dtype),
                "the diagonal of your result is 0: you computed the strictly lower part of A⁻¹ (as "
                "kernels do in place) and did not add the identity back. A⁻¹ of a unit "
                "lower-triangular A has ones on its diagonal."),
    ],
    hint="X = zeros like A; for i in range(C): X[..., i, :] = e_i − A[..., i, :i] @ X[..., :i, :] "
         "(e_i = row i of the identity). Check: A @ X is the identity.",
))

# -- wy.merge_block_inverse ----------------------------------------------------------------------


def merge_block_inverse(A11_inv: torch.Tensor, A21: torch.Tensor, A22_inv: torch.Tensor) -> torch.Tensor:
    """``[[A₁₁, 0], [A₂₁, A₂₂]]⁻¹`` from the two diagonal blocks' inverses (reference).

    ``A11_inv [..., m, m]``, ``A21 [..., n, m]``, ``A22_inv [..., n, n]`` → ``[..., m+n, m+n]``.
    """
    lower = -A22_inv @ A21 @ A11_inv  # [..., n, m]
    top = torch.cat([A11_inv, torch.zeros_like(A21).transpose(-1, -2)], dim=-1)  # [..., m, m+n]
    bottom = torch.cat([lower, A22_inv], dim=-1)  # [..., n, m+n]
    return torch.cat([top, bottom], dim=-2)


def _assemble(A11_inv, X21, A22_inv):
    top = torch.cat([A11_inv, torch.zeros_like(X21).transpose(-1, -2)], dim=-1)
    return torch.cat([top, torch.cat([X21, A22_inv], dim=-1)], dim=-2)


def _merge_cases(g: torch.Generator) -> list[Case]:
    def case(shape, m, n, label, dtype=torch.float32):
        k = F.normalize(torch.randn(*shape, m + n, 8, generator=g, dtype=dtype), dim=-1)
        beta = torch.rand(*shape, m + n, generator=g, dtype=dtype)
        A = wy_ops.ut_matrix(k, beta)  # [..., m+n, m+n]
        A11_inv = torch.linalg.inv(A[..., :m, :m])
        A22_inv = torch.linalg.inv(A[..., m:, m:])
        return Case((A11_inv, A[..., m:, :m].clone(), A22_inv), label=label)

    return [
        case((), 4, 4, "two 4 x 4 blocks"),
        case((2, 3), 16, 16, "a batch [2, 3] of two 16 x 16 blocks, as kernels merge them"),
        case((), 8, 4, "blocks of different sizes: m = 8, n = 4"),
        case((2,), 3, 5, "m = 3, n = 5"),
        case((), 1, 1, "two 1 x 1 blocks"),
        case((), 6, 6, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="wy.merge_block_inverse",
    title="merge the inverses of two diagonal blocks",
    signature="merge_block_inverse(A11_inv [..., m, m], A21 [..., n, m], A22_inv [..., n, n]) "
              "-> [..., m+n, m+n]",
    reference=merge_block_inverse,
    make_cases=_merge_cases,
    chapter=7,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("wrong_sign", lambda X11, A21, X22: _assemble(X11, X22 @ A21 @ X11, X22),
                "the lower-left block has the wrong sign: row block 2 of A X = I reads "
                "A₂₁ A₁₁⁻¹ + A₂₂ X₂₁ = 0, so X₂₁ = −A₂₂⁻¹ A₂₁ A₁₁⁻¹."),
        Mistake("order_reversed", lambda X11, A21, X22: _assemble(X11, -X11 @ A21 @ X22, X22),
                "the products are in the wrong order: A₁₁⁻¹ A₂₁ A₂₂⁻¹ only has the right shape when "
                "the blocks are the same size, and it is not the inverse even then. The block that "
                "multiplies from the left is A₂₂⁻¹: X₂₁ = −A₂₂⁻¹ A₂₁ A₁₁⁻¹ ([n, n] [n, m] [m, m])."),
        Mistake("no_inverses", lambda X11, A21, X22: _assemble(X11, -A21, X22),
                "the lower-left block is −A₂₁: that is right only when both diagonal blocks are "
                "identities. Multiply by their inverses: X₂₁ = −A₂₂⁻¹ A₂₁ A₁₁⁻¹."),
        Mistake("missing_A22_inv", lambda X11, A21, X22: _assemble(X11, -A21 @ X11, X22),
                "A₂₂⁻¹ is missing on the left of the lower-left block: X₂₁ = −A₂₂⁻¹ A₂₁ A₁₁⁻¹."),
        Mistake("missing_A11_inv", lambda X11, A21, X22: _assemble(X11, -X22 @ A21, X22),
                "A₁₁⁻¹ is missing on the right of the lower-left block: X₂₁ = −A₂₂⁻¹ A₂₁ A₁₁⁻¹."),
    ],
    hint="X₂₁ = −A22_inv @ A21 @ A11_inv; then assemble [[A11_inv, 0], [X₂₁, A22_inv]] with torch.cat "
         "(the upper-right block is zeros of shape [..., m, n]).",
))

# -- wy.wy_factors -------------------------------------------------------------------------------


def wy_factors(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, U) = (T K, T V)`` with ``T = (I + tril(diag(β) K Kᵀ, −1))⁻¹ diag(β)`` (reference).

    ``k [..., C, Dk]``, ``v [..., C, Dv]``, ``beta [..., C]`` → ``W [..., C, Dk]``, ``U [..., C, Dv]``.
    """
    return wy_ops.wy_factors(k, v, beta)


def _factors_from(A, k, v, beta, *, scale="columns", transpose=False):
    """(W, U) from a given unit lower-triangular ``A`` and a choice of where β goes."""
    A_inv = torch.linalg.inv(A)
    if scale == "columns":
        T = A_inv * beta.unsqueeze(-2)  # A⁻¹ diag(β)
    elif scale == "rows":
        T = beta.unsqueeze(-1) * A_inv  # diag(β) A⁻¹
    else:
        T = A_inv  # no diag(β) at all
    if transpose:
        T = T.transpose(-1, -2)
    return T @ k, T @ v


def _gram(k):
    return k @ k.transpose(-1, -2)  # K Kᵀ   [..., C, C]


def _eye(k):
    return torch.eye(k.shape[-2], dtype=k.dtype)


def _A(k, beta):
    return _eye(k) + (beta.unsqueeze(-1) * _gram(k)).tril(-1)


def _wy_cases(g: torch.Generator) -> list[Case]:
    def case(shape, C, Dk, Dv, label, *, unit=True, beta=None, dtype=torch.float32):
        k = torch.randn(*shape, C, Dk, generator=g, dtype=dtype)
        k = F.normalize(k, dim=-1) if unit else 0.4 * k
        v = torch.randn(*shape, C, Dv, generator=g, dtype=dtype)
        b = torch.rand(*shape, C, generator=g, dtype=dtype) if beta is None else torch.full(
            (*shape, C), beta, dtype=dtype)
        return Case((k, v, b), label=label)

    return [
        case((1, 2), 6, 8, 4, "B=1, H=2, a chunk of C = 6 unit keys, Dk=8, Dv=4"),
        case((2, 1), 16, 8, 8, "C = 16 > Dk = 8: the keys cannot all be orthogonal"),
        case((), 1, 4, 3, "a single token: W = β k, U = β v"),
        case((2, 2), 5, 6, 5, "keys not of unit length", unit=False),
        case((1, 2), 64, 32, 16, "a full chunk, C = 64"),
        case((1, 1), 8, 8, 8, "β = 1 for every token", beta=1.0),
        case((2,), 7, 5, 4, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="wy.wy_factors",
    title="the WY factors W = T K and U = T V of a chunk",
    signature="wy_factors(k [..., C, Dk], v [..., C, Dv], beta [..., C]) -> (W [..., C, Dk], U [..., C, Dv])",
    reference=wy_factors,
    make_cases=_wy_cases,
    chapter=7,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("no_beta_diag", lambda k, v, b: _factors_from(_A(k, b), k, v, b, scale=None),
                "T is missing its diag(β): you used T = A⁻¹. The recursion w_r = β_r (k_r − …) "
                "scales every row's right-hand side by β_r: T = A⁻¹ diag(β)."),
        Mistake("diagonal_in_tril",
                lambda k, v, b: _factors_from(_eye(k) + (b.unsqueeze(-1) * _gram(k)).tril(), k, v, b),
                "your tril includes the diagonal (β_i ‖k_i‖² added to the ones): token i does not "
                "interact with itself in the sum over earlier tokens. Use the strictly lower part, "
                "tril(·, -1)."),
        Mistake("beta_missing_in_A",
                lambda k, v, b: _factors_from(_eye(k) + _gram(k).tril(-1), k, v, b),
                "the strictly lower part is not scaled by β: A = I + tril(diag(β) K Kᵀ, -1), row i "
                "multiplied by β_i (from w_i = β_i (k_i − Σ_{j<i} (k_i·k_j) w_j))."),
        Mistake("beta_on_columns",
                lambda k, v, b: _factors_from(_eye(k) + (_gram(k) * b.unsqueeze(-2)).tril(-1), k, v, b),
                "β scales the columns of K Kᵀ in your A (K (βK)ᵀ instead of (βK) Kᵀ): row i of A "
                "belongs to token i and carries β_i, so A = I + tril(diag(β) K Kᵀ, -1)."),
        Mistake("beta_scales_rows", lambda k, v, b: _factors_from(_A(k, b), k, v, b, scale="rows"),
                "you computed diag(β) A⁻¹; the UT transform is A⁻¹ diag(β): β_j scales column j "
                "(the right-hand side of token j), not row i."),
        Mistake("wrong_sign",
                lambda k, v, b: _factors_from(_eye(k) - (b.unsqueeze(-1) * _gram(k)).tril(-1), k, v, b),
                "A has a minus sign: from w_r = β_r (k_r − Σ_{i<r} (k_r·k_i) w_i), moving the sum to "
                "the left gives w_r + β_r Σ (k_r·k_i) w_i = β_r k_r, so A = I + tril(diag(β) K Kᵀ, -1)."),
        Mistake("transposed_T", lambda k, v, b: _factors_from(_A(k, b), k, v, b, transpose=True),
                "you used Tᵀ: T is lower triangular (token r combines only tokens ≤ r), W = T K."),
    ],
    hint="A = I + (beta[..., :, None] * (k @ k.mT)).tril(-1); T = inverse(A) * beta[..., None, :] "
         "(A⁻¹ diag(β)); return T @ k, T @ v.",
))

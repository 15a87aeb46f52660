"""The WY representation and the UT transform (chapter 7): products of delta-rule updates.

Within a chunk of ``C`` tokens the delta rule multiplies the state by one rank-one
transition per token. In our row layout (``S: [Dk, Dv]``, ``o = q S``):

    S_C = P S_0 + (write terms),     P = (I − β_C k_Cᵀ k_C) ⋯ (I − β_1 k_1ᵀ k_1)

The WY representation writes the product of ``C`` such factors as one low-rank correction,
``P = I − Kᵀ W``, with ``W = T K`` and the lower-triangular ``C × C`` matrix

    T = (I + tril(diag(β) K Kᵀ, −1))⁻¹ diag(β)          (the "UT transform")

and the writes collapse the same way: ``S_C = P S_0 + Kᵀ U`` with ``U = T V``, so

    S_C = S_0 + Kᵀ (U − W S_0).

(Papers write the transposed state, ``P = I − Wᵀ K`` there; ``tests/test_wy.py`` checks both.)
Three ways to get ``T``, all equal: a triangular solve, forward substitution row by row (what
the derivation says), and the blocked inverse GPU kernels use (invert small diagonal blocks,
then merge them: ``[[A, 0], [B, D]]⁻¹ = [[A⁻¹, 0], [−D⁻¹ B A⁻¹, D⁻¹]]``).

Shapes: ``k: [..., C, Dk]``, ``v: [..., C, Dv]``, ``beta: [..., C]``, ``T: [..., C, C]``.
"""

from __future__ import annotations

import torch

from .._validate import positive_int

__all__ = [
    "transition_product",
    "ut_matrix",
    "ut_transform",
    "forward_substitution",
    "block_inverse",
    "wy_factors",
]


def transition_product(k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Reference: ``(I − β_C k_Cᵀ k_C) ⋯ (I − β_1 k_1ᵀ k_1)`` by ``C`` explicit ``Dk × Dk`` products."""
    Dk = k.shape[-1]
    P = torch.eye(Dk, dtype=k.dtype, device=k.device).expand(*k.shape[:-2], Dk, Dk)
    for t in range(k.shape[-2]):
        k_t = k[..., t, :]  # [..., Dk]
        factor = torch.eye(Dk, dtype=k.dtype, device=k.device) - beta[..., t, None, None] * (
            k_t.unsqueeze(-1) * k_t.unsqueeze(-2)
        )  # I − β_t k_tᵀ k_t   [..., Dk, Dk]
        P = factor @ P  # later tokens multiply on the left
    return P


def ut_matrix(k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``A = I + tril(diag(β) K Kᵀ, −1)``: unit lower triangular, ``[..., C, C]``."""
    C = k.shape[-2]
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    return eye + (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2))).tril(-1)


def forward_substitution(A: torch.Tensor) -> torch.Tensor:
    """``A⁻¹`` for a unit lower-triangular ``A [..., C, C]``, one row at a time.

    Row ``i`` of ``X = A⁻¹`` follows from ``Σ_j A_ij X_jm = δ_im``:
    ``X_i = e_i − Σ_{j<i} A_ij X_j`` (the rows above are already known). ``C`` steps.
    """
    C = A.shape[-1]
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    rows = []
    for i in range(C):
        x_i = eye[i].expand(*A.shape[:-2], C)  # e_i            [..., C]
        if i:
            prev = torch.stack(rows, dim=-2)  # X_0 .. X_{i-1} [..., i, C]
            x_i = x_i - (A[..., i, :i].unsqueeze(-2) @ prev).squeeze(-2)
        rows.append(x_i)
    return torch.stack(rows, dim=-2)


def block_inverse(A: torch.Tensor, block: int = 16) -> torch.Tensor:
    """``A⁻¹`` for unit lower-triangular ``A``: invert ``block × block`` diagonal blocks by
    forward substitution, then merge neighbours into blocks twice as large until one is left:

        [[A₁₁, 0], [A₂₁, A₂₂]]⁻¹ = [[A₁₁⁻¹, 0], [−A₂₂⁻¹ A₂₁ A₁₁⁻¹, A₂₂⁻¹]]

    This is how GPU kernels do it (fla: 16 × 16 blocks merged into 64 × 64), because the small
    inverses are cheap and the merges are matrix products. ``C`` need not be a power of two.
    """
    C = A.shape[-1]
    block = positive_int(block, "block", "wy.block_inverse")
    inv = torch.zeros_like(A)
    for s in range(0, C, block):  # invert the diagonal blocks
        e = min(s + block, C)
        inv[..., s:e, s:e] = forward_substitution(A[..., s:e, s:e])
    size = block
    while size < C:  # merge pairs of neighbouring blocks
        for s in range(0, C, 2 * size):
            m, e = min(s + size, C), min(s + 2 * size, C)
            if m >= e:
                continue
            top_inv, bottom_inv = inv[..., s:m, s:m], inv[..., m:e, m:e]
            inv[..., m:e, s:m] = -bottom_inv @ A[..., m:e, s:m] @ top_inv
        size *= 2
    return inv


def ut_transform(k: torch.Tensor, beta: torch.Tensor, method: str = "solve") -> torch.Tensor:
    """``T = (I + tril(diag(β) K Kᵀ, −1))⁻¹ diag(β)``, ``[..., C, C]``.

    ``method``: ``"solve"`` (a triangular solve), ``"forward"`` (forward substitution) or
    ``"block"`` (16 × 16 blocks merged, as kernels do). All equal to round-off.
    """
    A = ut_matrix(k, beta)
    if method == "solve":
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
        A_inv = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
    elif method == "forward":
        A_inv = forward_substitution(A)
    elif method == "block":
        A_inv = block_inverse(A)
    else:
        raise ValueError(f"method must be 'solve', 'forward' or 'block', got {method!r}")
    return A_inv * beta.unsqueeze(-2)  # A⁻¹ diag(β): scale column j by β_j


def wy_factors(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, method: str = "solve"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W = T K`` and ``U = T V``: then ``P = I − Kᵀ W`` and a chunk's writes are ``Kᵀ U``."""
    T = ut_transform(k, beta, method)
    return T @ k, T @ v

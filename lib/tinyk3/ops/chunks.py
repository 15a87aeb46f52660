"""What every chunked operator shares: the chunk size, the chunk layout, the initial state, the scan.

Every ``chunked`` form of :mod:`tinyk3.ops` (linear attention, the delta rule, and the gated
forms of later chapters) cuts ``[B, H, T, ...]`` into ``N = ⌈T / C⌉`` chunks of ``C`` tokens,
zero-padding the last one, works on ``[B, H, N, C, ...]``, and cuts the padding off the output.
Zero padding is harmless for all of them: a padded token has ``k = 0, v = 0`` (and ``β = 0``),
so it writes nothing into the state, and its output is dropped.
"""

from __future__ import annotations

import torch

from .._validate import check_state, positive_int

__all__ = ["chunk_size", "accumulation_dtype", "to_chunks", "from_chunks", "initial_state",
           "exclusive_scan_"]


def chunk_size(C, op: str) -> int:
    """``C`` as an int if it is a positive int (``True`` is rejected), else ``ValueError``."""
    return positive_int(C, "chunk_size", op)


def accumulation_dtype(like: torch.Tensor) -> torch.dtype:
    """The dtype states accumulate in: float32, or float64 for float64 inputs."""
    return torch.promote_types(like.dtype, torch.float32)


def to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """``[B, H, T, ...]`` → ``[B, H, N, C, ...]``, zero-padding the last chunk (``N = ⌈T / C⌉``).

    A view of ``x`` when ``C`` divides ``T`` and ``x`` is contiguous; a padded copy otherwise.
    """
    B, H, T, *rest = x.shape
    pad = (-T) % C
    if pad:
        x = torch.cat([x, x.new_zeros(B, H, pad, *rest)], dim=2)
    return x.reshape(B, H, (T + pad) // C, C, *rest)


def from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, N, C, ...]`` → ``[B, H, T, ...]``: the inverse of :func:`to_chunks`, padding dropped."""
    B, H, N, C, *rest = x.shape
    return x.reshape(B, H, N * C, *rest)[:, :, :T]


def initial_state(state, shape: tuple[int, ...], like: torch.Tensor, op: str,
                  name: str = "initial_state") -> torch.Tensor:
    """Zeros of ``shape`` if ``state`` is None, else ``state`` checked (shape, device, float) and
    cast to :func:`accumulation_dtype` of ``like``."""
    acc = accumulation_dtype(like)
    if state is None:
        return like.new_zeros(*shape, dtype=acc)
    check_state(state, shape, like, op, name)
    return state.to(acc)


def exclusive_scan_(x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """In place along the chunk axis (dim 2): ``x[:, :, c] ← start + Σ_{c' < c} x[:, :, c']``.

    Returns the total ``start + Σ_c x[:, :, c]``. ``x: [B, H, N, ...]``, ``start: [B, H, ...]``.

    One addition of a ``[B, H, ...]`` slab per chunk, in order, on memory it already owns. Not
    ``torch.cumsum(x, dim=2)``: on a CPU, PyTorch's cumsum along an axis that is not the innermost
    one walks each of the ``B·H·Dk·Dv`` columns separately, a whole state apart between steps, and
    it is several times slower than this loop at one token per chunk (chapter 6 times both).
    """
    total = start if x.shape[2] else start.clone()  # never hand back the caller's tensor
    for c in range(x.shape[2]):
        step = x[:, :, c]
        nxt = total + step  # S_[c+1] = S_[c] + (chunk c's term)
        step.copy_(total)  # x[:, :, c] becomes S_[c]
        total = nxt
    return total

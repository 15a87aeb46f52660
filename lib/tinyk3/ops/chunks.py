"""What every chunked operator shares: the chunk size, the chunk layout, the initial state, the scan.

Every ``chunked`` form of :mod:`tinyk3.ops` (linear attention, the delta rule, and the gated
forms of later chapters) cuts ``[B, H, T, ...]`` into ``N = ⌈T / C⌉`` chunks of ``C`` tokens,
zero-padding the last one, works on ``[B, H, N, C, ...]``, and cuts the padding off the output.
Zero padding is harmless for all of them: a padded token has ``k = 0, v = 0`` (and ``β = 0``),
so it writes nothing into the state, and its output is dropped.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable

from .._validate import check_state, positive_int

__all__ = ["chunk_size", "accumulation_dtype", "to_chunks", "from_chunks", "initial_state",
           "exclusive_scan_", "BACKWARD_MODES", "check_backward_mode", "needs_grad",
           "check_cotangents", "with_derived_backward", "backward_mode"]

# How a chunked form is differentiated (chapter 19): by the derived backward, which keeps only
# the inputs and the chunk-boundary states, or by autograd through the PyTorch forward.
BACKWARD_MODES = ("derived", "autograd")
_DEFAULT_BACKWARD = ["derived"]  # a stack: backward_mode() pushes, and pops on leaving


@contextlib.contextmanager
def backward_mode(mode: str):
    """Inside the ``with`` block, a chunked form called without ``backward=`` is differentiated
    by ``mode`` (``"derived"`` or ``"autograd"``): how a whole model built of chunked layers is
    switched from one backward to the other (chapter 19 trains and measures both)."""
    _DEFAULT_BACKWARD.append(check_backward_mode(mode, "backward_mode"))
    try:
        yield mode
    finally:
        _DEFAULT_BACKWARD.pop()


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


def check_backward_mode(mode, op: str) -> str:
    """``mode`` if it is one of :data:`BACKWARD_MODES` (None: the current default, ``"derived"``
    unless inside :func:`backward_mode`), else ``ValueError``."""
    if mode is None:
        return _DEFAULT_BACKWARD[-1]
    if not isinstance(mode, str) or mode not in BACKWARD_MODES:
        raise ValueError(f"{op}: backward must be one of {list(BACKWARD_MODES)}, got {mode!r}")
    return mode


def needs_grad(*tensors) -> bool:
    """Whether autograd is on and any of ``tensors`` (None allowed) requires a gradient."""
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors)


def check_cotangents(d_o, d_state, o_shape: tuple[int, ...], state_shape: tuple[int, ...],
                     like: torch.Tensor, op: str) -> None:
    """``d_o = ∂L/∂o`` of the output's shape and ``d_state = ∂L/∂S_T`` (None, or the state's
    shape), floating point, on the inputs' device."""
    for name, t, shape in (("d_o", d_o, o_shape), ("d_state", d_state, state_shape)):
        if t is None and name == "d_state":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")
        if t.device != like.device:
            raise ValueError(f"{op}: {name} is on {t.device}, the inputs on {like.device}")


def with_derived_backward(forward, backward, inputs: tuple, initial_state, C: int):
    """Run a chunked form so that autograd differentiates it by its derived backward.

    ``forward(*inputs, C, S0)`` returns ``(o, S_T, S_all)`` (``S_all``: every chunk's starting
    state ``[B·H, N, Dk, Dv]``); ``backward(*inputs, d_o, d_state, chunk_size=C,
    initial_state=..., boundary_states=S_all)`` returns the gradients ``(d input..., d_S0)``.
    Between the two, autograd keeps the inputs, the initial state and ``S_all``, nothing else.
    ``initial_state``: None, or the state already cast to the accumulation dtype (the cast
    stays outside, so autograd carries its gradient back to the caller's dtype).
    """
    return _WithDerivedBackward.apply(forward, backward, C, initial_state, *inputs)


class _WithDerivedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, backward, C, initial_state, *inputs):
        q, v = inputs[0], inputs[2]
        B, H, _, Dk = q.shape
        S0 = (q.new_zeros(B, H, Dk, v.shape[-1], dtype=accumulation_dtype(q))
              if initial_state is None else initial_state)
        o, S_T, S_all = forward(*inputs, C, S0)
        ctx.save_for_backward(initial_state, S_all, *inputs)
        ctx.backward_fn, ctx.C = backward, C
        return o, S_T

    @staticmethod
    @once_differentiable
    def backward(ctx, d_o, d_state):
        initial_state, S_all, *inputs = ctx.saved_tensors
        if d_o is None:  # only the final state was used
            q, v = inputs[0], inputs[2]
            d_o = v.new_zeros(*q.shape[:3], v.shape[-1])
        grads = ctx.backward_fn(*inputs, d_o, d_state, chunk_size=ctx.C,
                                initial_state=initial_state, boundary_states=S_all)
        return (None, None, None, grads[-1], *grads[:-1])

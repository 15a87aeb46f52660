"""Argument validation shared by the library: one helper per kind of argument, one message style.
Scalars (sizes, counts), the operators' tensors (``check_qkv``, ``check_state``, ``check_beta``,
``check_gate``: used by :mod:`tinyk3.ops` and :mod:`tinyk3.kernels`) and a mixer layer's input
(``check_mixer_input``).

Python's ``bool`` is a subclass of ``int`` (``True == 1``), so ``isinstance(True, int)`` holds;
sizes and counts reject it explicitly, because ``chunk_size=True`` is always a mistake.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["positive_int", "nonnegative_int", "is_int", "check_mixer_input", "check_tokens", "check_qkv",
           "check_state", "check_beta", "check_gate", "FLOAT_DTYPES"]


def is_int(x) -> bool:
    """Whether ``x`` is an integer (a Python or numpy int, or a 0-d integer tensor's ``.item()``),
    and not a ``bool``."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def positive_int(x, name: str, op: str | None = None) -> int:
    """``int(x)`` if ``x`` is an integer >= 1, else ``ValueError`` naming ``op`` and ``name``."""
    if not is_int(x) or x < 1:
        where = f"{op}: " if op else ""
        raise ValueError(f"{where}{name} must be a positive int, got {x!r}")
    return int(x)


def nonnegative_int(x, name: str, op: str | None = None) -> int:
    """``int(x)`` if ``x`` is an integer >= 0, else ``ValueError`` naming ``op`` and ``name``."""
    if not is_int(x) or x < 0:
        where = f"{op}: " if op else ""
        raise ValueError(f"{where}{name} must be a non-negative int, got {x!r}")
    return int(x)


def check_mixer_input(x, d_model: int, name: str) -> None:
    """A mixer's input ``x``: a float tensor ``[B, T, d_model]`` with ``T ≥ 1``, else a clear
    error naming the layer ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor [B, T, d], got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{name}: x must have shape [B, T, d={d_model}], got {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{name}: x has no tokens (T = 0)")
    if not x.is_floating_point():
        raise TypeError(f"{name}: x must be a floating-point tensor, got {x.dtype}")


def check_tokens(idx, vocab_size: int, *, start: int = 0, block_size: int | None = None,
                 cache_batch: int | None = None) -> tuple[int, int]:
    """A language model's input: ``idx`` an integer tensor ``[B, T]`` of token ids in
    ``[0, vocab_size)``, ``T ≥ 1``; with learned positions (``block_size``) the ``start`` cached
    tokens plus ``T`` fit in ``block_size``; a cache holding ``cache_batch`` sequences gets ``B``
    of them. Returns ``(B, T)``, else a clear error."""
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.long, torch.int32):
        raise TypeError("idx must be an integer tensor of token ids with shape [B, T]")
    if idx.dim() != 2:
        raise ValueError(f"idx must have shape [B, T], got {tuple(idx.shape)}")
    B, T = idx.shape
    if T == 0:
        raise ValueError("idx has no tokens (T = 0)")
    if block_size is not None and start + T > block_size:
        raise ValueError(f"sequence of {start + T} tokens ({start} cached + {T} new) is longer "
                         f"than block_size={block_size}: there is no position embedding past it")
    if cache_batch is not None and cache_batch != B:
        raise ValueError(f"cache holds batch size {cache_batch}, idx has {B}")
    if idx.min() < 0 or idx.max() >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{idx.min()}, {idx.max()}]")
    return B, T

# -- the operators' tensors (tinyk3.ops, tinyk3.kernels) ----------------------------------------

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: str) -> tuple[int, ...]:
    """``q, k: [B, H, T, Dk]``, ``v: [B, H, T, Dv]``, one float dtype, one device.

    Returns ``(B, H, T, Dk, Dv)``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must have shape [B, H, T, D], got {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"{op}: expected q, k [B, H, T, Dk] and v [B, H, T, Dv]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, H, T, Dk = q.shape
    return B, H, T, Dk, v.shape[-1]


def check_state(state, shape: tuple[int, ...], like: torch.Tensor, op: str, name: str) -> None:
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(state).__name__}")
    if tuple(state.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(state.shape)}")
    if state.device != like.device:
        raise ValueError(f"{op}: {name} is on {state.device}, the inputs on {like.device}")
    if not state.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {state.dtype}")


def check_beta(beta, B: int, H: int, T: int, like: torch.Tensor, op: str) -> None:
    if not isinstance(beta, torch.Tensor):
        raise TypeError(f"{op}: beta must be a torch.Tensor [B, H, T], got {type(beta).__name__}")
    if tuple(beta.shape) != (B, H, T):
        raise ValueError(f"{op}: beta must have shape [B, H, T] = {[B, H, T]}, got {list(beta.shape)}")
    if beta.dtype != like.dtype:
        raise TypeError(f"{op}: beta must have the dtype of q, k, v ({like.dtype}), got {beta.dtype}")
    if beta.device != like.device:
        raise ValueError(f"{op}: beta is on {beta.device}, the inputs on {like.device}")


def check_gate(g, B: int, H: int, T: int, Dk: int | None, like: torch.Tensor, op: str) -> None:
    """``g``: the log decay, ``[B, H, T]`` (one gate per head, ``Dk=None``) or ``[B, H, T, Dk]`` (one
    per key channel), the dtype and device of ``q``, finite and ``≤ 0`` (a decay factor
    ``exp(g) ∈ (0, 1]``)."""
    shape = [B, H, T] if Dk is None else [B, H, T, Dk]
    name = "[B, H, T]" if Dk is None else "[B, H, T, Dk]"
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{op}: g must be a torch.Tensor {name}, got {type(g).__name__}")
    if list(g.shape) != shape:
        raise ValueError(f"{op}: g (the log decay) must have shape {name} = {shape}, got {list(g.shape)}")
    if g.dtype != like.dtype:
        raise TypeError(f"{op}: g must have the dtype of q, k, v ({like.dtype}), got {g.dtype}")
    if g.device != like.device:
        raise ValueError(f"{op}: g is on {g.device}, the inputs on {like.device}")
    if g.numel():
        lo, hi = (x.item() for x in torch.aminmax(g.detach()))  # one pass; NaN propagates
        if not (math.isfinite(lo) and math.isfinite(hi)):
            bad = int((~torch.isfinite(g)).sum())
            raise ValueError(f"{op}: g has {bad} non-finite values (NaN or inf)")
        if hi > 0:
            raise ValueError(f"{op}: g is a log decay and must be <= 0 (exp(g) in (0, 1]); its "
                             f"largest value is {hi:.4g}")

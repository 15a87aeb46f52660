"""Chunkwise Gated DeltaNet as Triton kernels (chapter 10). Same contract as
:func:`tinyk3.ops.gated_delta_rule.chunked`::

    chunked(q, k, v, beta, g, *, chunk_size=64, initial_state=None) -> (o, S)
    q, k: [B, H, T, Dk]   v: [B, H, T, Dv]   beta, g: [B, H, T]   S: [B, H, Dk, Dv] (float32)

Chapter 9's three stages with one log decay ``g ≤ 0`` per token and head; the kernels are
:mod:`tinyk3.kernels.gated`'s with ``GATE = 1`` (shared with :mod:`tinyk3.kernels.kda`), where
the docstring says where the gate enters each stage. Modes (``operands``, ``input_precision``),
dtypes, limits and the interpreter are chapter 9's (:mod:`tinyk3.kernels.delta_rule`), without
``fuse_output``. Finite and accurate in float32 for any ``g ≤ 0`` (every decay factor the kernels
form is ``≤ 1``).
"""

from __future__ import annotations

import torch

from . import gated
from .gated import CHUNK_SIZES, INPUT_PRECISIONS, MAX_HEAD_DIM, OPERANDS  # noqa: F401

__all__ = ["chunked", "forward_stages", "compile_for_gpu", "launch_config", "GATE"]

GATE = gated.GATES["gated_delta_rule"]  # 1: one gate per head


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    input_precision: str | None = None,
    operands: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise Gated DeltaNet in Triton; the contract of
    :func:`tinyk3.ops.gated_delta_rule.chunked` (``beta`` before ``g``).

    Returns ``(o [B, H, T, Dv] in the inputs' dtype, S [B, H, Dk, Dv] float32)``. CUDA tensors run
    compiled, CPU tensors under the Triton interpreter. ``operands``: ``"float32"`` or
    ``"bfloat16"`` (bf16 tiles into every ``tl.dot``, float32 accumulation, intermediates stored
    in bf16, as fla does); ``None``: ``"bfloat16"`` for bfloat16 inputs, else ``"float32"``.
    ``input_precision`` (float32 operands): ``"ieee"``, ``"tf32"``, ``"tf32x3"``; ``None``: ``"ieee"``
    for float32 inputs, ``"tf32"`` otherwise. Differentiable: the backward runs as Triton kernels
    (:mod:`tinyk3.kernels.backward`, chapter 21).
    Raises :class:`tinyk3.kernels.TritonUnavailableError` if Triton is not installed.
    """
    return gated.chunked(q, k, v, beta, g, gate=GATE, chunk_size=chunk_size,
                         initial_state=initial_state, input_precision=input_precision,
                         operands=operands)


def forward_stages(q, k, v, beta, g, *, chunk_size=64, initial_state=None, input_precision=None,
                   operands=None, config=None) -> dict[str, torch.Tensor]:
    """What each stage wrote (``w``, ``u``, ``states``, ``u_new``, ``o``, ``S``); no autograd."""
    return gated.forward_stages(q, k, v, beta, g, gate=GATE, chunk_size=chunk_size,
                                initial_state=initial_state, input_precision=input_precision,
                                operands=operands, config=config)


def launch_config(chunk_size: int, Dk: int, Dv: int) -> dict[str, dict]:
    """:func:`tinyk3.kernels.gated.launch_config` with ``gate=1`` (chapter 9's, extended)."""
    return gated.launch_config(chunk_size, Dk, Dv, GATE)


def compile_for_gpu(arch: int = 90, **kwargs) -> dict:
    """:func:`tinyk3.kernels.gated.compile_for_gpu` with ``gate=1`` (same keywords as
    :func:`tinyk3.kernels.delta_rule.compile_for_gpu`, without ``fuse_output``)."""
    return gated.compile_for_gpu(GATE, arch, **kwargs)

"""Chunkwise Kimi Delta Attention as Triton kernels (chapter 11). Same contract as
:func:`tinyk3.ops.kda.chunked`::

    chunked(q, k, v, beta, g, *, chunk_size=64, initial_state=None) -> (o, S)
    q, k: [B, H, T, Dk]   v: [B, H, T, Dv]   beta: [B, H, T]   g: [B, H, T, Dk]   S: [B, H, Dk, Dv]

Chapter 9's three stages with one log decay per token and key channel; the kernels are
:mod:`tinyk3.kernels.gated`'s with ``GATE = 2`` (shared with
:mod:`tinyk3.kernels.gated_delta_rule`). The decayed ``K Kᵀ`` and ``Q Kᵀ`` are formed in 16-token
sub-chunks with reference points (the stable form of :func:`tinyk3.ops.kda.pair_scores`), so the
kernels keep the op's guarantee: finite and accurate in float32 for gates down to −5 per step
(Kimi K3's lower-bound gate) at chunk sizes 16, 32 and 64. Gates whose sum over a 16-token
sub-chunk falls below −80 (possible only below −5 per step) raise a ``ValueError`` that points
to :func:`tinyk3.ops.kda.chunked`, which handles any ``g ≤ 0``.
"""

from __future__ import annotations

import torch

from . import gated
from .gated import CHUNK_SIZES, EXP_LIMIT, INPUT_PRECISIONS, MAX_HEAD_DIM, OPERANDS, SUB_CHUNK  # noqa: F401

__all__ = ["chunked", "forward_stages", "compile_for_gpu", "launch_config", "GATE"]

GATE = gated.GATES["kda"]  # 2: one gate per key channel


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
    """Chunkwise KDA in Triton; the contract of :func:`tinyk3.ops.kda.chunked`.

    Returns ``(o [B, H, T, Dv] in the inputs' dtype, S [B, H, Dk, Dv] float32)``. CUDA tensors run
    compiled, CPU tensors under the Triton interpreter. ``operands`` and ``input_precision`` as in
    :func:`tinyk3.kernels.gated_delta_rule.chunked`. Differentiable: the backward runs as Triton kernels
    (:mod:`tinyk3.kernels.backward`, chapter 21). Raises
    ``ValueError`` for gates outside the kernels' range (see the module docstring) and
    :class:`tinyk3.kernels.TritonUnavailableError` if Triton is not installed.
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
    """:func:`tinyk3.kernels.gated.launch_config` with ``gate=2`` (chapter 9's, extended)."""
    return gated.launch_config(chunk_size, Dk, Dv, GATE)


def compile_for_gpu(arch: int = 90, **kwargs) -> dict:
    """:func:`tinyk3.kernels.gated.compile_for_gpu` with ``gate=2``."""
    return gated.compile_for_gpu(GATE, arch, **kwargs)

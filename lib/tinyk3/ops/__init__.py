"""Sequence-mixing operators: pure functions in the layout ``[B, H, T, D]``.

* :mod:`tinyk3.ops.attention` - causal softmax attention: loop, masked matrix, fused SDPA, and
  the one causal mask (chapters 1 and 2)
* :mod:`tinyk3.ops.linear_attention` - ``recurrent``, ``parallel`` (chapter 3), ``chunked`` (chapter 6)
* :mod:`tinyk3.ops.feature_maps` - φ for linear attention (chapter 3)
* :mod:`tinyk3.ops.delta_rule` - ``recurrent``, ``parallel`` (chapter 5), ``chunked`` (chapter 8)
* :mod:`tinyk3.ops.wy` - the WY representation and the UT transform (chapter 7)
* :mod:`tinyk3.ops.gated_delta_rule` - Gated DeltaNet, one decay per head: ``recurrent``,
  ``chunked`` (chapter 10)
* :mod:`tinyk3.ops.kda` - Kimi Delta Attention, one decay per key channel: ``recurrent``,
  ``chunked`` (chapter 11)

No operator scales or normalises q and k itself; the layers in :mod:`tinyk3.layers` do.

Every ``chunked`` form shares :mod:`tinyk3.ops.chunks`: the chunk-size check, the zero-padded
chunk layout ``[B, H, N, C, ...]``, the initial state (zeros, or checked and cast to the
accumulation dtype) and the in-place exclusive scan over chunks.
"""

from . import attention, chunks, delta_rule, feature_maps, gated_delta_rule, kda, linear_attention, wy

__all__ = ["attention", "linear_attention", "delta_rule", "gated_delta_rule", "kda", "feature_maps",
           "wy", "chunks"]

"""Causal softmax attention (chapters 1 and 2): the forms live in :mod:`tinyk3.ops.attention`;
this module keeps the import path the chapters use."""

from .ops.attention import (  # noqa: F401
    causal_attention,
    causal_attention_loop,
    causal_attention_sdpa,
    causal_mask,
    causal_softmax,
)

__all__ = ["causal_mask", "causal_softmax", "causal_attention_loop", "causal_attention",
           "causal_attention_sdpa"]

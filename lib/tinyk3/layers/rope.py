"""RoPE and RMSNorm, under the import path chapters 13 and 17 use: they live in
:mod:`tinyk3.layers.parts`."""

from .parts import RMSNorm, rope, rope_frequencies  # noqa: F401

__all__ = ["rope", "rope_frequencies", "RMSNorm"]

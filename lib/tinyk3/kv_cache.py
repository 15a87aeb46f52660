"""The KV cache (chapter 2): keep every past token's keys and values, per layer.

Decoding one token then costs one attention row over the cached keys instead of a full
forward pass over the whole prefix. The price is memory that grows with the sequence:
``2 · n_layer · n_embd`` numbers per token (keys and values, every layer, every head).
"""

from __future__ import annotations

import torch

from ._validate import nonnegative_int, positive_int

__all__ = ["KVCache", "kv_cache_bytes"]


class KVCache:
    """Keys and values of all tokens seen so far, one ``[B, H, T, D]`` pair per layer.

    The model calls :meth:`append` once per layer per forward pass; the cache concatenates
    (a serving system would pre-allocate or page this memory; the maths is the same).
    """

    def __init__(self, n_layer: int):
        n_layer = positive_int(n_layer, "n_layer", "KVCache")
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    @property
    def n_layer(self) -> int:
        return len(self.keys)

    @property
    def length(self) -> int:
        """Number of tokens held (read from the last layer, which is appended to last)."""
        last = self.keys[-1]
        return 0 if last is None else last.shape[2]

    @property
    def batch_size(self) -> int | None:
        last = self.keys[-1]
        return None if last is None else last.shape[0]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append new ``k, v: [B, H, T_new, D]`` to ``layer``; return all keys and values."""
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"layer {layer} out of range for a cache of {self.n_layer} layers")
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"k, v must be [B, H, T, D], got {tuple(k.shape)}, {tuple(v.shape)}")
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None:
            if old_k.shape[:2] != k.shape[:2] or old_k.shape[3] != k.shape[3]:
                raise ValueError(
                    f"layer {layer}: cached keys are {tuple(old_k.shape)}, new keys "
                    f"{tuple(k.shape)}: batch, heads and head size must match"
                )
            k = torch.cat([old_k, k], dim=2)  # [B, H, T_past + T_new, D]
            v = torch.cat([old_v, v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def nbytes(self) -> int:
        """Bytes held by all cached tensors (measured, not computed from a formula)."""
        return sum(
            t.numel() * t.element_size() for t in self.keys + self.values if t is not None
        )

    def __repr__(self) -> str:
        return f"KVCache(n_layer={self.n_layer}, length={self.length}, nbytes={self.nbytes():,})"


def kv_cache_bytes(
    n_layer: int, n_embd: int, seq_len: int, batch_size: int = 1, bytes_per_value: int = 4
) -> int:
    """Analytic cache size: K and V (2) × layers × ``n_embd`` (all heads) × tokens × batch."""
    for name, value in (("n_layer", n_layer), ("n_embd", n_embd), ("batch_size", batch_size),
                        ("bytes_per_value", bytes_per_value)):
        positive_int(value, name, "kv_cache_bytes")
    nonnegative_int(seq_len, "seq_len", "kv_cache_bytes")
    return 2 * n_layer * n_embd * seq_len * batch_size * bytes_per_value

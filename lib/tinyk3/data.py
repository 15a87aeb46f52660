"""Offline data: English prose that ships with every Python, tokenised as bytes.

``pydoc_data.topics`` holds the text of Python's ``help()`` topics (about 465 KB of
documentation prose and code). It is present in every CPython, Colab's included, so nothing
is downloaded. Bytes are the tokens: vocabulary 256, no tokenizer to train.
"""

from __future__ import annotations

import torch

__all__ = ["load_corpus", "encode", "decode", "split", "get_batch", "VOCAB_SIZE"]

VOCAB_SIZE = 256


def load_corpus() -> bytes:
    """The help-topic texts, in a fixed (sorted) order, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def encode(text: str | bytes) -> torch.Tensor:
    """Text → ``int64`` tensor of byte values."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.tensor(list(data), dtype=torch.long)


def decode(tokens) -> str:
    """Byte values → text (invalid UTF-8, e.g. a half-sampled character, shows as �)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def split(data: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """First ``1 - val_fraction`` for training, the rest for validation (no shuffling)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n = int(len(data) * (1 - val_fraction))
    return data[:n], data[n:]


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs ``x [B, T]`` and next-token targets ``y [B, T]`` (shifted by one)."""
    if len(data) <= block_size:
        raise ValueError(f"data has {len(data)} tokens, need more than block_size={block_size}")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts.tolist()])
    return x, y

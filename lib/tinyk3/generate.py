"""Autoregressive generation, with or without the KV cache (chapter 2)."""

from __future__ import annotations

import torch

from ._validate import nonnegative_int, positive_int

__all__ = ["generate", "sample_next"]


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token from ``logits: [B, V]``; ``temperature=0`` means greedy."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # [B, 1]
    logits = logits / temperature
    if top_k is not None:
        top_k = positive_int(top_k, "top_k", "sample_next")
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)  # [B, 1]


@torch.no_grad()
def generate(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Append ``max_new_tokens`` tokens to ``idx: [B, T]`` and return ``[B, T + max_new_tokens]``.

    Without the cache every step runs the model on the whole sequence so far (cropped to the
    last ``block_size`` tokens once it is longer) and keeps only the last position's logits.
    With it, the prompt is run once (prefill) and each later step feeds only the newest token.
    Within ``block_size`` both see the same logits (``tests/test_kv_cache.py``), so with the
    same ``generator`` they produce the same tokens. A cache cannot slide past ``block_size``:
    its keys were computed at absolute positions, so that case is an error.
    """
    if idx.dim() != 2:
        raise ValueError(f"idx must have shape [B, T], got {tuple(idx.shape)}")
    max_new_tokens = nonnegative_int(max_new_tokens, "max_new_tokens", "generate")
    block_size = model.config.block_size
    if use_cache and idx.shape[1] + max_new_tokens > block_size:
        raise ValueError(
            f"{idx.shape[1]} prompt + {max_new_tokens} new tokens exceed block_size={block_size}: "
            "the KV cache holds keys at absolute positions and cannot slide; use "
            "use_cache=False, which crops the context to the last block_size tokens"
        )
    was_training = model.training
    model.eval()
    try:
        cache = model.new_cache() if use_cache else None
        step_input = idx if use_cache else idx[:, -block_size:]
        for _ in range(max_new_tokens):
            logits = model(step_input, cache=cache)[:, -1, :]  # [B, V]: only the last position
            nxt = sample_next(logits, temperature, top_k, generator)  # [B, 1]
            idx = torch.cat([idx, nxt], dim=1)
            step_input = nxt if use_cache else idx[:, -block_size:]
    finally:
        model.train(was_training)
    return idx

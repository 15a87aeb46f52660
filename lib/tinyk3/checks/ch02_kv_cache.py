"""Chapter 2 exercises: attention over a cache, and the size of the cache."""

from __future__ import annotations

import math

import torch

from ..attention import causal_attention
from ..kv_cache import kv_cache_bytes
from .core import Case, Exercise, Mistake, register


def attend_with_cache(q_new, k_cache, v_cache, k_new, v_new):
    """Reference: the new tokens attend to all cached tokens and causally to each other."""
    k = torch.cat([k_cache, k_new], dim=2)  # [B, H, T_past + T_new, D]
    v = torch.cat([v_cache, v_new], dim=2)
    return causal_attention(q_new, k, v)  # bottom-right aligned mask


def _cache_cases(g: torch.Generator) -> list[Case]:
    cases = []
    for B, H, Tp, Tn, D in [(1, 1, 3, 1, 4), (1, 2, 5, 4, 8), (2, 3, 16, 7, 8),
                            (1, 4, 1, 12, 16), (2, 2, 30, 2, 8)]:
        q_new, k_new, v_new = (torch.randn(B, H, Tn, D, generator=g) for _ in range(3))
        k_cache, v_cache = (torch.randn(B, H, Tp, D, generator=g) for _ in range(2))
        cases.append(Case((q_new, k_cache, v_cache, k_new, v_new),
                          label=f"{Tp} cached + {Tn} new tokens, B={B}, H={H}, D={D}"))
    return cases


def _scores(q_new, k_cache, k_new):
    k = torch.cat([k_cache, k_new], dim=2)
    return (q_new @ k.transpose(-1, -2)) / math.sqrt(q_new.shape[-1])


def _no_mask(q_new, k_cache, v_cache, k_new, v_new):
    return _scores(q_new, k_cache, k_new).softmax(-1) @ torch.cat([v_cache, v_new], dim=2)


def _top_left(q_new, k_cache, v_cache, k_new, v_new):
    s = _scores(q_new, k_cache, k_new)
    Tn, Tk = s.shape[-2], s.shape[-1]
    s = s.masked_fill(torch.ones(Tn, Tk, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ torch.cat([v_cache, v_new], dim=2)


def _new_only(q_new, k_cache, v_cache, k_new, v_new):
    return causal_attention(q_new, k_new, v_new)


register(Exercise(
    id="kv_cache.attend_with_cache",
    title="attention of new tokens over a KV cache",
    signature="attend_with_cache(q_new, k_cache, v_cache, k_new, v_new) -> o [B, H, T_new, D]",
    reference=attend_with_cache,
    make_cases=_cache_cases,
    chapter=2,
    mistakes=[
        Mistake("no_mask", _no_mask,
                "no causal mask: with one new token that is right, but a block of new tokens then "
                "sees its own future (the post's listing has this bug). New token i may see cached "
                "keys and new keys 0..i."),
        Mistake("top_left_mask", _top_left,
                "your mask is aligned to the top-left (like `is_causal=True` with fewer queries "
                "than keys), which hides cached keys from the new tokens. New token i sits at "
                "position T_past + i: shift the diagonal by T_past (`tril(diagonal=T_past)`)."),
        Mistake("no_scale", lambda q, kc, vc, kn, vn: attend_with_cache(
                    q * math.sqrt(q.shape[-1]), kc, vc, kn, vn),
                "your output matches attention without the 1/√D scale on the scores."),
        Mistake("new_only", _new_only,
                "you attend only among the new tokens: concatenate the cached keys and values "
                "in front of the new ones first."),
    ],
    hint="k = cat(k_cache, k_new), v likewise; scores q_new·kᵀ/√D; mask key j > T_past + i.",
))


def cache_bytes(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value):
    """Reference: K and V, per layer, per head, per token, per sequence."""
    return kv_cache_bytes(n_layer, n_head * head_dim, seq_len, batch_size, bytes_per_value)


def _bytes_cases(g: torch.Generator) -> list[Case]:
    rows = [
        (12, 12, 64, 1024, 1, 4, "GPT-2 small, float32, full context"),
        (12, 12, 64, 1, 1, 2, "one token, bfloat16"),
        (48, 25, 64, 1024, 8, 2, "GPT-2 XL, batch of 8, bfloat16"),
    ]
    for _ in range(3):
        L, H, D, T, B = (int(torch.randint(lo, hi, (1,), generator=g))
                         for lo, hi in [(1, 64), (1, 64), (8, 257), (1, 100_000), (1, 33)])
        rows.append((L, H, D, T, B, int([1, 2, 4][int(torch.randint(0, 3, (1,), generator=g))]),
                     "random sizes"))
    return [Case(r[:6], label=f"{r[6]}: L={r[0]}, H={r[1]}, D={r[2]}, T={r[3]}, B={r[4]}, "
                              f"{r[5]} bytes") for r in rows]


register(Exercise(
    id="kv_cache.cache_bytes",
    title="KV-cache size in bytes",
    signature="cache_bytes(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value) -> int",
    reference=cache_bytes,
    make_cases=_bytes_cases,
    chapter=2,
    mistakes=[
        Mistake("keys_only", lambda L, H, D, T, B, b: L * H * D * T * B * b,
                "you counted only the keys (or only the values): the cache holds both, a factor 2."),
        Mistake("one_layer", lambda L, H, D, T, B, b: 2 * H * D * T * B * b,
                "every layer keeps its own keys and values: multiply by n_layer."),
        Mistake("one_head", lambda L, H, D, T, B, b: 2 * L * D * T * B * b,
                "every head has its own keys and values: multiply by n_head."),
        Mistake("bits", lambda L, H, D, T, B, b: 16 * L * H * D * T * B * b,
                "you counted bits, not bytes: bytes_per_value is already in bytes."),
        Mistake("no_batch", lambda L, H, D, T, B, b: 2 * L * H * D * T * b,
                "each sequence in the batch has its own cache: multiply by batch_size."),
    ],
    hint="2 (K and V) × n_layer × n_head × head_dim × seq_len × batch_size × bytes_per_value.",
))

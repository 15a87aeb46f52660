"""Chapter 18 exercises: reading the closing comparison. The bytes one token of context adds to
a model's cache, from its configuration (chapters 2 and 13), and the longest context whose
decoding state fits a memory budget."""

from __future__ import annotations

from .core import Case, Exercise, Mistake, register

# -- compare.cache_bytes -------------------------------------------------------------------------


def _cache_cases(gen) -> list[Case]:
    del gen
    from ..compare import MECHANISMS, tiny_config
    from ..models import presets

    cases = []
    for name in MECHANISMS:
        for d, h in ((64, 2), (32, 4)):
            cfg = tiny_config(name, vocab_size=64, d_model=d, n_head=h)
            cases.append(Case((cfg, 4), label=f"chapter 18's {name!r} row at width {d}, "
                                              f"{h} heads, float32"))
    for maker, what in ((presets.gpt2_small, "GPT-2 small: 12 softmax layers"),
                        (presets.deepseek_v3, "DeepSeek-V3: 61 MLA layers with RoPE"),
                        (presets.kimi_linear_48b, "Kimi Linear 48B: 20 KDA and 7 NoPE MLA "
                                                  "layers"),
                        (presets.kimi_k3, "Kimi K3: 69 KDA and 24 NoPE MLA layers")):
        cases.append(Case((maker(), 2), label=f"{what}, bf16"))
    return cases


def _reference_cache_bytes(cfg, bytes_per_value):
    """Reference: :func:`tinyk3.compare.cache_bytes_per_token` (imported late: ``compare``
    builds models, which import the layers)."""
    from ..compare import cache_bytes_per_token

    return cache_bytes_per_token(cfg, bytes_per_value)


def _mistake_cache(kind):
    def fn(cfg, bytes_per_value):
        values = 0
        for m in cfg.layer_mixers:
            if m.kind == "softmax":
                values += {"keys_only": cfg.n_embd,
                           "one_head": 2 * cfg.n_embd // m.n_head}.get(kind, 2 * cfg.n_embd)
            elif m.kind == "mla":
                if kind == "mla_as_mha":
                    values += m.n_head * (m.qk_nope_head_dim + m.qk_rope_head_dim
                                          + m.v_head_dim)
                elif kind == "latent_only":
                    values += m.kv_lora_rank
                elif kind == "rope_if_rotated":
                    values += m.kv_lora_rank + (m.qk_rope_head_dim if m.use_rope else 0)
                else:
                    values += m.kv_lora_rank + m.qk_rope_head_dim
        return values if kind == "values" else values * bytes_per_value

    return fn


register(Exercise(
    id="compare.cache_bytes",
    title="one more token's cache bytes",
    signature="cache_bytes_per_token(cfg: LMConfig, bytes_per_value: int) -> int",
    reference=_reference_cache_bytes,
    make_cases=_cache_cases,
    chapter=18,
    mistakes=[
        Mistake("keys_only", _mistake_cache("keys_only"),
                "a softmax layer caches a value beside every key: 2 · n_embd numbers per "
                "token, all heads together (chapter 2)."),
        Mistake("one_head", _mistake_cache("one_head"),
                "you counted one head: every head keeps its own key and value, n_head of "
                "them, 2 · n_embd numbers per token in all."),
        Mistake("mla_as_mha", _mistake_cache("mla_as_mha"),
                "an MLA layer caches its latent, not every head's key and value: the heads' "
                "keys and values are rebuilt from it (chapter 13)."),
        Mistake("latent_only", _mistake_cache("latent_only"),
                "an MLA layer also caches its shared key channels, qk_rope_head_dim of them, "
                "beside the latent (DeepSeek-V3: 512 + 64)."),
        Mistake("rope_if_rotated", _mistake_cache("rope_if_rotated"),
                "Kimi's MLA applies no RoPE (use_rope=False) but keeps the shared key channels "
                "all the same: kv_lora_rank + qk_rope_head_dim numbers whether rotated or not."),
        Mistake("values", _mistake_cache("values"),
                "you returned numbers, not bytes: multiply by bytes_per_value."),
    ],
    hint="loop over cfg.layer_mixers: kind 'softmax' adds 2 · cfg.n_embd, kind 'mla' adds "
         "kv_lora_rank + qk_rope_head_dim, every other kind 0; times bytes_per_value.",
))


# -- compare.tokens_in_budget ---------------------------------------------------------------------


def tokens_in_budget(budget_bytes, fixed_bytes, bytes_per_token, max_context):
    """Reference: the longest context ``T`` (an int, at most ``max_context``) at which a
    decoding state of ``fixed_bytes + T · bytes_per_token`` fits in ``budget_bytes``; 0 when
    not even the fixed part fits. A state that does not grow (``bytes_per_token == 0``) fits at
    every length up to ``max_context``."""
    if fixed_bytes > budget_bytes:
        return 0
    if bytes_per_token == 0:
        return int(max_context)
    return int(min(max_context, (budget_bytes - fixed_bytes) // bytes_per_token))


def _budget_cases(gen) -> list[Case]:
    del gen

    def case(budget, fixed, per, limit, label):
        return Case((budget, fixed, per, limit),
                    label=f"budget {budget:,} B, fixed {fixed:,} B, {per:,} B per token, "
                          f"context limit {limit:,}: {label}")

    return [
        case(10_000, 1_000, 100, 1_000_000, "a growing cache"),
        case(10_050, 1_000, 100, 1_000_000, "the budget is not a multiple: round down"),
        case(5_000, 20_992, 0, 4_096, "a fixed state larger than the budget"),
        case(1 << 20, 20_992, 0, 4_096, "a fixed state: every length up to the limit"),
        case(1 << 30, 10_496, 128, 4_096, "the limit binds"),
        case(999, 0, 1_000, 100, "not even one token"),
        case(1_000, 2_000, 10, 100, "a growing cache whose fixed part is already too large"),
        case(141 * 10**9, 465 * 10**6, 27_648, 1_048_576,
             "K3-sized: 465 MB of KDA states, 27,648 B of MLA cache per token, 141 GB"),
    ]


def _mistake_budget(kind):
    def fn(budget, fixed, per, limit):
        if kind == "ignores_fixed":
            fixed = 0
        if fixed > budget and kind != "negative":
            return 0
        if per == 0:
            return int(limit)
        if kind == "rounds_up":
            t = -(-(budget - fixed) // per)
        else:
            t = (budget - fixed) // per
        return int(t) if kind == "no_limit" else int(min(limit, t))

    return fn


register(Exercise(
    id="compare.tokens_in_budget",
    title="the longest context whose decoding state fits",
    signature="tokens_in_budget(budget_bytes, fixed_bytes, bytes_per_token, max_context) -> int",
    reference=tokens_in_budget,
    make_cases=_budget_cases,
    chapter=18,
    mistakes=[
        Mistake("ignores_fixed", _mistake_budget("ignores_fixed"),
                "you left out the fixed part: the recurrent layers' states and the "
                "convolution windows take fixed_bytes before the first token of cache."),
        Mistake("rounds_up", _mistake_budget("rounds_up"),
                "you rounded up: a context of T tokens must fit entirely, so T is the floor of "
                "(budget − fixed) / bytes_per_token."),
        Mistake("negative", _mistake_budget("negative"),
                "when the fixed part alone exceeds the budget, no context fits: return 0, not a "
                "negative length."),
        Mistake("no_limit", _mistake_budget("no_limit"),
                "the model's context limit caps the answer: a large budget does not make a "
                "model read past max_context."),
    ],
    hint="0 if fixed_bytes > budget_bytes; max_context if bytes_per_token == 0; otherwise "
         "min(max_context, (budget_bytes − fixed_bytes) // bytes_per_token).",
))

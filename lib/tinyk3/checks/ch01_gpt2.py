"""Chapter 1 exercises: causal attention, the parameter count, top-k sampling."""

from __future__ import annotations

import math

import torch

from ..attention import causal_attention
from ..gpt2 import GPTConfig, count_parameters
from .core import Case, Exercise, Mistake, register


def _qkv_cases(g: torch.Generator) -> list[Case]:
    shapes = [(1, 2, 5, 8), (1, 1, 1, 4), (2, 3, 17, 16), (2, 4, 32, 8), (1, 1, 64, 32)]
    cases = []
    for B, H, T, D in shapes:
        q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
        cases.append(Case((q, k, v), label=f"B={B}, H={H}, T={T}, D={D}"))
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cases.append(Case((q, k, v), label="float64 inputs: keep the dtype"))
    return cases


def _attn(q, k, v, *, scale=None, mask="causal", softmax_dim=-1):
    T, D = q.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(D) if scale is None else scale)
    if mask == "causal":
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    elif mask == "strict":
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(0), float("-inf"))
    elif mask == "upper":
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).tril(-1), float("-inf"))
    elif mask == "inverted":
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).tril(0), float("-inf"))
    elif mask == "zeros":
        s = s.tril()
    return s.softmax(dim=softmax_dim) @ v


register(Exercise(
    id="gpt2.causal_attention",
    title="causal self-attention",
    signature="causal_attention(q, k, v) -> o, all [B, H, T, D]",
    reference=causal_attention,
    make_cases=_qkv_cases,
    chapter=1,
    mistakes=[
        Mistake("no_mask", lambda q, k, v: _attn(q, k, v, mask=None),
                "your output matches attention with no causal mask: every token also sees the "
                "tokens after it. Fill the scores above the diagonal with -inf before the softmax."),
        Mistake("no_scale", lambda q, k, v: _attn(q, k, v, scale=1.0),
                "your output matches attention without the 1/√D scale on q·kᵀ."),
        Mistake("scale_by_d", lambda q, k, v: _attn(q, k, v, scale=1.0 / q.shape[-1]),
                "your output matches scores divided by D; the scale is 1/√D."),
        Mistake("strict_mask", lambda q, k, v: _attn(q, k, v, mask="strict"),
                "your mask also hides the diagonal, so a token cannot see itself (and the first "
                "row is all -inf, hence NaN). Mask only j > i: `triu(diagonal=1)`."),
        Mistake("upper_mask", lambda q, k, v: _attn(q, k, v, mask="upper"),
                "your mask is flipped: tokens see the future and not the past. Mask j > i."),
        Mistake("zeros_not_inf", lambda q, k, v: _attn(q, k, v, mask="zeros"),
                "you zeroed the future scores (e.g. `scores.tril()`), but a score of 0 still gets "
                "weight e⁰ after the softmax. Fill them with -inf so their weight is exactly 0."),
        Mistake("inverted_mask", lambda q, k, v: _attn(q, k, v, mask="inverted"),
                "your mask is inverted: it hides the past and the diagonal (`tril`) and keeps the "
                "future, so the last row is all -inf (NaN). Hide j > i: `triu(diagonal=1)`."),
        Mistake("softmax_dim", lambda q, k, v: _attn(q, k, v, softmax_dim=-2),
                "the softmax runs over the query axis; each query's weights over the keys "
                "(the last axis, dim=-1) must sum to 1."),
    ],
    hint="compute scores = q @ kᵀ / √D, mask j > i with -inf, softmax over the last axis, then @ v.",
))


def _param_cases(g: torch.Generator) -> list[Case]:
    configs = [
        (50257, 1024, 12, 768, "GPT-2 small"),
        (50257, 1024, 24, 1024, "GPT-2 medium"),
        (256, 64, 2, 32, "a tiny byte-level model"),
    ]
    for _ in range(3):
        V = int(torch.randint(50, 1000, (1,), generator=g))
        P = int(torch.randint(8, 512, (1,), generator=g))
        L = int(torch.randint(1, 8, (1,), generator=g))
        d = 16 * int(torch.randint(1, 16, (1,), generator=g))
        configs.append((V, P, L, d, "random sizes"))
    return [Case((V, P, L, d), label=f"{label}: V={V}, P={P}, L={L}, d={d}")
            for V, P, L, d, label in configs]


def _count(vocab_size, block_size, n_layer, n_embd):
    return count_parameters(GPTConfig(vocab_size=vocab_size, block_size=block_size,
                                      n_layer=n_layer, n_head=1, n_embd=n_embd))


register(Exercise(
    id="gpt2.param_count",
    title="GPT-2 parameter count",
    signature="param_count(vocab_size, block_size, n_layer, n_embd) -> int",
    reference=_count,
    make_cases=_param_cases,
    chapter=1,
    mistakes=[
        Mistake("untied_head", lambda V, P, L, d: _count(V, P, L, d) + V * d,
                "you counted the output head separately; GPT-2 ties it to the token embedding, "
                "so its V·d weights are already counted."),
        Mistake("no_positions", lambda V, P, L, d: _count(V, P, L, d) - P * d,
                "you left out the learned position embedding (block_size × n_embd)."),
        Mistake("no_biases", lambda V, P, L, d: _count(V, P, L, d) - L * 9 * d,
                "you left out the biases of the four Linear layers (3d + d + 4d + d per block)."),
        Mistake("no_layernorm", lambda V, P, L, d: _count(V, P, L, d) - (4 * L + 2) * d,
                "you left out the LayerNorms: two per block and a final one, each with a weight "
                "and a bias of size d."),
        Mistake("no_final_ln", lambda V, P, L, d: _count(V, P, L, d) - 2 * d,
                "you left out the final LayerNorm (ln_f) before the head: 2·d more."),
        Mistake("rule_of_thumb", lambda V, P, L, d: 12 * L * d * d,
                "12·L·d² is the rule of thumb for the blocks' weight matrices; the exact count "
                "adds biases, LayerNorms and the embeddings."),
        Mistake("mlp_width", lambda V, P, L, d: _count(V, P, L, d) - L * (6 * d * d + 3 * d),
                "check the MLP: its hidden layer is 4·d wide (d→4d→d), not d."),
    ],
    hint="per block: 2 LayerNorms, c_attn (d→3d), c_proj (d→d), c_fc (d→4d), c_proj (4d→d), "
         "all with biases; plus token and position embeddings and a final LayerNorm.",
))


def top_k_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row, set the rest to ``-inf`` (reference)."""
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _topk_cases(g: torch.Generator) -> list[Case]:
    cases = []
    for B, V, k in [(1, 10, 1), (2, 10, 3), (4, 50, 5), (3, 256, 40), (1, 7, 7)]:
        cases.append(Case((torch.randn(B, V, generator=g) * 3, k), label=f"B={B}, V={V}, k={k}"))
    return cases


def _kth_off_by_one(logits, k):
    kth = torch.topk(logits, min(k + 1, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


register(Exercise(
    id="gpt2.top_k_logits",
    title="top-k filtering of logits",
    signature="top_k_logits(logits [B, V], k) -> [B, V]",
    reference=top_k_logits,
    make_cases=_topk_cases,
    chapter=1,
    mistakes=[
        Mistake("zero_not_inf", lambda x, k: torch.where(top_k_logits(x, k).isinf(), 0.0, x),
                "you set the dropped logits to 0; a logit of 0 still has probability e⁰ > 0 after "
                "the softmax. Use -inf."),
        Mistake("off_by_one", _kth_off_by_one,
                "you keep k + 1 logits per row: compare with the k-th largest value "
                "(`topk(...).values[..., -1:]`) and keep those >= it."),
        Mistake("values_only", lambda x, k: torch.topk(x, k, dim=-1).values,
                "return the full [B, V] logits with the others masked, not just the top-k values "
                "(the token ids are the positions)."),
        Mistake("global_k", lambda x, k: x.masked_fill(x < x.flatten().topk(k).values[-1],
                                                       float("-inf")),
                "you chose the top k over the whole batch; each row (each sequence) keeps its own k."),
    ],
    hint="find each row's k-th largest logit and replace every smaller logit with -inf (not 0, "
         "not a large negative number).",
))

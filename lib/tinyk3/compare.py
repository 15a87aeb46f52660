"""The closing comparison of the course: every token mixer of chapters 1-17 in the same tiny
language model, and the measurements taken of each (chapter 18).

:func:`tiny_config` builds the model of one mechanism: the same width, number of layers,
feed-forward (SwiGLU), norm (RMSNorm), untied head and no learned positions for every
mechanism (the attention-only rows rotate their queries and keys, RoPE), so that only the
token mixer differs (and, for the tiny Kimi K3, what K3 changes
around it: attention residuals, a latent mixture of experts, SiTU-GLU). :func:`prefill` feeds
a model random tokens through its cache, :func:`cache_growth` splits the cache's bytes into a
fixed part and a part per token of context, and :func:`decode_step_seconds` times one decoded
token from a given context with :func:`tinyk3.timing.time_fn`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._validate import positive_int
from .layers import (
    DeltaNetConfig,
    GatedDeltaNetConfig,
    KDAConfig,
    LinearAttentionConfig,
    MLAConfig,
    MoEConfig,
    SoftmaxAttentionConfig,
    SwiGLUConfig,
)
from .models import LM, LMCache, LMConfig
from .timing import Timing, time_fn

__all__ = ["MECHANISMS", "CHAPTERS", "tiny_config", "prefill", "cache_growth",
           "CacheGrowth", "decode_step_seconds", "decode_times", "absorb_mla",
           "cache_bytes_per_token", "pareto_front"]

@dataclass(frozen=True)
class _Parts:
    """What every mechanism's tiny model is made of (see :func:`tiny_config`)."""

    n_head: int
    head_dim: int
    d_model: int
    n_layer: int
    chunk_size: int

    @property
    def mla(self) -> dict:  # NoPE MLA with a latent of d_model // 2 (a hybrid's, Kimi's)
        return dict(n_head=self.n_head, kv_lora_rank=self.d_model // 2,
                    qk_nope_head_dim=self.head_dim, qk_rope_head_dim=0,
                    v_head_dim=self.head_dim, use_rope=False)

    @property
    def mla_rope(self) -> dict:  # DeepSeek's: plus a shared RoPE key of head_dim // 2
        return dict(self.mla, qk_rope_head_dim=self.head_dim // 2, use_rope=True)

    def kda(self, **kw) -> KDAConfig:
        return KDAConfig(n_head=self.n_head, head_dim=self.head_dim, chunk_size=self.chunk_size,
                         **kw)

    def every_layer(self, mixer) -> dict:  # the same mixer in every layer, the default MLP
        return dict(pattern=(mixer,) * self.n_layer)

    def last_layer(self, mixer, last) -> dict:  # a hybrid: ``last`` in the last layer only
        return dict(pattern=(mixer,) * (self.n_layer - 1) + (last,))


def _tiny_k3(p: _Parts) -> dict:
    """Chapter 17's changes on the hybrid (see :func:`tiny_config`)."""
    kda = p.kda(gate="lower_bound", output_gate="full")
    latent = MoEConfig(8, 2, p.d_model, n_shared=1, activation="situ",
                       latent_dim=p.d_model // 2, latent_norm=True)
    return dict(**p.last_layer(kda, MLAConfig(**p.mla, output_gate=True)),
                mlp=[SwiGLUConfig(2 * p.d_model, activation="situ")] + [latent] * (p.n_layer - 1),
                attn_res_block_size=1)


# name -> (the chapter that builds its mixer, the LMConfig fields its tiny model sets), in the
# order the course meets them; adding a mechanism is one line here
_MECHANISMS = {
    "softmax": (1, lambda p: p.every_layer(SoftmaxAttentionConfig(n_head=p.n_head,
                                                                  rope=True))),
    "softmax + conv": (5, lambda p: p.every_layer(SoftmaxAttentionConfig(
        n_head=p.n_head, conv_size=4, rope=True))),
    "linear": (3, lambda p: p.every_layer(LinearAttentionConfig(n_head=p.n_head, conv_size=4))),
    "DeltaNet": (5, lambda p: p.every_layer(DeltaNetConfig(n_head=p.n_head, conv_size=4))),
    "Gated DeltaNet": (10, lambda p: p.every_layer(GatedDeltaNetConfig(
        n_head=p.n_head, head_dim=p.head_dim, chunk_size=p.chunk_size))),
    "KDA": (12, lambda p: p.every_layer(p.kda())),
    "MLA": (13, lambda p: p.every_layer(MLAConfig(**p.mla_rope))),
    "KDA + MLA": (15, lambda p: p.last_layer(p.kda(), MLAConfig(**p.mla))),
    "tiny K3": (17, _tiny_k3),
}
CHAPTERS = {name: chapter for name, (chapter, _) in _MECHANISMS.items()}
MECHANISMS = tuple(_MECHANISMS)


def tiny_config(name: str, *, vocab_size: int, d_model: int = 64, n_head: int = 2,
                n_layer: int = 2, chunk_size: int = 16, block_size: int = 1 << 20) -> LMConfig:
    """The tiny model of mechanism ``name`` (one of :data:`MECHANISMS`).

    Every mechanism gets ``n_layer`` layers of width ``d_model`` with ``n_head`` heads of
    ``d_model // n_head`` channels, a SwiGLU feed-forward of twice the width, RMSNorm, an
    untied head and no learned positions (so the model runs at any context). Order comes from
    causality, from the short convolution where a mixer has one, and in the attention-only
    models from RoPE on queries and keys (chapter 13), which a model without any of these
    would lack entirely:

    * ``"softmax"``: GPT-2's attention (chapter 1) with RoPE in place of GPT-2's learned
      positions (which would not run at any context), no convolution.
    * ``"softmax + conv"``: the same with a 4-tap causal convolution on q, k, v, the one
      the linear mixers carry (chapter 5; built into the layers of chapter 12), so that the
      two softmax rows separate what the convolution does from what attention does.
    * ``"linear"``, ``"DeltaNet"``: ELU+1 linear attention (chapter 3) and the delta rule
      (chapter 5), each with the 4-tap convolution.
    * ``"Gated DeltaNet"``, ``"KDA"``: the layers of chapters 10 and 12 (their convolution is
      built in), chunks of ``chunk_size``.
    * ``"MLA"``: multi-head latent attention as DeepSeek builds it (chapter 13), a latent of
      ``d_model // 2`` and a shared RoPE key of half a head, no convolution.
    * ``"KDA + MLA"``: the hybrid of chapter 15, KDA layers and an MLA layer last (with two
      layers, one of each), the MLA layer without RoPE as in Kimi Linear (the KDA layer
      below it supplies the order).
    * ``"tiny K3"``: chapter 17's changes on the hybrid: KDA with the lower-bound gate and a
      full-rank output gate, MLA with its sigmoid output gate, attention residuals with a block
      per layer, a dense SiTU-GLU first layer and then a latent mixture of experts (8 experts of
      which 2 per token, one shared, a latent of ``d_model // 2``).
    """
    if name not in CHAPTERS:
        raise ValueError(f"unknown mechanism {name!r}: choose one of {list(MECHANISMS)}")
    for arg, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_head", n_head),
                       ("n_layer", n_layer), ("chunk_size", chunk_size)):
        positive_int(value, arg, "tiny_config")
    if d_model % (2 * n_head):
        raise ValueError(f"tiny_config: d_model={d_model} must be a multiple of 2·n_head "
                         f"= {2 * n_head} (heads of d_model // n_head channels, a latent of "
                         f"d_model // 2)")
    parts = _Parts(n_head, d_model // n_head, d_model, n_layer, chunk_size)
    fields = dict(mlp=SwiGLUConfig(2 * d_model), attn_res_block_size=0)
    fields.update(_MECHANISMS[name][1](parts))
    return LMConfig(vocab_size=vocab_size, block_size=block_size, n_embd=d_model, pos_emb=False,
                    norm="rmsnorm", tie_embeddings=False, **fields)


def cache_bytes_per_token(cfg: LMConfig, bytes_per_value: int = 2) -> int:
    """Bytes one more token of context adds to one sequence's decoding state, by the formulas
    of chapters 2 and 13: a softmax layer caches a key and a value of every head
    (``2 · n_embd`` values), an MLA layer its latent (``kv_lora_rank``) and its shared key
    channels (``qk_rope_head_dim``, rotated or not: Kimi's NoPE MLA keeps them unrotated); a
    recurrent layer adds nothing (its state has a fixed size). ``tests/test_compare.py`` holds
    it equal to the measured growth of every mechanism's cache."""
    if not isinstance(cfg, LMConfig):
        raise TypeError(f"cache_bytes_per_token: cfg must be an LMConfig, got "
                        f"{type(cfg).__name__}")
    positive_int(bytes_per_value, "bytes_per_value", "cache_bytes_per_token")
    values = 0
    for m in cfg.layer_mixers:
        if m.kind == "softmax":
            values += 2 * cfg.n_embd
        elif m.kind == "mla":
            values += m.kv_lora_rank + m.qk_rope_head_dim
    return values * bytes_per_value


def pareto_front(names, costs) -> list:
    """The names, in their given order, of the rows no other row dominates (chapter 18).

    ``costs[i]`` holds numbers for ``names[i]``, every one *lower is better* (negate a measure
    where higher is better). Row ``j`` dominates row ``i`` when it is at least as good on every
    cost and strictly better on one; two identical rows do not dominate each other."""
    rows = [tuple(float(x) for x in c) for c in costs]

    def dominates(a, b):
        return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))

    return [n for n, c in zip(names, rows) if not any(dominates(o, c) for o in rows)]


def prefill(model: LM, length: int, *, batch_size: int = 1, piece: int = 1024,
            seed: int = 0) -> LMCache:
    """A cache that has seen ``length`` random tokens, fed in pieces of at most ``piece``
    tokens (so that softmax attention's scores stay ``piece × length``), without gradients."""
    if not isinstance(model, LM):
        raise TypeError(f"prefill: model must be a tinyk3.models.LM, got {type(model).__name__}")
    for arg, value in (("length", length), ("batch_size", batch_size), ("piece", piece)):
        positive_int(value, arg, "prefill")
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    idx = torch.randint(0, model.config.vocab_size, (batch_size, length), generator=g)
    cache = model.new_cache()
    with torch.no_grad():
        for start in range(0, length, piece):
            model(idx[:, start:start + piece].to(device), cache=cache)
    return cache


@dataclass(frozen=True)
class CacheGrowth:
    """A decoding state's bytes as ``fixed + per_token · length`` (one sequence), from two
    measured lengths; ``at(length)`` extrapolates."""

    fixed: float
    per_token: float
    lengths: tuple
    measured: tuple

    def at(self, length: int) -> float:
        return self.fixed + self.per_token * length


def cache_growth(model: LM, lengths: tuple = (256, 512), **prefill_kw) -> CacheGrowth:
    """Measure ``cache.nbytes()`` after ``lengths[0]`` and ``lengths[1]`` tokens and split it
    into the bytes that do not depend on the length (states, convolution windows) and the
    bytes each further token adds (keys and values, latents)."""
    a, b = lengths
    if not (isinstance(a, int) and isinstance(b, int) and 0 < a < b):
        raise ValueError(f"cache_growth: lengths must be two ints 0 < a < b, got {lengths!r}")
    na, nb = (prefill(model, n, **prefill_kw).nbytes() for n in (a, b))
    batch = prefill_kw.get("batch_size", 1)
    per_token = (nb - na) / (b - a) / batch
    return CacheGrowth(fixed=na / batch - per_token * a, per_token=per_token, lengths=(a, b),
                       measured=(na, nb))


def decode_step_seconds(model: LM, cache: LMCache, *, repeats: int = 5, warmup: int = 1,
                        min_seconds: float = 0.0, max_seconds: float | None = None) -> Timing:
    """The time of one decoded token (a forward pass of one token through ``cache``), each run
    from the same context: the cache is put back after every run (the model replaces a
    layer's state and never modifies it, so the old state can be resumed from). ``repeats``,
    ``warmup``, ``min_seconds`` and ``max_seconds`` as in :func:`tinyk3.timing.time_fn`."""
    if not isinstance(cache, LMCache) or not cache.length:
        raise ValueError("decode_step_seconds: cache must be an LMCache that has seen tokens "
                         "(use prefill(model, length))")
    layers, length = list(cache.layers), cache.length
    device = next(model.parameters()).device
    token = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=device)

    def step():
        cache.layers, cache.length = list(layers), length
        with torch.no_grad():
            model(token, cache=cache)

    try:
        return time_fn(step, repeats=repeats, warmup=warmup, min_seconds=min_seconds,
                       max_seconds=max_seconds)
    finally:
        cache.layers, cache.length = layers, length


def absorb_mla(model: torch.nn.Module, absorb: bool = True) -> int:
    """Switch every MLA layer of ``model`` to the absorbed path (chapter 13: scores against the
    latent cache itself, the way MLA decodes) or back; returns how many layers it switched."""
    from .layers.mla import MultiHeadLatentAttention

    n = 0
    for m in model.modules():
        if isinstance(m, MultiHeadLatentAttention):
            m.form, n = ("absorbed" if absorb else "expanded"), n + 1
    return n


def decode_times(model: LM, lengths, *, rounds: int = 6, repeats: int = 3, warmup: int = 3,
                 min_seconds: float = 0.05) -> dict:
    """The time of one decoded token at each context length of ``lengths``: one cache per
    length (:func:`prefill`), then ``rounds`` rounds that time every length in turn (in
    alternating order), each for at least ``repeats`` runs and ``min_seconds``, so that a
    drift of the machine's speed during the measurement falls on every length alike. Returns
    ``{length: Timing}`` over all the runs of that length."""
    lengths = tuple(lengths)
    if not lengths:
        raise ValueError("decode_times: give at least one context length")
    positive_int(rounds, "rounds", "decode_times")
    caches = {T: prefill(model, T) for T in lengths}
    runs: dict = {T: [] for T in lengths}
    for r in range(rounds):
        for T in (lengths if r % 2 == 0 else lengths[::-1]):
            t = decode_step_seconds(model, caches[T], repeats=repeats,
                                    warmup=warmup if r == 0 else 1, min_seconds=min_seconds)
            runs[T].extend(t.runs)
    return {T: Timing(runs[T]) for T in lengths}

"""One small language model, many token mixers (chapters 3-5 and later).

:class:`MixerLM` is GPT-2 (:mod:`tinyk3.gpt2`) with its attention replaced by a mixer chosen
by configuration (:data:`tinyk3.layers.MIXERS`): ``"softmax"`` (GPT-2's own attention),
``"linear"`` (linear attention) or ``"deltanet"`` (the delta rule). Everything else is held
fixed: pre-LN blocks, a GELU MLP, learned positions (optional), a tied head and GPT-2's
initialisation. So when chapters compare mechanisms on the same data, only the mixer differs.

Its API mirrors :class:`tinyk3.gpt2.GPT`, so :func:`tinyk3.generate.generate` runs it
unchanged: ``model(idx, cache=None) -> logits [B, T, V]``, and ``model.new_cache()`` gives a
:class:`MixerCache` that the forward pass updates in place. For softmax attention the cache
holds every past key and value and grows with the sequence; for the others it holds a
fixed-size state per layer (compare ``cache.nbytes()`` as the sequence grows).

With ``mixer="softmax"`` and ``mlp_ratio=4`` the parameter names and maths are exactly GPT-2's,
so a :class:`~tinyk3.gpt2.GPT` state dict loads into a :class:`MixerLM` and gives the same
logits (``tests/test_models.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt2 import init_gpt2_weights
from .layers import MIXERS, state_nbytes
from .ops import feature_maps

__all__ = ["MixerConfig", "MixerLM", "MixerCache", "count_parameters"]


@dataclass
class MixerConfig:
    """Hyper-parameters of a :class:`MixerLM`. No defaults for the sizes: the course uses it
    at tiny, chapter-specific sizes (e.g. MQAR in chapter 5: 2 layers, 2 heads, ``n_embd`` 64).

    The block layout and the MLP width (``mlp_ratio = 4``) are GPT-2's (see
    :class:`tinyk3.gpt2.GPTConfig` for their source).

    * ``mixer``: ``"softmax" | "linear" | "deltanet"`` (:data:`tinyk3.layers.MIXERS`).
    * ``feature_map``, ``normalize``: φ and the ``φ(q)·z`` denominator, used by
      ``mixer="linear"`` only (Katharopoulos et al., 2020: ELU+1, normalised).
    * ``conv_size``: a short causal convolution on q, k, v before every mixer (0: none; the
      DeltaNet and Kimi layers use 4). Small models need it to learn MQAR (chapter 5).
    * ``pos_emb``: learned absolute positions as in GPT-2. Without them (NoPE) the model can
      run past ``block_size``; order then comes from causality alone (as in Kimi Linear).
    """

    vocab_size: int
    block_size: int  # positions learned (with pos_emb); generate() also reads it
    n_layer: int
    n_head: int
    n_embd: int
    mixer: str = "softmax"
    feature_map: str = "elu+1"
    normalize: bool = True
    mlp_ratio: int = 4
    conv_size: int = 0
    pos_emb: bool = True
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MixerConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.mixer not in MIXERS:
            raise ValueError(f"unknown mixer {self.mixer!r}; choose one of {sorted(MIXERS)}")
        if self.feature_map not in feature_maps.FEATURE_MAPS:
            raise ValueError(
                f"unknown feature_map {self.feature_map!r}; choose one of {sorted(feature_maps.FEATURE_MAPS)}"
            )
        if isinstance(self.conv_size, bool) or not isinstance(self.conv_size, int) or self.conv_size < 0:
            raise ValueError(f"MixerConfig.conv_size must be an int >= 0, got {self.conv_size!r}")
        if not isinstance(self.pos_emb, bool) or not isinstance(self.normalize, bool):
            raise TypeError("MixerConfig.pos_emb and MixerConfig.normalize must be bools")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class MixerCache:
    """The decoding state of a :class:`MixerLM`: one mixer state per layer, and the length.

    For softmax attention a layer's state is its KV cache ``(k, v)`` (grows with ``length``);
    for linear attention and DeltaNet it is a fixed-size matrix. The model replaces each
    layer's state after a successful forward pass (the state tensors themselves are never
    modified, so an old state can be kept and resumed from).
    """

    def __init__(self, n_layer: int, mixer: str):
        if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
            raise ValueError(f"n_layer must be a positive int, got {n_layer!r}")
        self.mixer = mixer
        self.states: list = [None] * n_layer
        self.length = 0  # tokens seen so far
        self.batch_size: int | None = None

    @property
    def n_layer(self) -> int:
        return len(self.states)

    def nbytes(self) -> int:
        """Bytes held by all layers' states (measured from the tensors)."""
        return sum(state_nbytes(s) for s in self.states)

    def __repr__(self) -> str:
        return (
            f"MixerCache(mixer={self.mixer!r}, n_layer={self.n_layer}, length={self.length}, "
            f"nbytes={self.nbytes():,})"
        )


class MLP(nn.Module):
    """GPT-2's feed-forward: ``c_proj(GELU(c_fc(x)))`` with tanh-approximated GELU."""

    def __init__(self, config: MixerConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden)
        self.c_proj = nn.Linear(hidden, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN block: ``x + mixer(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    The mixer is called ``attn`` whatever it is (GPT-2's name, and fla's for its linear layers).
    """

    def __init__(self, config: MixerConfig):
        super().__init__()
        C = config.n_embd
        self.ln_1 = nn.LayerNorm(C, eps=config.layer_norm_eps)
        if config.mixer == "linear":
            self.attn = MIXERS["linear"](C, config.n_head, config.feature_map, config.normalize,
                                         conv_size=config.conv_size)
        else:
            self.attn = MIXERS[config.mixer](C, config.n_head, conv_size=config.conv_size)
        self.ln_2 = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, state=None):
        y, new_state = self.attn(self.ln_1(x), state)
        x = x + self.drop(y)
        x = x + self.drop(self.mlp(self.ln_2(x)))
        return x, new_state


class MixerLM(nn.Module):
    """A GPT-2-shaped language model with a configurable token mixer.

    ``forward(idx [B, T], cache=None) -> logits [B, T, vocab_size]``. With ``cache=`` a
    :class:`MixerCache` from :meth:`new_cache`, the tokens in ``idx`` continue the
    ``cache.length`` tokens already seen: positions start there, each layer continues from
    its state, and the cache then holds the new states and length.
    """

    def __init__(self, config: MixerConfig):
        super().__init__()
        if not isinstance(config, MixerConfig):
            raise TypeError(f"config must be a MixerConfig, got {type(config).__name__}")
        self.config = config
        modules = dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embeddings
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps),
        )
        if config.pos_emb:
            modules["wpe"] = nn.Embedding(config.block_size, config.n_embd)  # learned positions
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one matrix, two uses
        init_gpt2_weights(self, config.n_layer)  # GPT-2's recipe, residual projections scaled

    def num_parameters(self) -> int:
        """Parameters counted once (the tied head shares the embedding's storage)."""
        return sum(p.numel() for p in self.parameters())

    def new_cache(self) -> MixerCache:
        """An empty decoding state for this model."""
        return MixerCache(self.config.n_layer, self.config.mixer)

    def forward(self, idx: torch.Tensor, cache: MixerCache | None = None) -> torch.Tensor:
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.long, torch.int32):
            raise TypeError("idx must be an integer tensor of token ids with shape [B, T]")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape [B, T], got {tuple(idx.shape)}")
        B, T = idx.shape
        if T == 0:
            raise ValueError("idx has no tokens (T = 0)")
        if cache is not None:
            if not isinstance(cache, MixerCache):
                raise TypeError(
                    f"cache must be a MixerCache from model.new_cache(), got {type(cache).__name__}"
                )
            if cache.n_layer != self.config.n_layer or cache.mixer != self.config.mixer:
                raise ValueError(
                    f"cache is for {cache.n_layer} {cache.mixer!r} layers, the model has "
                    f"{self.config.n_layer} {self.config.mixer!r} layers: make it with model.new_cache()"
                )
            if cache.length and cache.batch_size != B:
                raise ValueError(f"cache holds batch size {cache.batch_size}, idx has {B}")
        start = 0 if cache is None else cache.length
        if self.config.pos_emb and start + T > self.config.block_size:
            raise ValueError(
                f"sequence of {start + T} tokens ({start} cached + {T} new) is longer than "
                f"block_size={self.config.block_size}: there is no position embedding past it"
            )
        vocab = self.config.vocab_size
        if idx.min() < 0 or idx.max() >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}), got [{idx.min()}, {idx.max()}]")

        x = self.transformer.wte(idx)  # [B, T, C]
        if self.config.pos_emb:
            pos = torch.arange(start, start + T, device=idx.device)  # [T]
            x = x + self.transformer.wpe(pos)  # [B, T, C]
        x = self.transformer.drop(x)
        new_states = []
        for i, block in enumerate(self.transformer.h):
            x, state = block(x, None if cache is None else cache.states[i])
            new_states.append(state)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # [B, T, vocab_size]
        if cache is not None:  # commit only after every layer succeeded
            cache.states = new_states
            cache.length, cache.batch_size = start + T, B
        return logits


def count_parameters(config: MixerConfig) -> int:
    """Parameters of a :class:`MixerLM` by formula (tied head); checked against the model.

    Per block: two LayerNorms ``4C``; the mixer's q, k, v and output projections
    ``4C² + 4C`` (DeltaNet adds ``W_β``: ``C·H + H``); the MLP with ``r = mlp_ratio``,
    ``2rC² + rC + C``; a short convolution of ``K = conv_size`` taps, ``3C·K + 3C``. Plus the
    token embedding ``V·C``, positions ``P·C`` (if learned), and
    the final LayerNorm ``2C``. With ``mixer="softmax"``, ``r = 4`` this is GPT-2's
    ``12C² + 13C`` per block (:func:`tinyk3.gpt2.count_parameters`). The feature maps
    have no parameters.
    """
    V, P, L, C, H, r = (config.vocab_size, config.block_size, config.n_layer, config.n_embd,
                        config.n_head, config.mlp_ratio)
    mixer = 4 * C * C + 4 * C + (C * H + H if config.mixer == "deltanet" else 0)
    mixer += 3 * C * config.conv_size + 3 * C if config.conv_size else 0
    mlp = 2 * r * C * C + r * C + C
    block = 4 * C + mixer + mlp
    return V * C + (P * C if config.pos_emb else 0) + L * block + 2 * C

"""The language model of the course: GPT-2's stack with a configurable mixer per layer."""

from __future__ import annotations

import torch
import torch.nn as nn

from .._validate import check_tokens
from ..gpt2 import init_gpt2_weights
from ..layers import RMSNorm, state_nbytes
from ..layers.attn_res import DepthMix  # noqa: F401 (also importable from here, as chapter 17 does)
from .config import LMConfig

__all__ = ["LM", "LMCache", "Block"]


class LMCache:
    """The decoding state of an :class:`LM`: one state per layer, and the length.

    ``cache.layers[i]`` is layer ``i``'s state (``None`` before the first token): for softmax
    attention its KV cache :class:`~tinyk3.layers.KVState` (grows with ``length``); for linear
    attention and DeltaNet a fixed-size matrix (:class:`~tinyk3.layers.LinearState`,
    :class:`~tinyk3.layers.DeltaState`), each with its short convolution's state. The model
    replaces each layer's state after a successful forward pass (the state tensors themselves
    are never modified, so an old state can be kept and resumed from).
    """

    def __init__(self, kinds):
        kinds = tuple(kinds)
        if not kinds or not all(isinstance(k, str) for k in kinds):
            raise ValueError(f"LMCache: kinds must be one mixer kind per layer, got {kinds!r}")
        self.kinds = kinds
        self.layers: list = [None] * len(kinds)
        self.length = 0  # tokens seen so far
        self.batch_size: int | None = None

    @property
    def states(self) -> list:
        """The per-layer states (the old name of :attr:`layers`)."""
        return self.layers

    @states.setter
    def states(self, value) -> None:
        self.layers = list(value)

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        """Bytes held by all layers' states (measured from the tensors)."""
        return sum(state_nbytes(s) for s in self.layers)

    def __repr__(self) -> str:
        kinds = sorted(set(self.kinds))
        return (f"LMCache(kinds={'/'.join(kinds)}, n_layer={self.n_layer}, length={self.length}, "
                f"nbytes={self.nbytes():,})")


def make_norm(config: LMConfig) -> nn.Module:
    """The block and final norm that ``config.norm`` names, ``n_embd`` wide."""
    d, eps = config.n_embd, config.layer_norm_eps
    if config.norm == "layernorm":
        return nn.LayerNorm(d, eps=eps)
    return RMSNorm(d, eps, centred=config.norm == "rmsnorm_centred")


class Block(nn.Module):
    """Pre-norm block: ``x + mixer(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    The mixer is called ``attn`` whatever it is (GPT-2's name, and fla's for its linear layers);
    the norms are LayerNorms or RMSNorms as ``config.norm`` says; the MLP is GPT-2's, a SwiGLU
    or a mixture of experts, per layer, or none (:class:`~tinyk3.layers.NoMLPConfig`: a
    mixer-only block, without ``ln_2``).
    """

    def __init__(self, config: LMConfig, layer: int):
        super().__init__()
        d = config.n_embd
        self.ln_1 = make_norm(config)
        self.attn = config.layer_mixers[layer].build(d)
        mlp = config.layer_mlps[layer]
        if mlp.kind != "none":  # registered before the MLP: the parameters' order is kept
            self.ln_2 = make_norm(config)
        self.mlp = mlp.build(d)  # None: a mixer-only block
        self.attn_res = config.attn_res_block_size > 0
        if self.attn_res:  # Kimi K3: the residual stream read through a softmax over depth
            self.block_start = layer % config.attn_res_block_size == 0
            self.self_attention_res = DepthMix(d, config.layer_norm_eps)
            if self.mlp is not None:
                self.mlp_res = DepthMix(d, config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, state=None, blocks: list | None = None):
        """``x`` and the layer's state → ``(x, new_state)``. With attention residuals ``x`` is the
        current block's partial sum, and ``blocks`` (the completed block sums, the embedding
        first) is extended in place when this layer starts a new block."""
        if not self.attn_res:
            y, new_state = self.attn(self.ln_1(x), state)
            x = x + self.drop(y)
            if self.mlp is not None:
                x = x + self.drop(self.mlp(self.ln_2(x)))
            return x, new_state
        h = self.self_attention_res(blocks, x)
        partial = x
        if self.block_start:  # the sum so far becomes a completed block; a new one begins
            blocks.append(x)
            partial = None
        y, new_state = self.attn(self.ln_1(h), state)
        y = self.drop(y)
        partial = y if partial is None else partial + y
        if self.mlp is None:
            return partial, new_state
        h = self.mlp_res(blocks, partial)
        return partial + self.drop(self.mlp(self.ln_2(h))), new_state


class LM(nn.Module):
    """A GPT-2-shaped language model with a configurable token mixer per layer.

    ``forward(idx [B, T], cache=None) -> logits [B, T, vocab_size]``. With ``cache=`` an
    :class:`LMCache` from :meth:`new_cache`, the tokens in ``idx`` continue the
    ``cache.length`` tokens already seen: positions start there, each layer continues from
    its state, and the cache then holds the new states and length. ``model.config`` is the
    :class:`LMConfig` it was built from. By default everything but the mixers is GPT-2's:
    pre-LN blocks, the MLP, learned positions (optional), a tied head and GPT-2's
    initialisation, so when chapters compare mechanisms on the same data, only the mixer
    differs. The configuration also builds the models of Parts IV-V: RMSNorm, SwiGLU or
    mixture-of-experts feed-forwards per layer, no learned positions (RoPE lives in the
    mixers, which read their position from their state), an untied head.
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        if not isinstance(config, LMConfig):
            raise TypeError(f"config must be an LMConfig (e.g. from MixerConfig(...)), "
                            f"got {type(config).__name__}")
        self.config = config
        modules = dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embeddings
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=make_norm(config),
        )
        if config.pos_emb:
            modules["wpe"] = nn.Embedding(config.block_size, config.n_embd)  # learned positions
        if config.attn_res_block_size:
            modules["output_attn_res"] = DepthMix(config.n_embd, config.layer_norm_eps)
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # tied: one matrix, two uses
        init_gpt2_weights(self, config.n_layer)  # GPT-2's recipe, residual projections scaled
        for m in self.modules():  # attention residuals start as a uniform mix over depth
            if isinstance(m, DepthMix):
                nn.init.zeros_(m.proj.weight)

    def num_parameters(self) -> int:
        """Parameters counted once (the tied head shares the embedding's storage)."""
        return sum(p.numel() for p in self.parameters())

    def new_cache(self) -> LMCache:
        """An empty decoding state for this model."""
        return LMCache(self.config.kinds)

    def _check(self, idx, cache) -> tuple[int, int, int]:
        """``(B, T, start)`` of a call, or a clear error for bad token ids or a foreign cache."""
        if cache is not None:
            if not isinstance(cache, LMCache):
                raise TypeError(
                    f"cache must be an LMCache from model.new_cache(), got {type(cache).__name__}"
                )
            if cache.kinds != self.config.kinds:
                raise ValueError(
                    f"cache is for layers {list(cache.kinds)}, the model has layers "
                    f"{list(self.config.kinds)}: make it with model.new_cache()"
                )
        start = 0 if cache is None else cache.length
        B, T = check_tokens(idx, self.config.vocab_size, start=start,
                            block_size=self.config.block_size if self.config.pos_emb else None,
                            cache_batch=cache.batch_size if cache is not None and start else None)
        return B, T, start

    def forward(self, idx: torch.Tensor, cache: LMCache | None = None) -> torch.Tensor:
        B, T, start = self._check(idx, cache)
        x = self.transformer.wte(idx)  # [B, T, d]
        if self.config.pos_emb:
            pos = torch.arange(start, start + T, device=idx.device)  # [T]
            x = x + self.transformer.wpe(pos)  # [B, T, d]
        x = self.transformer.drop(x)
        new_states = []
        blocks = [] if self.config.attn_res_block_size else None  # completed block sums
        for i, block in enumerate(self.transformer.h):
            x, state = block(x, None if cache is None else cache.layers[i], blocks)
            new_states.append(state)
        if blocks is not None:
            x = self.transformer.output_attn_res(blocks, x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # [B, T, vocab_size]
        if cache is not None:  # commit only after every layer succeeded
            cache.layers = new_states
            cache.length, cache.batch_size = start + T, B
        return logits

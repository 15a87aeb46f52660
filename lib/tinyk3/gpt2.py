"""GPT-2: a decoder-only transformer with learned positions, pre-LN blocks and a tied head.

Chapter 1 builds it; chapter 2 adds the KV cache (:class:`tinyk3.kv_cache.KVCache`), which
:meth:`GPT.forward` accepts so that decoding can reuse the keys and values of earlier tokens.

Layout: activations are ``[B, T, d]`` (``d = n_embd``); inside attention, ``[B, H, T, D]``
with ``D = d / H``, as everywhere in the course.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._validate import check_tokens, is_int
from .kv_cache import KVCache
from .layers import SoftmaxAttention
from .ops.attention import causal_attention_sdpa, causal_mask

__all__ = ["GPTConfig", "GPT", "count_parameters", "attention_maps", "init_gpt2_weights"]


@dataclass
class GPTConfig:
    """Hyper-parameters of a GPT-2 model. The defaults are GPT-2 small (124M).

    Source: OpenAI's released GPT-2 ``hparams.json`` for the 124M model (``n_vocab`` 50,257,
    ``n_ctx`` 1,024, ``n_embd`` 768, ``n_head`` 12, ``n_layer`` 12), also the defaults of
    ``transformers.GPT2Config``. With the output head tied to the token embedding this is
    exactly 124,439,808 parameters (:func:`count_parameters`; ``tests/test_gpt2.py`` checks it
    against the built model and against ``transformers.GPT2LMHeadModel``).
    nanoGPT pads the vocabulary to 50,304 for speed; we keep the true 50,257.
    """

    vocab_size: int = 50257
    block_size: int = 1024  # longest sequence: the number of learned positions
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        B, T, d = x.shape
        H, D = self.n_head, d // self.n_head
        q, k, v = self.c_attn(x).split(d, dim=2)  # 3 × [B, T, d]
        q = q.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        v = v.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        if cache is not None:
            # keys and values of every token so far, new ones appended: [B, H, T_past + T, D]
            k, v = cache.append(layer, k, v)
        y = causal_attention_sdpa(q, k, v)  # [B, H, T, D], bottom-right causal mask
        y = y.transpose(1, 2).contiguous().view(B, T, d)  # [B, T, d]
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 uses the tanh approximation of GELU ("gelu_new" in transformers).
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0):
        x = x + self.attn(self.ln_1(x), cache=cache, layer=layer)
        x = x + self.mlp(self.ln_2(x))
        return x


RESIDUAL_PROJECTIONS = ("c_proj.weight", "o_proj.weight")


def init_gpt2_weights(model: nn.Module, n_layer: int,
                      residual: tuple[str, ...] = RESIDUAL_PROJECTIONS) -> None:
    """GPT-2's initialisation, in place: every Linear and Embedding weight N(0, 0.02²), biases 0,
    and the projections that write into the residual stream (parameter names ending in one of
    ``residual``: GPT-2's ``c_proj``, the mixers' ``o_proj``) scaled down by ``1/√(2·n_layer)``,
    so the stream's variance does not grow with depth (:class:`tinyk3.models.LM` uses it too).
    Radford et al. (2019), section 2.3."""

    def init_module(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    model.apply(init_module)
    for name, p in model.named_parameters():
        if name.endswith(residual):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


class GPT(nn.Module):
    """GPT-2. ``forward(idx) -> logits [B, T, vocab_size]``.

    With ``cache=`` a :class:`~tinyk3.kv_cache.KVCache`, the tokens in ``idx`` are taken to
    follow the ``cache.length`` tokens already in the cache: their positions start there, their
    keys and values are appended to the cache, and they attend to everything before them.
    """

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        self.config = config = config if config is not None else GPTConfig()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embeddings
                wpe=nn.Embedding(config.block_size, config.n_embd),  # learned positions
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one matrix, two uses
        init_gpt2_weights(self, config.n_layer)

    def num_parameters(self) -> int:
        """Parameters counted once (the tied head shares the embedding's storage)."""
        return sum(p.numel() for p in self.parameters())

    def new_cache(self) -> KVCache:
        """An empty KV cache sized for this model."""
        return KVCache(self.config.n_layer)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None and cache.n_layer != self.config.n_layer:
            raise ValueError(
                f"cache has {cache.n_layer} layers, the model {self.config.n_layer}: "
                "make it with model.new_cache()"
            )
        start = 0 if cache is None else cache.length
        B, T = check_tokens(idx, self.config.vocab_size, start=start,
                            block_size=self.config.block_size,
                            cache_batch=cache.batch_size if cache is not None and start else None)
        pos = torch.arange(start, start + T, device=idx.device)  # [T]
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # [B, T, d]
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache=cache, layer=i)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # [B, T, vocab_size]

    # -- loading transformers' GPT-2 -------------------------------------------------------
    @classmethod
    def from_hf(
        cls, model_or_state_dict, config: GPTConfig | None = None
    ) -> GPT:
        """Build a :class:`GPT` from a ``transformers`` GPT-2 model or its state dict.

        ``transformers`` stores the four projections as ``Conv1D`` with weights ``[in, out]``;
        ``nn.Linear`` wants ``[out, in]``, so those are transposed. With a state dict the config
        is read off the tensor shapes, except ``n_head``, which the weights do not encode: pass
        ``config`` or accept the GPT-2 family's head size of 64 (``n_head = n_embd // 64``).
        """
        hf_config = getattr(model_or_state_dict, "config", None)
        if hasattr(model_or_state_dict, "state_dict"):
            sd = model_or_state_dict.state_dict()
        elif isinstance(model_or_state_dict, Mapping):
            sd = dict(model_or_state_dict)
        else:
            raise TypeError("expected a transformers GPT2LMHeadModel/GPT2Model or a state dict")
        # Accept both GPT2LMHeadModel ("transformer.wte...") and GPT2Model ("wte...") keys.
        if not any(key.startswith("transformer.") for key in sd):
            sd = {f"transformer.{key}": val for key, val in sd.items()}
        if "transformer.wte.weight" not in sd:
            raise KeyError("no 'wte.weight' in the state dict: is this a GPT-2 checkpoint?")
        if config is None:
            vocab_size, n_embd = sd["transformer.wte.weight"].shape
            block_size = sd["transformer.wpe.weight"].shape[0]
            n_layer = 1 + max(
                int(key.split(".")[2]) for key in sd if key.startswith("transformer.h.")
            )
            if hf_config is not None:
                n_head = hf_config.n_head
                eps = hf_config.layer_norm_epsilon
            elif n_embd % 64 == 0:
                n_head, eps = n_embd // 64, 1e-5
            else:
                raise ValueError(
                    f"n_embd={n_embd} is not a multiple of GPT-2's head size 64: the number of "
                    "heads cannot be guessed from a state dict; pass config=GPTConfig(...)"
                )
            config = GPTConfig(
                vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
                n_head=n_head, n_embd=n_embd, layer_norm_eps=eps,
            )
        model = cls(config)
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        ours = model.state_dict()
        theirs = {
            key: val
            for key, val in sd.items()
            if not key.endswith((".attn.bias", ".attn.masked_bias"))  # causal-mask buffers
        }
        theirs.setdefault("lm_head.weight", theirs["transformer.wte.weight"])
        missing = sorted(set(ours) - set(theirs))
        unexpected = sorted(set(theirs) - set(ours))
        if missing or unexpected:
            raise KeyError(f"state dict does not match: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for key, val in theirs.items():
                val = val.t() if key.endswith(conv1d) else val
                if ours[key].shape != val.shape:
                    raise ValueError(f"{key}: expected {tuple(ours[key].shape)}, got {tuple(val.shape)}")
                ours[key].copy_(val)
        return model

    @classmethod
    def from_pretrained(cls, name: str = "gpt2") -> GPT:  # pragma: no cover - needs network
        """Download OpenAI's weights with ``transformers`` (Colab only; never in CI)."""
        from transformers import GPT2LMHeadModel

        return cls.from_hf(GPT2LMHeadModel.from_pretrained(name))


def count_parameters(config: GPTConfig) -> int:
    """Parameters of a GPT-2 by formula (tied head): checked against the model in the tests.

    Per block: two LayerNorms (``2·2d``), attention (``d·3d + 3d`` and ``d·d + d``) and the MLP
    (``d·4d + 4d`` and ``4d·d + d``), i.e. ``12d² + 13d``. Plus the embeddings ``(V + P)·d`` and
    the final LayerNorm ``2d``; the head reuses the token embedding.
    """
    V, P, L, d = config.vocab_size, config.block_size, config.n_layer, config.n_embd
    return (V + P) * d + L * (12 * d * d + 13 * d) + 2 * d


@torch.no_grad()
def attention_maps(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Softmax attention weights of every layer and head: ``[n_layer, B, H, T, T]``.

    The model itself runs fused attention and never forms these matrices; this captures each
    block's attention input with a hook and recomputes ``softmax(q kᵀ/√D + mask)`` from it.
    ``model`` is a :class:`GPT`, or a :class:`tinyk3.models.LM` whose layers are all softmax
    attention without a short convolution (GPT-2 loaded with :func:`tinyk3.models.from_hf`).
    """
    for block in model.transformer.h:
        attn = block.attn
        if not isinstance(attn, CausalSelfAttention) and (
                not isinstance(attn, SoftmaxAttention) or attn.conv_size):
            raise TypeError(f"attention_maps: every layer must be softmax attention without a "
                            f"short convolution, got {attn!r}")
    inputs: list[torch.Tensor] = []
    hooks = [
        block.attn.register_forward_pre_hook(lambda mod, args, kwargs: inputs.append(args[0]),
                                             with_kwargs=True)
        for block in model.transformer.h
    ]
    try:
        model(idx)
    finally:
        for h in hooks:
            h.remove()
    maps = []
    for block, x in zip(model.transformer.h, inputs):
        B, T, d = x.shape
        H = block.attn.n_head
        if isinstance(block.attn, CausalSelfAttention):  # GPT: q, k, v in one projection
            q, k, _ = block.attn.c_attn(x).split(d, dim=2)
        else:  # an LM's SoftmaxAttention: separate projections
            q, k, _ = block.attn.project(x)
        q = q.view(B, T, H, d // H).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, H, d // H).transpose(1, 2)  # [B, H, T, D]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // H)  # [B, H, T, T]
        maps.append(scores.masked_fill(~causal_mask(T, T, device=x.device), float("-inf"))
                    .softmax(dim=-1))
    return torch.stack(maps)  # [L, B, H, T, T]

"""The configuration of a language model: sizes, and one mixer (and MLP) per layer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .._validate import positive_int
from ..layers import (
    GeluMLPConfig,
    LinearAttentionConfig,
    MixerSpec,
    MLPSpec,
    mixer_config,
)

__all__ = ["LMConfig", "mixer_config_flat", "MixerConfig", "NORMS"]

NORMS = ("layernorm", "rmsnorm", "rmsnorm_centred")


@dataclass
class LMConfig:
    """Hyper-parameters of a :class:`~tinyk3.models.LM`: a GPT-2-shaped stack of pre-LN blocks
    whose token mixer is chosen per layer.

    * ``pattern``: one key per layer, a string (``"KKKA"``: one character per layer) or a
      sequence (``["delta", "delta", "attn"]``), each key naming an entry of ``mixers``;
      or a sequence of mixer configurations themselves (then ``mixers`` stays empty). The
      number of layers is ``len(pattern)`` (nanochat's and Kimi Linear's way to write a
      hybrid, e.g. three KDA layers to one MLA layer).
    * ``mixers``: key → mixer configuration (:class:`~tinyk3.layers.SoftmaxAttentionConfig`,
      :class:`~tinyk3.layers.LinearAttentionConfig`, :class:`~tinyk3.layers.DeltaNetConfig`
      or any kind registered with :func:`~tinyk3.layers.register_mixer`).
    * ``mlp``: the MLP of every layer (default GPT-2's, ``GeluMLPConfig(ratio=4)``), or a
      sequence with one per layer.
    * ``pos_emb``: learned absolute positions as in GPT-2. Without them (NoPE) the model can
      run past ``block_size``; order then comes from causality alone (as in Kimi Linear).
    * ``block_size``: positions learned (with ``pos_emb``); :func:`tinyk3.generate.generate`
      also reads it. Without ``pos_emb`` it is the context the released model was trained for.
    * ``norm``: the block and final norms, ``"layernorm"`` (GPT-2), ``"rmsnorm"`` (DeepSeek-V3,
      Kimi: weight × x/rms) or ``"rmsnorm_centred"`` (Qwen3-Next: (1 + weight) × x/rms), with
      ``layer_norm_eps``.
    * ``tie_embeddings``: the head reuses the token embedding (GPT-2) or has its own matrix
      (every model of Parts IV-V).
    * ``attn_res_block_size``: 0, the plain residual stream; ``n > 0``, Kimi K3's block
      attention residuals with a new block every ``n`` layers (12 in K3;
      :class:`~tinyk3.models.lm.DepthMix`).

    No defaults for the sizes: the course uses it at tiny, chapter-specific sizes.
    :func:`~tinyk3.models.presets.gpt2_small` is GPT-2 small.
    """

    vocab_size: int
    block_size: int
    n_embd: int
    pattern: str | Sequence
    mixers: Mapping[str, MixerSpec] = field(default_factory=dict)
    mlp: MLPSpec | Sequence[MLPSpec] = field(default_factory=GeluMLPConfig)
    pos_emb: bool = True
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    norm: str = "layernorm"
    tie_embeddings: bool = True
    attn_res_block_size: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_embd"):
            positive_int(getattr(self, name), name, "LMConfig")
        if isinstance(self.pattern, str):
            self.pattern = tuple(self.pattern)
        elif isinstance(self.pattern, Sequence):
            self.pattern = tuple(self.pattern)
        else:
            raise TypeError(f"LMConfig.pattern must be a string or a sequence, got {self.pattern!r}")
        if not self.pattern:
            raise ValueError("LMConfig.pattern is empty: a model has at least one layer")
        self.mixers = dict(self.mixers)
        for key, spec in self.mixers.items():
            if not isinstance(spec, MixerSpec):
                raise TypeError(f"LMConfig.mixers[{key!r}] must be a mixer configuration, got {spec!r}")
        for i, item in enumerate(self.pattern):
            if isinstance(item, MixerSpec):
                continue
            if item not in self.mixers:
                raise ValueError(f"LMConfig.pattern[{i}] = {item!r} is not a key of mixers "
                                 f"({sorted(self.mixers)})")
        for spec in self.layer_mixers:
            spec.check(self.n_embd)
        if isinstance(self.mlp, MLPSpec):
            pass
        elif isinstance(self.mlp, Sequence) and not isinstance(self.mlp, str):
            self.mlp = tuple(self.mlp)
            if len(self.mlp) != self.n_layer or not all(isinstance(m, MLPSpec) for m in self.mlp):
                raise ValueError(f"LMConfig.mlp: one MLP configuration per layer ({self.n_layer}), "
                                 f"got {self.mlp!r}")
        else:
            raise TypeError(f"LMConfig.mlp must be an MLP configuration or one per layer, got {self.mlp!r}")
        for flag in ("pos_emb", "tie_embeddings"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"LMConfig.{flag} must be a bool, got {getattr(self, flag)!r}")
        if isinstance(self.attn_res_block_size, bool) or not isinstance(self.attn_res_block_size, int) \
                or self.attn_res_block_size < 0:
            raise ValueError(f"LMConfig.attn_res_block_size must be an int >= 0, got "
                             f"{self.attn_res_block_size!r}")
        if self.norm not in NORMS:
            raise ValueError(f"LMConfig.norm must be one of {NORMS}, got {self.norm!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def n_layer(self) -> int:
        return len(self.pattern)

    @property
    def layer_mixers(self) -> tuple[MixerSpec, ...]:
        """The mixer configuration of each layer."""
        return tuple(p if isinstance(p, MixerSpec) else self.mixers[p] for p in self.pattern)

    @property
    def layer_mlps(self) -> tuple[MLPSpec, ...]:
        """The MLP configuration of each layer."""
        return self.mlp if isinstance(self.mlp, tuple) else (self.mlp,) * self.n_layer

    @property
    def kinds(self) -> tuple[str, ...]:
        """The mixer kind of each layer, e.g. ``("deltanet", "deltanet", "softmax")``."""
        return tuple(spec.kind for spec in self.layer_mixers)

    @property
    def mixer(self) -> str | None:
        """The mixer kind if every layer has the same, else ``None`` (a hybrid)."""
        kinds = set(self.kinds)
        return kinds.pop() if len(kinds) == 1 else None


def mixer_config_flat(vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                      mixer: str = "softmax", feature_map: str = "elu+1", normalize: bool = True,
                      mlp_ratio: int = 4, conv_size: int = 0, pos_emb: bool = True,
                      dropout: float = 0.0, layer_norm_eps: float = 1e-5) -> LMConfig:
    """An :class:`LMConfig` with the same mixer in all ``n_layer`` layers, from the flat
    arguments of chapters 3-5 (``MixerConfig`` is this function, kept under its old name).

    ``mixer``: ``"softmax" | "linear" | "deltanet"`` (:data:`tinyk3.layers.MIXER_CONFIGS`);
    ``feature_map`` and ``normalize`` are used by ``mixer="linear"`` only; ``conv_size`` puts a
    short convolution on q, k, v in every layer; ``mlp_ratio``: GPT-2's MLP width, 4.
    """
    n_layer = positive_int(n_layer, "n_layer", "MixerConfig")
    if mixer == "linear":
        spec = LinearAttentionConfig(n_head=n_head, feature_map=feature_map, normalize=normalize,
                                     conv_size=conv_size)
    else:
        spec = mixer_config(mixer, n_head=n_head, conv_size=conv_size)
    return LMConfig(vocab_size=vocab_size, block_size=block_size, n_embd=n_embd,
                    pattern=(mixer,) * n_layer, mixers={mixer: spec},
                    mlp=GeluMLPConfig(ratio=mlp_ratio), pos_emb=pos_emb, dropout=dropout,
                    layer_norm_eps=layer_norm_eps)


MixerConfig = mixer_config_flat  # the name chapters 3-5 use

"""Token mixers and the other layers of a block (chapters 1-5; Parts IV-V add kinds).

Every mixer has one interface, so a model can swap them by configuration
(:mod:`tinyk3.models`) and a chapter can compare them on the same model and data:

    y, new_state = mixer(x, state=None)      x, y: [B, T, d]

``state`` is everything needed to continue the sequence: run a prompt (prefill) with
``state=None``, then feed the returned state back with one token (decode) or a block of
tokens, and the outputs equal those of one pass over the whole sequence. The state passed
in is never modified; a new one is returned. Each mixer's state is a ``NamedTuple``:

* :class:`SoftmaxAttention`: ``softmax(q kᵀ/√D + mask) v``; state :class:`KVState`
  ``(k, v, conv)``, the KV cache, each ``[B, H, T, D]``: it grows with every token (chapter 2).
* :class:`LinearAttention`: ``φ(q) S`` with ``S = Σ φ(k)ᵀ v`` (chapter 3); state
  :class:`LinearState` ``(S, z, conv)``, ``S: [B, H, Dk, Dv]``, ``z: [B, H, Dk]`` (``None``
  unless normalised): fixed size.
* :class:`DeltaNet`: the delta rule ``S_t = S_{t-1} + k_tᵀ β_t (v_t − k_t S_{t-1})``
  (chapter 5); state :class:`DeltaState` ``(S, conv)``: fixed size.
* :class:`KimiDeltaAttention`: Kimi Linear's KDA layer (per-channel forget gate, low-rank
  gates, gated output norm; Kimi K3's lower-bound gate and full-rank output gate by option,
  chapter 12); state :class:`KDAState` ``(S, conv)``: fixed size.
* :class:`GatedDeltaNet`: Qwen3-Next's Gated DeltaNet layer (grouped fused projections, one
  gate per head, SiLU-gated output norm, chapter 12); state :class:`GatedDeltaState`
  ``(S, conv)``: fixed size.
* :class:`MultiHeadLatentAttention`: DeepSeek-V3's MLA (a 512-wide latent and one shared
  64-wide RoPE key cached per token, weight absorption, NoPE and K3's output gate by option,
  chapter 13); state :class:`LatentState` ``(c, k_rope)``: grows with the sequence.
* :class:`GatedAttention`: Qwen3-Next's full-attention layer (grouped-query, RMS-normed q and
  k, partial RoPE, sigmoid output gate); state :class:`KVState`: grows.

Feed-forward kinds (:mod:`tinyk3.layers.moe`, chapter 14): GPT-2's :class:`MLP`, a dense
:class:`SwiGLU`, and :class:`MoE` (router with a selection-only bias, group-limited routing,
routed experts stacked as in ``transformers``, shared experts), configured by
:class:`GeluMLPConfig`, :class:`SwiGLUConfig`, :class:`MoEConfig`. :mod:`tinyk3.layers.rope`
has RoPE in both channel layouts and RMSNorm (plain and zero-centred).

Each mixer has separate ``q_proj``, ``k_proj``, ``v_proj`` and an ``o_proj``
(:class:`Mixer`), and can put a :class:`ShortConvolution` on each of q, k and v
(``conv_size > 0``: a depthwise causal filter over the last ``conv_size`` tokens, then SiLU,
as the DeltaNet and Kimi layers do; chapter 12 studies it). It lets a token see its
neighbours directly, which small models need to learn associative recall (chapter 5). Its
state, the last ``conv_size − 1`` projected tokens, is the ``conv`` field (:class:`ConvState`).
The layers of chapters 12-13 (:class:`KimiDeltaAttention`, :class:`GatedDeltaNet`,
:class:`MultiHeadLatentAttention`, :class:`GatedAttention`) keep the interface but are plain
``nn.Module`` subclasses: as in the published models, their projections have no biases and
their widths are set by their own head counts and dimensions, not by ``d_model / n_head``.

:func:`state_nbytes` measures any of these states in bytes, and each layer's
``state_numel(batch_size, length)`` gives the same size by formula.

Each mixer kind has a configuration (:class:`SoftmaxAttentionConfig`,
:class:`LinearAttentionConfig`, :class:`DeltaNetConfig`, :class:`KDAConfig`,
:class:`GatedDeltaNetConfig`) registered under its name in
:data:`MIXER_CONFIGS` (and its module in :data:`MIXERS`); new kinds are registered with
:func:`register_mixer`, MLP kinds with :func:`register_mlp` (:mod:`tinyk3.layers.registry`).
The mixing maths lives in pure functions (:mod:`tinyk3.ops`, attention included); these
modules add the projections and the per-head feature maps. Every mixer configuration has a
``form`` (:mod:`tinyk3.layers.forms`): which of its op module's forms a prompt runs through, or
``"triton"`` for the kernel, so a model configuration reaches every form. The parts several
layers share (RMSNorm, RoPE, the gated RMSNorm, l2 normalisation) are in
:mod:`tinyk3.layers.parts`; no mixer module imports another.
"""

from __future__ import annotations

# The module tinyk3.layers.rope (a re-export kept for the chapters) is loaded first, so that the
# name `rope` below stays the function and is not replaced by the module on a later import.
from . import rope as _rope_module  # noqa: F401
from .base import ConvState, KVState, Mixer, state_nbytes
from .conv import ShortConvolution
from .deltanet import DeltaNet, DeltaNetConfig, DeltaState
from .gated_attention import GatedAttention, GatedAttentionConfig
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, GatedDeltaState
from .kda import KDAConfig, KDAState, KimiDeltaAttention
from .linear import LinearAttention, LinearAttentionConfig, LinearState
from .mla import LatentState, MLAConfig, MultiHeadLatentAttention, attention_window
from .mlp import MLP, GeluMLPConfig, NoMLPConfig
from .moe import MoE, MoEConfig, SwiGLU, SwiGLUConfig
from .parts import GatedRMSNorm, RMSNorm, l2_normalize, rope
from .registry import (
    MIXER_CONFIGS,
    MIXERS,
    MLP_CONFIGS,
    MLPS,
    HeadsSpec,
    MixerSpec,
    MLPSpec,
    mixer_config,
    register_mixer,
    register_mlp,
)
from .softmax import SoftmaxAttention, SoftmaxAttentionConfig

__all__ = [
    "Mixer", "SoftmaxAttention", "LinearAttention", "DeltaNet", "ShortConvolution", "MLP",
    "SoftmaxAttentionConfig", "LinearAttentionConfig", "DeltaNetConfig", "GeluMLPConfig",
    "KVState", "LinearState", "DeltaState", "ConvState", "state_nbytes",
    "MixerSpec", "MLPSpec", "MIXERS", "MIXER_CONFIGS", "MLPS", "MLP_CONFIGS",
    "register_mixer", "register_mlp", "mixer_config",
    "KimiDeltaAttention", "KDAConfig", "KDAState",
    "GatedDeltaNet", "GatedDeltaNetConfig", "GatedDeltaState",
    "MultiHeadLatentAttention", "MLAConfig", "LatentState", "attention_window", "GatedAttention",
    "GatedAttentionConfig", "MoE", "MoEConfig", "SwiGLU", "SwiGLUConfig", "RMSNorm", "rope",
    "GatedRMSNorm", "l2_normalize", "HeadsSpec", "NoMLPConfig",
]

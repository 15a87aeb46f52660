"""Configurations of released models, each with its source. They build (at full size only on
the meta device, or not at all: DeepSeek-V3 has 671B parameters) and count
(:func:`~tinyk3.models.count_parameters`); the chapters read sizes from them, so that a number
in the book is computed from one place and a correction is one edit.

Sizes only: where a released model scales RoPE for long contexts (YaRN in DeepSeek-V3 and
Kimi K2), the preset carries the base ``rope_theta`` and no scaling, which changes no size.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers import GatedAttentionConfig, GatedDeltaNetConfig, KDAConfig, MLAConfig, MoEConfig, SwiGLUConfig
from .config import LMConfig
from .gpt2 import gpt2_config

__all__ = ["gpt2_small", "deepseek_v3", "kimi_k2", "kimi_linear_48b", "qwen3_next_80b",
           "kimi_k3", "kimi_k3_mixers", "MixerStack", "KIMI_K3_TEXT_CONFIG"]


def gpt2_small() -> LMConfig:
    """GPT-2 small (124M): 12 layers of softmax attention, 12 heads, width 768, 1,024
    positions, a vocabulary of 50,257, a tied head.

    Source: OpenAI's released ``hparams.json`` for the 124M model (``n_vocab`` 50,257,
    ``n_ctx`` 1,024, ``n_embd`` 768, ``n_head`` 12, ``n_layer`` 12), which are also the
    defaults of ``transformers.GPT2Config``. ``count_parameters(gpt2_small()).total`` is
    124,439,808, which ``tests/test_models.py`` sets against the built model and
    ``tests/test_gpt2.py`` against transformers' GPT-2.
    """
    return gpt2_config()


def _mla_moe(vocab: int, d: int, n_layer: int, n_dense: int, dense_hidden: int, mla: MLAConfig,
             moe: MoEConfig, context: int, eps: float = 1e-6) -> LMConfig:
    mlps = [SwiGLUConfig(dense_hidden) if i < n_dense else moe for i in range(n_layer)]
    return LMConfig(vocab_size=vocab, block_size=context, n_embd=d, pattern=(mla,) * n_layer,
                    mlp=tuple(mlps), pos_emb=False, norm="rmsnorm", layer_norm_eps=eps,
                    tie_embeddings=False)


def deepseek_v3() -> LMConfig:
    """DeepSeek-V3 (671B total, 37B active, as published): 61 layers of MLA (128 heads,
    ``q_lora_rank`` 1,536, ``kv_lora_rank`` 512, head dims 128 + 64 for keys and 128 for values),
    the first 3 with a dense SwiGLU of 18,432, the other 58 a mixture of 256 routed experts
    (8 per token, hidden 2,048, sigmoid router, 8 groups of which 4 are kept, weights × 2.5)
    and one shared expert; width 7,168; vocabulary 129,280; RMSNorm (eps 1e-6); untied head;
    context 163,840.

    Source: ``deepseek-ai/DeepSeek-V3``'s ``config.json`` on the Hugging Face hub and
    ``inference/configs/config_671B.json`` in its GitHub repository (DeepSeek-AI,
    arXiv 2412.19437). The multi-token-prediction module (``num_nextn_predict_layers`` 1) is
    not part of the 671B (the hub's 685B includes it: 14B, of which 11.5B are its own, the rest
    shared embedding and head, per ``README_WEIGHTS.md``) and is not built, as in
    ``transformers``.
    """
    mla = MLAConfig(n_head=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0)
    moe = MoEConfig(256, 8, 2048, n_shared=1, n_group=8, topk_group=4,
                    routed_scaling_factor=2.5)
    return _mla_moe(129280, 7168, 61, 3, 18432, mla, moe, context=163840)


def kimi_k2() -> LMConfig:
    """Kimi K2 (1T total, 32B active, as published, rounded): DeepSeek-V3's architecture with
    64 attention heads, 384 routed experts (8 per token, hidden 2,048, one group, weights ×
    2.827) and one shared expert, one dense first layer (18,432), 61 layers, width 7,168,
    vocabulary 163,840, ``rope_theta`` 50,000, context 131,072.

    Source: ``moonshotai/Kimi-K2-Instruct``'s ``config.json`` (``model_type`` ``deepseek_v3``)
    and the model card of ``MoonshotAI/Kimi-K2`` (Kimi Team, arXiv 2507.20534).
    """
    mla = MLAConfig(n_head=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, rope_theta=50000.0)
    moe = MoEConfig(384, 8, 2048, n_shared=1, routed_scaling_factor=2.827)
    return _mla_moe(163840, 7168, 61, 1, 18432, mla, moe, context=131072)


KIMI_LINEAR_MLA_LAYERS = (4, 8, 12, 16, 20, 24, 27)  # 1-based, as the released config lists them


def kimi_linear_48b() -> LMConfig:
    """Kimi Linear 48B-A3B: 27 layers, KDA in 20 and NoPE MLA in 7 (the released config's
    ``full_attn_layers`` 4, 8, 12, 16, 20, 24, 27, counted from 1: 0-based 3, 7, …, 23, 26);
    KDA 32 heads of 128, short convolution 4, softplus gate, low-rank output gate; MLA 32 heads,
    full-rank queries, ``kv_lora_rank`` 512, head dims 128 + 64 (the 64 shared key channels
    kept, never rotated) and 128; the first layer a dense SwiGLU of 9,216, the others 256
    routed experts (8 per token, hidden 1,024, sigmoid, weights × 2.446) and one shared;
    width 2,304; vocabulary 163,840; RMSNorm eps 1e-5; untied head; context 1,048,576.

    Source: ``moonshotai/Kimi-Linear-48B-A3B-Instruct``'s ``config.json`` and Kimi Team, *Kimi
    Linear*, arXiv 2510.26692. The defaults of ``transformers``' ``KimiLinearConfig`` reproduce
    the sizes, not the layer pattern: without the checkpoint's ``linear_attn_config`` they put
    full attention at 0-based 4, 8, …, 24 (six layers); read from the checkpoint's
    ``full_attn_layers`` it is the pattern here.
    """
    d, n = 2304, 27
    kda = KDAConfig(n_head=32, head_dim=128, conv_size=4, norm_eps=1e-5)
    mla = MLAConfig(n_head=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128, use_rope=False)
    full = {i - 1 for i in KIMI_LINEAR_MLA_LAYERS}
    moe = MoEConfig(256, 8, 1024, n_shared=1, routed_scaling_factor=2.446)
    mlps = [SwiGLUConfig(9216) if i == 0 else moe for i in range(n)]
    return LMConfig(vocab_size=163840, block_size=1048576, n_embd=d,
                    pattern=tuple(mla if i in full else kda for i in range(n)), mlp=tuple(mlps),
                    pos_emb=False, norm="rmsnorm", layer_norm_eps=1e-5, tie_embeddings=False)


def qwen3_next_80b() -> LMConfig:
    """Qwen3-Next-80B-A3B: 48 layers, three Gated DeltaNet layers (16 key heads and 32 value
    heads of 128, convolution 4) to one gated attention layer (16 query heads, 2 key/value heads
    of 256, RoPE on a quarter of each head); every layer 512 experts (10 per token, hidden 512,
    softmax router) and a gated shared expert (512); width 2,048; vocabulary 151,936;
    zero-centred RMSNorm (eps 1e-6); untied head; context 262,144.

    Source: ``Qwen/Qwen3-Next-80B-A3B-Instruct``'s ``config.json`` (the defaults of
    ``transformers``' ``Qwen3NextConfig`` are this checkpoint's) and the Qwen3-Next blog post
    (Qwen Team, 2025).
    """
    n = 48
    gdn = GatedDeltaNetConfig(n_head=16, head_dim=128, n_v_head=32, v_head_dim=128, conv_size=4,
                              norm_eps=1e-6)
    attn = GatedAttentionConfig(n_head=16, n_kv_head=2, head_dim=256, partial_rotary_factor=0.25,
                                rope_theta=10000000.0, norm_eps=1e-6)
    moe = MoEConfig(512, 10, 512, shared_hidden=512, scoring="softmax", shared_gate=True)
    return LMConfig(vocab_size=151936, block_size=262144, n_embd=2048,
                    pattern=tuple(attn if (i + 1) % 4 == 0 else gdn for i in range(n)),
                    mlp=(moe,) * n, pos_emb=False, norm="rmsnorm_centred", layer_norm_eps=1e-6,
                    tie_embeddings=False)


@dataclass(frozen=True)
class MixerStack:
    """The token mixers of a model, layer by layer, and its width: what a chapter needs to size
    caches and states when the whole model is not (yet) built."""

    n_embd: int
    layer_mixers: tuple
    block_size: int

    @property
    def n_layer(self) -> int:
        return len(self.layer_mixers)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(m.kind for m in self.layer_mixers)


KIMI_K3_MLA_LAYERS = tuple(range(4, 93, 4)) + (93,)  # 1-based: every fourth layer, and the last

# Kimi K3's text_config, as published (2026-07-27) and read by the model card's mirrors and
# third-party ports; see kimi_k3() for the sources.
KIMI_K3_TEXT_CONFIG = dict(
    vocab_size=163840, hidden_size=7168, num_hidden_layers=93, num_attention_heads=96,
    num_key_value_heads=96, intermediate_size=33792, rms_norm_eps=1e-5,
    max_position_embeddings=1048576, hidden_act="situ", activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0, attn_res_block_size=12,
    linear_attn_config={"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                        "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                        "kda_layers": [i for i in range(1, 94) if i not in KIMI_K3_MLA_LAYERS],
                        "full_attn_layers": list(KIMI_K3_MLA_LAYERS)},
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True, num_experts=896,
    num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
    routed_expert_hidden_size=3584, latent_moe_use_norm=True, moe_router_activation_func="sigmoid",
    moe_renormalize=True, routed_scaling_factor=1.0, num_expert_group=1, topk_group=1,
    first_k_dense_replace=1, moe_layer_freq=1, tie_word_embeddings=False)


def kimi_k3() -> LMConfig:
    """Kimi K3 (2.8T total, 104B active, as published): 93 layers at width 7,168, KDA in 69
    (96 heads of 128, the lower-bound gate, a full-rank output gate) and gated NoPE MLA in 24
    (1-based 4, 8, …, 92 and 93; 96 heads, ``q_lora_rank`` 1,536, ``kv_lora_rank`` 512, head
    dims 128 + 64 for keys, of which the 64 are kept but never rotated, and 128 for values); a
    dense first layer (SiTU-GLU, 33,792), then a latent mixture of 896 experts (16 per token,
    hidden 3,072, run in a 3,584-wide latent with an RMSNorm after the weighted sum, weights ×
    1.0) and two shared experts at full width; SiTU-GLU everywhere; block attention residuals
    every 12 layers; RMSNorm eps 1e-5; vocabulary 163,840; context 1,048,576.

    Sources: Kimi Team, *Kimi K3: Open Frontier Intelligence*, arXiv 2607.24653 (2026-07-27)
    and the model card of ``moonshotai/Kimi-K3``; every value is read from the released
    ``config.json`` (its ``text_config``) as third-party readings and ports give it, mlx-lm
    0.32.2's ``models/kimi_k3.py`` above all (whose defaults give the dense width 33,792 and the
    norm eps, and whose layer shapes fix the forget gate's rank at ``head_dim``). Nothing here is
    assumed. The release stores the routed experts in MXFP4 (:mod:`tinyk3.mxfp4`), which changes
    no count; its multi-token-prediction layer was used in training and is not in the release
    (``num_nextn_predict_layers`` 0), nor here. :func:`~tinyk3.models.count_parameters` gives
    2,779,484,393,568 total (2.7795T, "2.8T" rounded) and 105.36B active; without the input embedding
    (163,840 × 7,168 = 1.17B, a lookup, not a matrix product), 104.19B: the report's "104.2B
    activated", the convention of DeepSeek-V3's 36.6B. :func:`tinyk3.models.from_checkpoint`
    reads the same dict (``{"model_type": "kimi_k3", "text_config": KIMI_K3_TEXT_CONFIG}``).
    """
    from .hub import lm_config_from_hf  # the checkpoint path builds the preset too

    return lm_config_from_hf({"model_type": "kimi_k3", "text_config": KIMI_K3_TEXT_CONFIG})


def kimi_k3_mixers() -> MixerStack:
    """Kimi K3's 93 token mixers (of :func:`kimi_k3`) and its width and context: what chapters
    12 and 13 size states and caches with."""
    cfg = kimi_k3()
    return MixerStack(cfg.n_embd, cfg.layer_mixers, block_size=cfg.block_size)

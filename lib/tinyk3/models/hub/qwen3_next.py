"""Qwen3-Next from its ``config.json`` or ``transformers`` config."""

from __future__ import annotations

from collections.abc import Mapping

from ...layers import GatedAttentionConfig, GatedDeltaNetConfig, MoEConfig, SwiGLUConfig
from ..config import LMConfig
from .common import common, rope_parameters

__all__ = ["config_from_hf"]


def config_from_hf(cfg: Mapping) -> LMConfig:
    """Qwen3-Next: Gated DeltaNet and gated attention by ``layer_types`` (or every
    ``full_attention_interval``-th layer attention), a softmax-routed mixture of experts with a
    gated shared expert, zero-centred RMSNorm."""
    n = cfg["num_hidden_layers"]
    theta, params = rope_parameters(cfg)
    if cfg.get("attention_bias", False):
        raise NotImplementedError("qwen3_next with attention_bias=True is not built")
    eps = cfg.get("rms_norm_eps", 1e-6)
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = GatedAttentionConfig(n_head=cfg["num_attention_heads"],
                                n_kv_head=cfg["num_key_value_heads"], head_dim=head_dim,
                                partial_rotary_factor=partial, rope_theta=theta, norm_eps=eps)
    gdn = GatedDeltaNetConfig(n_head=cfg["linear_num_key_heads"],
                              head_dim=cfg["linear_key_head_dim"],
                              n_v_head=cfg["linear_num_value_heads"],
                              v_head_dim=cfg["linear_value_head_dim"],
                              conv_size=cfg["linear_conv_kernel_dim"], norm_eps=eps)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
        else "linear_attention" for i in range(n)]
    mixers = [attn if t == "full_attention" else gdn for t in types]
    moe = MoEConfig(cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                    shared_hidden=cfg.get("shared_expert_intermediate_size") or 0,
                    scoring="softmax", norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    shared_gate=True)
    dense = SwiGLUConfig(hidden=cfg["intermediate_size"])
    only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1)
    mlps = [moe if i not in only and cfg["num_experts"] > 0 and (i + 1) % step == 0 else dense
            for i in range(n)]
    return common(cfg, "rmsnorm_centred", mixers, mlps)

"""DeepSeek-V3 (and Kimi K2) from its ``config.json`` or ``transformers`` config."""

from __future__ import annotations

from collections.abc import Mapping

from ...layers import MLAConfig, MoEConfig, SwiGLUConfig
from ..config import LMConfig
from .common import common, rope_parameters

__all__ = ["config_from_hf"]


def config_from_hf(cfg: Mapping) -> LMConfig:
    """DeepSeek-V3 (and Kimi K2, the same architecture): MLA in every layer, the first
    ``first_k_dense_replace`` layers dense, the others a mixture of experts with a sigmoid router."""
    n = cfg["num_hidden_layers"]
    theta, _ = rope_parameters(cfg)
    if cfg.get("attention_bias", False):
        raise NotImplementedError("deepseek_v3 with attention_bias=True is not built")
    mla = MLAConfig(n_head=cfg["num_attention_heads"], kv_lora_rank=cfg["kv_lora_rank"],
                    qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    q_lora_rank=cfg.get("q_lora_rank") or 0, rope_theta=theta,
                    rope_interleave=bool(cfg.get("rope_interleave", True)))
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise NotImplementedError(f"deepseek_v3 with scoring_func {cfg['scoring_func']!r}")
    moe = MoEConfig(cfg["n_routed_experts"], cfg["num_experts_per_tok"],
                    cfg["moe_intermediate_size"], n_shared=cfg.get("n_shared_experts") or 0,
                    n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
    dense = SwiGLUConfig(hidden=cfg["intermediate_size"])
    k = cfg.get("first_k_dense_replace") or 0
    return common(cfg, "rmsnorm", [mla] * n, [dense if i < k else moe for i in range(n)])

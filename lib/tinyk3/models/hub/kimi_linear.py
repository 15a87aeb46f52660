"""Kimi Linear from its ``config.json`` (1-based layer lists) or ``transformers`` config."""

from __future__ import annotations

from collections.abc import Mapping

from ...layers import KDAConfig, MLAConfig, MoEConfig, SwiGLUConfig
from ..config import LMConfig
from .common import common, first_of

__all__ = ["config_from_hf"]


def config_from_hf(cfg: Mapping) -> LMConfig:
    """Kimi Linear: KDA and NoPE MLA by ``layer_types`` (or the hub config's 1-based
    ``linear_attn_config["full_attn_layers"]``), dense or sparse feed-forwards."""
    n = cfg["num_hidden_layers"]
    lin = cfg.get("linear_attn_config") or {}
    types = cfg.get("layer_types")
    if types is None:
        full = set(lin.get("full_attn_layers", ()))  # 1-based in the released config
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    eps = cfg.get("rms_norm_eps", 1e-5)
    head_dim = first_of(cfg, "linear_head_dim", default=lin.get("head_dim", 128))
    kda = KDAConfig(n_head=first_of(cfg, "linear_num_heads", default=lin.get("num_heads", 32)),
                    head_dim=head_dim,
                    conv_size=first_of(cfg, "linear_conv_kernel_dim",
                                   default=lin.get("short_conv_kernel_size", 4)),
                    norm_eps=eps)
    mla = MLAConfig(n_head=cfg["num_attention_heads"], kv_lora_rank=cfg["kv_lora_rank"],
                    qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    q_lora_rank=cfg.get("q_lora_rank") or 0, use_rope=False)
    moe = MoEConfig(first_of(cfg, "num_local_experts", "num_experts"),
                    first_of(cfg, "num_experts_per_tok", "num_experts_per_token"),
                    cfg["moe_intermediate_size"],
                    n_shared=first_of(cfg, "n_shared_experts", "num_shared_experts", default=0),
                    n_group=first_of(cfg, "n_group", "num_expert_group", default=1),
                    topk_group=first_of(cfg, "topk_group", default=1),
                    norm_topk_prob=bool(first_of(cfg, "norm_topk_prob", "moe_renormalize", default=True)),
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
    mlp_types = cfg.get("mlp_layer_types") or [
        "dense" if i < cfg.get("first_k_dense_replace", 1) else "sparse" for i in range(n)]
    dense = SwiGLUConfig(hidden=cfg["intermediate_size"])
    return common(cfg, "rmsnorm", [mla if t == "full_attention" else kda for t in types],
                   [moe if t == "sparse" else dense for t in mlp_types])

"""Kimi K3 from its published ``config.json`` (the text model)."""

from __future__ import annotations

from collections.abc import Mapping

from ...gates import LOWER_BOUND
from ...layers import KDAConfig, MLAConfig, MoEConfig, SwiGLUConfig
from ...layers.moe import SITU_CAPS
from ..config import LMConfig

__all__ = ["config_from_hf"]


def config_from_hf(config: Mapping) -> LMConfig:
    """Kimi K3 from its published ``config.json`` (the text model: ``text_config`` if present).

    Read as mlx-lm 0.32.2's ``models/kimi_k3.py`` reads it: KDA where ``(i + 1)`` is in
    ``linear_attn_config["kda_layers"]`` (1-based), NoPE MLA elsewhere; MoE where ``i >=
    first_k_dense_replace`` and ``i % moe_layer_freq == 0``; experts in the
    ``routed_expert_hidden_size`` latent; SiTU-GLU everywhere; attention residuals every
    ``attn_res_block_size`` layers."""
    cfg = dict(config.get("text_config") or config)
    n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    lin = cfg["linear_attn_config"]
    if cfg.get("hidden_act", "situ") != "situ" or (
            (cfg.get("activation_situ_beta") or 1.0, cfg.get("activation_situ_linear_beta"))
            != SITU_CAPS):
        raise NotImplementedError("kimi_k3: only SiTU-GLU with caps (4, 25) is built, got "
                                  f"{cfg.get('hidden_act')!r}, {cfg.get('activation_situ_beta')!r}, "
                                  f"{cfg.get('activation_situ_linear_beta')!r}")
    if not cfg.get("mla_use_nope", True):
        raise NotImplementedError("kimi_k3: MLA with RoPE (mla_use_nope=False) is not built")
    bound = lin.get("gate_lower_bound")
    if bound is not None and float(bound) != LOWER_BOUND:
        raise NotImplementedError(f"kimi_k3: gate_lower_bound {bound} (only {LOWER_BOUND} is built)")
    if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise NotImplementedError("kimi_k3: only the sigmoid router is built")
    eps = cfg.get("rms_norm_eps", 1e-5)
    kda = KDAConfig(n_head=lin["num_heads"], head_dim=lin["head_dim"],
                    conv_size=lin.get("short_conv_kernel_size", 4),
                    gate="softplus" if bound is None else "lower_bound",
                    output_gate="full" if lin.get("use_full_rank_gate") else "low_rank",
                    norm_eps=eps)
    mla = MLAConfig(n_head=cfg["num_attention_heads"], kv_lora_rank=cfg["kv_lora_rank"],
                    qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    q_lora_rank=cfg.get("q_lora_rank") or 0, use_rope=False,
                    output_gate=bool(cfg.get("mla_use_output_gate", False)))
    kda_layers = set(lin["kda_layers"])
    mixers = [kda if i + 1 in kda_layers else mla for i in range(n)]
    n_experts = cfg.get("num_experts") or 0
    moe = None
    if n_experts:
        moe = MoEConfig(n_experts, cfg.get("num_experts_per_token", 16), cfg["moe_intermediate_size"],
                        n_shared=cfg.get("num_shared_experts") or 0,
                        n_group=cfg.get("num_expert_group") or 1, topk_group=cfg.get("topk_group") or 1,
                        norm_topk_prob=bool(cfg.get("moe_renormalize", True)),
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                        activation="situ", latent_dim=cfg.get("routed_expert_hidden_size") or 0,
                        latent_norm=bool(cfg.get("latent_moe_use_norm", False)), norm_eps=eps)
    dense = SwiGLUConfig(hidden=cfg["intermediate_size"], activation="situ")
    k, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    mlps = [moe if moe is not None and i >= k and i % freq == 0 else dense for i in range(n)]
    return LMConfig(vocab_size=cfg["vocab_size"], block_size=cfg.get("max_position_embeddings", 1048576),
                    n_embd=d, pattern=tuple(mixers), mlp=tuple(mlps), pos_emb=False, norm="rmsnorm",
                    layer_norm_eps=eps, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                    attn_res_block_size=cfg.get("attn_res_block_size") or 0)

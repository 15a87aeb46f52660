"""Tiny Kimi K3 checkpoints in the published format, built offline for the tests.

``text_config(**sizes)`` is a K3 ``text_config`` (model_type ``kimi_linear``, as the release
nests it) at a tiny size: four layers, KDA at 1-based 1, 2, 4 and gated NoPE MLA at 3,
attention residuals in blocks of two, a dense first layer, then the latent MoE.
``checkpoint(text, seed, mxfp4=...)`` draws every tensor under the checkpoint's own names,
written here from the published tensor list (independently of ``tinyk3``'s converter), with
the ``language_model.`` prefix; with ``mxfp4`` the routed experts are stored as the release
stores them, ``weight_packed`` + ``weight_scale``, packed by ``pack`` (mlx's ``mx.quantize``
in the oracle test). ``a_log_pad`` pads ``A_log`` as the release does (128 entries for 96).
"""

from __future__ import annotations

import math

import torch

from tinyk3.util import random_value

SIZES = dict(D=32, V=96, H=2, DK=8, K=4, HQ=4, RQ=16, R=12, DN=8, DR=4, DV=6, E=8, TOPK=3,
             HE=6, L=12, NS=1, DENSE=40)


def text_config(**sizes) -> dict:
    s = dict(SIZES, **sizes)
    return dict(
        model_type="kimi_linear", vocab_size=s["V"], hidden_size=s["D"], num_hidden_layers=4,
        num_attention_heads=s["HQ"], num_key_value_heads=s["HQ"], intermediate_size=s["DENSE"],
        rms_norm_eps=1e-5, max_position_embeddings=4096, hidden_act="situ",
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, attn_res_block_size=2,
        linear_attn_config={"num_heads": s["H"], "head_dim": s["DK"],
                            "short_conv_kernel_size": s["K"], "gate_lower_bound": -5.0,
                            "use_full_rank_gate": True, "kda_layers": [1, 2, 4],
                            "full_attn_layers": [3]},
        q_lora_rank=s["RQ"], kv_lora_rank=s["R"], qk_nope_head_dim=s["DN"],
        qk_rope_head_dim=s["DR"], v_head_dim=s["DV"], mla_use_nope=True,
        mla_use_output_gate=True, num_experts=s["E"], num_experts_per_token=s["TOPK"],
        num_shared_experts=s["NS"], moe_intermediate_size=s["HE"],
        routed_expert_hidden_size=s["L"], latent_moe_use_norm=True, routed_scaling_factor=2.5,
        num_expert_group=4, topk_group=2, first_k_dense_replace=1, moe_layer_freq=1,
        tie_word_embeddings=False)


def config(text: dict, *, mxfp4: bool = False) -> dict:
    """The whole ``config.json``: ``model_type`` ``kimi_k3`` around the text config; with
    ``mxfp4`` the release's ``quantization_config`` (compressed-tensors, routed experts only)."""
    cfg = {"model_type": "kimi_k3", "text_config": text}
    if mxfp4:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                "symmetric": True, "scale_dtype": "torch.uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*"]}
    return cfg


def shapes(text: dict) -> dict[str, tuple]:
    """Every tensor of the checkpoint, under the published names (with ``language_model.``)."""
    lin = text["linear_attn_config"]
    D, V, H, DK, K = (text["hidden_size"], text["vocab_size"], lin["num_heads"], lin["head_dim"],
                      lin["short_conv_kernel_size"])
    HQ, RQ, R = text["num_attention_heads"], text["q_lora_rank"], text["kv_lora_rank"]
    DN, DR, DV = text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]
    E, HE, L = text["num_experts"], text["moe_intermediate_size"], text["routed_expert_hidden_size"]
    NS, DENSE = text["num_shared_experts"], text["intermediate_size"]
    P = H * DK
    s = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,),
         "lm_head.weight": (V, D), "model.output_attn_res.proj_weight": (1, D),
         "model.output_attn_res.norm_weight": (D,)}
    for i in range(text["num_hidden_layers"]):
        p = f"model.layers.{i}."
        s.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)})
        for res in ("self_attention_res", "mlp_res"):
            s.update({p + f"{res}.proj_weight": (1, D), p + f"{res}.norm_weight": (D,)})
        a = p + "self_attn."
        if i + 1 in lin["kda_layers"]:
            for x in "qkv":
                s.update({a + f"{x}_proj.weight": (P, D), a + f"{x}_conv1d.weight": (P, 1, K)})
            s.update({a + "f_a_proj.weight": (DK, D), a + "f_b_proj.weight": (P, DK),
                      a + "b_proj.weight": (H, D), a + "g_proj.weight": (P, D),
                      a + "A_log": (1, 1, H, 1), a + "dt_bias": (P,),
                      a + "o_norm.weight": (DK,), a + "o_proj.weight": (D, P)})
        else:
            s.update({a + "q_a_proj.weight": (RQ, D), a + "q_a_layernorm.weight": (RQ,),
                      a + "q_b_proj.weight": (HQ * (DN + DR), RQ),
                      a + "kv_a_proj_with_mqa.weight": (R + DR, D),
                      a + "kv_a_layernorm.weight": (R,), a + "kv_b_proj.weight": (HQ * (DN + DV), R),
                      a + "o_proj.weight": (D, HQ * DV), a + "g_proj.weight": (HQ * DV, D)})
        if i < text["first_k_dense_replace"]:
            s.update({p + "mlp.gate_proj.weight": (DENSE, D), p + "mlp.up_proj.weight": (DENSE, D),
                      p + "mlp.down_proj.weight": (D, DENSE)})
        else:
            m = p + "block_sparse_moe."
            s.update({m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,),
                      m + "routed_expert_down_proj.weight": (L, D),
                      m + "routed_expert_up_proj.weight": (D, L), m + "routed_expert_norm.weight": (L,),
                      m + "shared_experts.gate_proj.weight": (NS * HE, D),
                      m + "shared_experts.up_proj.weight": (NS * HE, D),
                      m + "shared_experts.down_proj.weight": (D, NS * HE)})
            for e in range(E):
                s.update({m + f"experts.{e}.w1.weight": (HE, L), m + f"experts.{e}.w3.weight": (HE, L),
                          m + f"experts.{e}.w2.weight": (L, HE)})
    return {"language_model." + k: v for k, v in s.items()}


def checkpoint(text: dict, seed: int = 0, *, pack=None, a_log_pad: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors for :func:`shapes`; ``pack(weight) -> (packed uint8, scale uint8)`` stores
    each routed expert's ``w1/w2/w3`` as ``weight_packed`` + ``weight_scale`` instead."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes(text).items():
        if name.endswith("e_score_correction_bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("proj_weight"):  # the depth mixes: logits of order one
            t = 2 * torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        elif "conv1d" in name:
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            t = random_value(name, shape, g, decay=(1, 16), dt_shift=-1.0)
        if name.endswith("A_log") and a_log_pad:  # the release: more entries than heads, junk
            t = torch.cat([t.reshape(-1), torch.full((a_log_pad,), 99.0)]).reshape(1, 1, -1, 1)
        if pack is not None and ".experts." in name:
            packed, scale = pack(t)
            base = name.removesuffix(".weight")
            out[base + ".weight_packed"], out[base + ".weight_scale"] = packed, scale
            continue
        out[name] = t
    return out

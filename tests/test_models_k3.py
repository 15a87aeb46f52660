"""Kimi K3 as a whole (chapter 17): ``from_checkpoint`` on a tiny configuration in the published
format (``model_type`` ``kimi_k3`` with its ``text_config``, tensors under the checkpoint's own
names and the ``language_model.`` prefix, per-expert ``w1``/``w2``/``w3``), against mlx-lm's
``models/kimi_k3.py`` on ``mlx[cpu]``, which loads the same tensors through its own
``sanitize``.

Checked: logits within ``TOL``; piecewise decoding through the cache equals the full forward
(float64); the parameter count; attention residuals mixing several blocks (block size 2 over
four layers), KDA and MLA layers side by side, a dense first layer, the latent MoE.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from tinyk3.models import LM, count_parameters, from_checkpoint
from tinyk3.models.hub import lm_config_from_hf

mx = pytest.importorskip("mlx.core")
k3 = pytest.importorskip("mlx_lm.models.kimi_k3")

TOL = 1e-4  # float32 logits, the bound (logits up to about 3.6; measured below)

D, V, H, DK, K = 32, 96, 2, 8, 4
HQ, RQ, R, DN, DR, DV = 4, 16, 12, 8, 4, 6
E, TOPK, HE, L, NS = 8, 3, 6, 12, 1
TEXT = dict(
    model_type="kimi_linear", vocab_size=V, hidden_size=D, num_hidden_layers=4,
    num_attention_heads=HQ, num_key_value_heads=HQ, intermediate_size=40, rms_norm_eps=1e-5,
    max_position_embeddings=4096, hidden_act="situ", activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0, attn_res_block_size=2,
    linear_attn_config={"num_heads": H, "head_dim": DK, "short_conv_kernel_size": K,
                        "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                        "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
    q_lora_rank=RQ, kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV,
    mla_use_nope=True, mla_use_output_gate=True, num_experts=E, num_experts_per_token=TOPK,
    num_shared_experts=NS, moe_intermediate_size=HE, routed_expert_hidden_size=L,
    latent_moe_use_norm=True, routed_scaling_factor=2.5, num_expert_group=4, topk_group=2,
    first_k_dense_replace=1, moe_layer_freq=1, tie_word_embeddings=False)
CONFIG = {"model_type": "kimi_k3", "text_config": TEXT}


def _shapes() -> dict[str, tuple]:
    """Every tensor of the tiny checkpoint, under the published names."""
    P = H * DK
    s = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,),
         "lm_head.weight": (V, D), "model.output_attn_res.proj_weight": (1, D),
         "model.output_attn_res.norm_weight": (D,)}
    for i in range(TEXT["num_hidden_layers"]):
        p = f"model.layers.{i}."
        s.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)})
        for res in ("self_attention_res", "mlp_res"):
            s.update({p + f"{res}.proj_weight": (1, D), p + f"{res}.norm_weight": (D,)})
        a = p + "self_attn."
        if i + 1 in TEXT["linear_attn_config"]["kda_layers"]:
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
        if i < TEXT["first_k_dense_replace"]:
            s.update({p + "mlp.gate_proj.weight": (40, D), p + "mlp.up_proj.weight": (40, D),
                      p + "mlp.down_proj.weight": (D, 40)})
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


def _checkpoint(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in _shapes().items():
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1, 16, generator=g).log()
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, generator=g) - 1.0
        elif name.endswith("e_score_correction_bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("proj_weight"):  # the depth mixes: logits of order one
            t = 2 * torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        elif "norm" in name:
            t = 1 + 0.2 * torch.randn(shape, generator=g)
        elif "conv1d" in name:
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        out[name] = t
    return out


@pytest.fixture(scope="module")
def pair():
    sd = _checkpoint()
    ours = from_checkpoint(CONFIG, sd)
    ref = k3.Model(k3.ModelArgs.from_dict(CONFIG))
    weights = ref.sanitize({k: mx.array(v.numpy()) for k, v in sd.items()})
    ref.load_weights(list(weights.items()), strict=True)
    return ours, ref, sd


def _idx(T=19, seed=3):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def _dist(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_config_reads_the_published_layout():
    cfg = lm_config_from_hf(CONFIG)
    assert cfg.kinds == ("kda", "kda", "mla", "kda")
    assert [m.kind for m in cfg.layer_mlps] == ["swiglu", "moe", "moe", "moe"]
    assert cfg.attn_res_block_size == 2 and cfg.layer_mlps[1].latent_dim == L


def test_logits_equal_mlx_lm(pair):
    """mlx-lm computes in float32 (its expert kernel has no float64); so do we, and our float64
    model gives the exact logits: both float32 models are within TOL of it and of each other."""
    ours, ref, _ = pair
    idx = _idx()
    with torch.no_grad():
        logits = ours(idx)
        exact = copy.deepcopy(ours).double()(idx)
    ref_logits = torch.from_numpy(np.array(ref(mx.array(idx.numpy()))))
    assert ref_logits.abs().max() > 0.5
    assert _dist(exact, ref_logits) < TOL  # measured 2.9e-5
    assert _dist(logits, ref_logits) < TOL  # measured 2.5e-5 (our own float32 error: 2.4e-5)


def test_piecewise_decoding_equals_full_forward(pair):
    ours = copy.deepcopy(pair[0]).double()
    idx = _idx()
    with torch.no_grad():
        full = ours(idx)
        for cuts in ([1] * 19, [5, 1, 8, 5]):
            cache, outs, t = ours.new_cache(), [], 0
            for n in cuts:
                outs.append(ours(idx[:, t:t + n], cache))
                t += n
            assert _dist(torch.cat(outs, 1), full) < 1e-10
    assert [type(s).__name__ for s in cache.layers] == ["KDAState", "KDAState", "LatentState",
                                                         "KDAState"]


def test_parameter_count(pair):
    ours, ref, sd = pair
    total = count_parameters(ours.config).total
    assert total == sum(p.numel() for p in ours.parameters())
    # the checkpoint's tensors, less the router biases (buffers, not parameters)
    assert total == sum(t.numel() for k, t in sd.items() if "e_score_correction_bias" not in k)
    with torch.device("meta"):
        assert sum(p.numel() for p in LM(ours.config).parameters()) == total


def test_vision_and_mtp_tensors_are_ignored():
    sd = _checkpoint()
    sd["vision_tower.patch_embed.weight"] = torch.zeros(3, 3)
    sd["language_model.model.mtp.0.eh_proj.weight"] = torch.zeros(3, 3)
    sd = {k.removeprefix("language_model."): v for k, v in sd.items()}  # without the prefix too
    ours = from_checkpoint(CONFIG, sd)
    assert isinstance(ours, LM)
    bad = dict(CONFIG, text_config=dict(TEXT, activation_situ_beta=2.0))
    with pytest.raises(NotImplementedError, match="SiTU"):
        from_checkpoint(bad, sd)


def test_preset_counts_against_published():
    """presets.kimi_k3(): 2.7795T total and 105.4B active from the released config, within 1.5%
    of the announced 2.8T / 104B; and the model built on the meta device has that many."""
    from tinyk3.models import presets
    cfg = presets.kimi_k3()
    n = count_parameters(cfg)
    assert abs(n.total / 2.8e12 - 1) < 0.015 and abs(n.active / 104e9 - 1) < 0.015
    assert (cfg.kinds.count("kda"), cfg.kinds.count("mla")) == (69, 24)
    with torch.device("meta"):
        model = LM(cfg)
    assert sum(p.numel() for p in model.parameters()) == n.total
    assert presets.kimi_k3_mixers().layer_mixers == cfg.layer_mixers


def test_one_block_per_layer_is_a_softmax_over_every_layer_output():
    """With a block per layer, every layer's input mixes the embedding and all earlier layers'
    outputs (full attention residuals); with zero projection weights the mix is their plain
    average, which differs from the plain residual's sum (the reduction holds only for the
    sum inside a block)."""
    from tinyk3.models.lm import DepthMix
    mix = DepthMix(8, 1e-5)
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(2, 3, 8, generator=g) for _ in range(4)]
    out = mix(srcs[:3], srcs[3])
    assert _dist(out, torch.stack(srcs).mean(0)) < 1e-6  # zero weights: uniform over depth
    with torch.no_grad():
        mix.proj.weight.normal_(generator=g)
    w = mix.norm.weight * mix.proj.weight[0]
    logits = torch.stack([(s / s.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()) @ w for s in srcs])
    ref = (torch.softmax(logits, 0)[..., None] * torch.stack(srcs)).sum(0)
    assert _dist(mix(srcs[:3], srcs[3]), ref) < 1e-6
    assert torch.equal(mix([], srcs[0]), srcs[0])  # nothing completed yet: the partial sum

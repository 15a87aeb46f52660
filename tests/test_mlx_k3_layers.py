"""Kimi K3's layers (chapter 17) against an independent implementation: ``mlx-lm``'s
``models/kimi_k3.py`` on ``mlx[cpu]`` (pinned in the CI environment only, installed without
its dependencies), at tiny random configurations with the same weights.

Covered here: the KDA layer with the lower-bound gate and the full-rank output gate, the gated
NoPE MLA layer, the SiTU-GLU feed-forward and the latent mixture of experts (experts in a
narrower latent, RMSNorm after the weighted sum, shared experts at full width, group-limited
sigmoid routing with a random score-correction bias). The whole model (attention residuals) is
checked in ``tests/test_models_k3.py`` once it is built.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinyk3.layers import KimiDeltaAttention, MoE, MultiHeadLatentAttention, SwiGLU
from tinyk3.layers.moe import situ
from tinyk3.util import random_value

mx = pytest.importorskip("mlx.core")
k3 = pytest.importorskip("mlx_lm.models.kimi_k3")

TOL = 1e-5  # float32, ours against mlx-lm's (outputs O(1); measured below 2e-6)

D, H, DK = 32, 2, 8  # width; KDA heads of DK
ARGS = dict(
    model_type="kimi_linear", vocab_size=64, hidden_size=D, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, intermediate_size=40, rms_norm_eps=1e-5,
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
    linear_attn_config={"num_heads": H, "head_dim": DK, "short_conv_kernel_size": 4,
                        "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                        "kda_layers": [1], "full_attn_layers": [2]},
    q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
    mla_use_nope=True, mla_use_output_gate=True, num_experts=8, num_experts_per_token=3,
    num_shared_experts=1, moe_intermediate_size=6, routed_expert_hidden_size=12,
    latent_moe_use_norm=True, routed_scaling_factor=2.5, num_expert_group=4, topk_group=2,
    first_k_dense_replace=0)


def _args(**kw):
    return k3.TextArgs.from_dict({**ARGS, **kw})


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(mx.float32)))


def _m(t: torch.Tensor):
    return mx.array(t.detach().float().numpy())


def _random(shapes: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    """Random float32 tensors: matrices ~ N(0, 1/fan_in), vectors near their usual values."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("e_score_correction_bias"):
            out[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = random_value(name, shape, g, decay=(1, 16), dt_shift=-1.0)
    return out


def _x(B=2, T=13, seed=5):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def _dist(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _load_mlx(module, weights: dict[str, torch.Tensor]):
    module.load_weights([(k, _m(v)) for k, v in weights.items()], strict=True)
    return module


def test_situ_and_dense_mlp():
    g = torch.linspace(-30, 30, 301)
    u = torch.linspace(-200, 200, 301)
    y = situ(g, u)
    assert y.abs().max() <= 4 * 25  # both factors soft-capped
    small = torch.linspace(-0.5, 0.5, 11)  # near 0 SiTU-GLU is SiLU-GLU: tanh(z) ≈ z
    assert _dist(situ(small, small), torch.nn.functional.silu(small) * small) < 1e-3
    ref = k3.KimiK3MLP(_args())
    w = _random({"gate_proj.weight": (40, D), "up_proj.weight": (40, D),
                 "down_proj.weight": (D, 40)}, seed=1)
    _load_mlx(ref, w)
    ours = SwiGLU(D, 40, activation="situ")
    ours.load_state_dict(w)
    x = _x()
    with torch.no_grad():
        assert _dist(ours(x), _t(ref(_m(x)))) < TOL


def test_latent_moe_equals_mlx():
    E, h, L = 8, 6, 12
    ref = k3.KimiK3SparseMoE(_args())
    w = _random({"gate.weight": (E, D), "e_score_correction_bias": (E,),
                 "switch_mlp.gate_proj.weight": (E, h, L), "switch_mlp.up_proj.weight": (E, h, L),
                 "switch_mlp.down_proj.weight": (E, L, h),
                 "routed_expert_down_proj.weight": (L, D), "routed_expert_up_proj.weight": (D, L),
                 "routed_expert_norm.weight": (L,), "shared_experts.gate_proj.weight": (h, D),
                 "shared_experts.up_proj.weight": (h, D),
                 "shared_experts.down_proj.weight": (D, h)}, seed=2)
    _load_mlx(ref, w)
    ours = MoE(D, E, 3, h, n_shared=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
               activation="situ", latent_dim=L, latent_norm=True, norm_eps=1e-5)
    ours.load_state_dict({
        "router.weight": w["gate.weight"],
        "router.e_score_correction_bias": w["e_score_correction_bias"],
        "experts.gate_up_proj": torch.cat([w["switch_mlp.gate_proj.weight"],
                                           w["switch_mlp.up_proj.weight"]], dim=1),
        "experts.down_proj": w["switch_mlp.down_proj.weight"],
        **{k: v for k, v in w.items() if k.startswith(("routed_expert", "shared_experts"))}})
    x = _x()
    with torch.no_grad():
        y = ours(x)
        assert _dist(y, _t(ref(_m(x)))) < TOL
        for form in ("loop", "batched"):
            ours.experts.form = form
            assert _dist(ours(x), y) < 1e-6
    spec_count = sum(p.numel() for p in ours.parameters())
    from tinyk3.layers import MoEConfig
    spec = MoEConfig(E, 3, h, n_shared=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     activation="situ", latent_dim=L, latent_norm=True)
    assert spec.num_parameters(D) == spec_count
    assert spec.num_active_parameters(D) == spec_count - (E - 3) * 3 * h * L


def test_kda_lower_bound_full_gate_equals_mlx():
    P = H * DK
    ref = k3.KimiK3DeltaAttention(_args(), layer_idx=0)
    w = _random({"qkv_proj.weight": (3 * P, D), "qkv_conv.conv.weight": (3 * P, 4, 1),
                 "f_a_proj.weight": (DK, D), "f_b_proj.weight": (P, DK), "b_proj.weight": (H, D),
                 "g_proj.weight": (P, D), "A_log": (H,), "dt_bias": (P,),
                 "o_norm.weight": (DK,), "o_proj.weight": (D, P)}, seed=3)
    w["qkv_conv.conv.weight"] = w["qkv_conv.conv.weight"] * 0.5
    _load_mlx(ref, w)
    ours = KimiDeltaAttention(D, H, DK, conv_size=4, gate="lower_bound", output_gate="full",
                              norm_eps=1e-5)
    q, k, v = w["qkv_proj.weight"].split(P)
    cq, ck, cv = w["qkv_conv.conv.weight"].permute(0, 2, 1).split(P)  # [C, 1, K]
    ours.load_state_dict({"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v,
                          "q_conv1d.weight": cq, "k_conv1d.weight": ck, "v_conv1d.weight": cv,
                          **{n: w[n] for n in ("f_a_proj.weight", "f_b_proj.weight",
                                               "b_proj.weight", "g_proj.weight", "A_log",
                                               "dt_bias", "o_norm.weight", "o_proj.weight")}})
    x = _x(T=37)
    with torch.no_grad():
        y, _ = ours(x)
        ref_y = _t(ref(_m(x)))
    assert ref_y.abs().max() > 0.05
    assert _dist(y, ref_y) < TOL


def test_gated_nope_mla_equals_mlx():
    Hq, rq, r, dn, dr, dv = 4, 16, 12, 8, 4, 6
    ref = k3.KimiK3MLAAttention(_args())
    w = _random({"q_a_proj.weight": (rq, D), "q_a_layernorm.weight": (rq,),
                 "q_b_proj.weight": (Hq * (dn + dr), rq),
                 "kv_a_proj_with_mqa.weight": (r + dr, D), "kv_a_layernorm.weight": (r,),
                 "kv_b_proj.weight": (Hq * (dn + dv), r), "o_proj.weight": (D, Hq * dv),
                 "g_proj.weight": (Hq * dv, D)}, seed=4)
    kv_b = w["kv_b_proj.weight"].view(Hq, dn + dv, r)
    mlx_w = {k: v for k, v in w.items() if k != "kv_b_proj.weight"}
    mlx_w["embed_q.weight"] = kv_b[:, :dn].transpose(1, 2).contiguous()  # [H, r, dn]
    mlx_w["unembed_out.weight"] = kv_b[:, dn:].contiguous()  # [H, dv, r]
    _load_mlx(ref, mlx_w)
    ours = MultiHeadLatentAttention(D, Hq, r, dn, dr, dv, q_lora_rank=rq, use_rope=False,
                                    output_gate=True)
    ours.load_state_dict(w)
    T = 11
    x = _x(T=T)
    mask = mx.array(np.tril(np.ones((T, T), dtype=bool)))
    with torch.no_grad():
        ref_y = _t(ref(_m(x), mask=mask))
        for absorb in (False, True):
            ours.absorb = absorb
            assert _dist(ours(x)[0], ref_y) < TOL
        # decoding one token from the latent cache: mlx takes its absorbed path (L == 1)
        ours.absorb = True
        _, state = ours(x[:, :-1])
        y_last, _ = ours(x[:, -1:], state)
    assert _dist(y_last, ref_y[:, -1:]) < TOL

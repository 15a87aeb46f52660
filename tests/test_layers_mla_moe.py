"""Chapters 13-14's layers: multi-head latent attention, Qwen3-Next's gated attention, RoPE,
the router and the mixture of experts.

Oracles: ``transformers``' ``DeepseekV3Attention``, ``Qwen3NextAttention``, ``DeepseekV3MoE`` and
``Qwen3NextSparseMoeBlock`` at tiny random configurations with the same weights (every weight
random, the router's score-correction bias too, group-limited routing on). Reference forms inside
the library: the naive MLA path against the absorbed one, the expert loop against the batched
pass, and float64 token-by-token decoding against the full forward.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import import_without_fla
from tinyk3.layers import (
    GatedAttention,
    GatedAttentionConfig,
    LatentState,
    MLAConfig,
    MoE,
    MoEConfig,
    MultiHeadLatentAttention,
    RMSNorm,
    SwiGLUConfig,
    rope,
    state_nbytes,
)
from tinyk3.layers import moe as moe_mod

HF_TOL = 1e-5  # float32, ours against transformers' layers (outputs O(1))
STEP_TOL = 1e-5  # float32, piecewise decoding against the full forward


def _randomise(module, seed=0, skip=()):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(s in name for s in skip):
                continue
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return module


def _x(B, T, d, seed=1, dtype=torch.float32):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _dist(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _positions(T):
    return torch.arange(T)[None]


# -- RoPE ----------------------------------------------------------------------------------
def test_rope_layouts_agree_on_scores_not_on_tensors():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 9, 8, generator=g, dtype=torch.float64)
    pos = torch.arange(9)
    perm = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])  # interleaved → halves
    qi, ki = rope(q, pos, interleaved=True), rope(k, pos, interleaved=True)
    qh, kh = rope(q[..., perm], pos), rope(k[..., perm], pos)
    assert _dist(qi[..., perm], qh) < 1e-12  # the same rotation, channels permuted
    assert _dist(qi @ ki.transpose(-1, -2), qh @ kh.transpose(-1, -2)) < 1e-12
    assert _dist(qi, qh) > 0.1  # ...but not the same tensors
    # relative positions only: shifting every position leaves the scores unchanged
    s1 = rope(q, pos) @ rope(k, pos).transpose(-1, -2)
    s2 = rope(q, pos + 7) @ rope(k, pos + 7).transpose(-1, -2)
    assert _dist(s1, s2) < 1e-10


def test_rope_against_transformers(hf_ds):
    ds, _ = hf_ds
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    pos = torch.arange(5)
    freqs = pos[:, None].float() * (1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[None], emb.sin()[None]
    hq, hk = ds.apply_rotary_pos_emb(q, k, cos, sin)
    assert _dist(hq, rope(q, pos)) < 1e-6 and _dist(hk, rope(k, pos)) < 1e-6
    iq, ik = ds.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    oq, ok = rope(q, pos, interleaved=True), rope(k, pos, interleaved=True)
    assert _dist(iq @ ik.transpose(-1, -2), oq @ ok.transpose(-1, -2)) < 1e-5
    perm = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
    assert _dist(iq, oq[..., perm]) < 1e-6  # transformers' output is de-interleaved


def test_rmsnorm_forms():
    x = _x(2, 3, 6)
    plain, centred = RMSNorm(6), RMSNorm(6, centred=True)
    ref = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert _dist(plain(x), ref) < 1e-6 and _dist(centred(x), ref) < 1e-6  # both start at identity
    with torch.no_grad():
        plain.weight.fill_(1.5)
        centred.weight.fill_(0.5)
    assert _dist(plain(x), centred(x)) < 1e-6  # w = 1.5 and 1 + 0.5
    with pytest.raises(ValueError, match="last dimension"):
        plain(_x(2, 3, 5))


# -- MLA -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_ds():
    pytest.importorskip("transformers")
    ds = import_without_fla("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config
    return ds, DeepseekV3Config


MLA_SHAPES = {  # (H, q_lora_rank, r, dn, dr, dv, interleave)
    "low-rank q, interleaved": (4, 12, 16, 8, 4, 6, True),
    "full q, rotate-half": (2, None, 10, 6, 8, 8, False),
}


def _hf_mla(hf_ds, shape, d=24, seed=0):
    ds, Config = hf_ds
    H, rq, r, dn, dr, dv, inter = MLA_SHAPES[shape]
    cfg = Config(hidden_size=d, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=rq,
                 kv_lora_rank=r, qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv,
                 rope_interleave=inter, num_hidden_layers=1, attn_implementation="eager")
    layer = _randomise(ds.DeepseekV3Attention(cfg, layer_idx=0).float().eval(), seed)
    return layer, ds.DeepseekV3RotaryEmbedding(cfg), cfg


def _hf_causal_mask(T):
    m = torch.full((T, T), float("-inf")).triu(1)
    return m[None, None]


@pytest.mark.parametrize("shape", list(MLA_SHAPES))
def test_mla_equals_transformers(hf_ds, shape):
    layer, rot, cfg = _hf_mla(hf_ds, shape)
    ours = MultiHeadLatentAttention.from_hf(layer)
    x = _x(2, 11, cfg.hidden_size)
    with torch.no_grad():
        ref, _ = layer(x, rot(x, _positions(11)), _hf_causal_mask(11))
        for absorb in (False, True):
            ours.absorb = absorb
            y, state = ours(x)
            assert _dist(y, ref) < HF_TOL, (absorb, _dist(y, ref))
    assert state.c.shape == (2, 11, cfg.kv_lora_rank)
    assert state.k_rope.shape == (2, 11, cfg.qk_rope_head_dim)


def _mla(dtype=torch.float64, **kw):
    args = dict(d_model=20, n_head=3, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
                v_head_dim=5, q_lora_rank=8)
    args.update(kw)
    torch.manual_seed(0)
    return _randomise(MultiHeadLatentAttention(**args)).to(dtype)


@pytest.mark.parametrize("kw", [{}, {"qk_rope_head_dim": 0}, {"use_rope": False},
                                {"output_gate": True, "q_lora_rank": 0},
                                {"rope_interleave": False}])
def test_mla_absorbed_equals_naive_and_decoding_equals_full(kw):
    layer = _mla(**kw)
    x = _x(2, 13, 20, dtype=torch.float64)
    with torch.no_grad():
        full, st = layer(x)
        layer.absorb = True
        absorbed, _ = layer(x)
        assert _dist(full, absorbed) < 1e-12
        for absorb in (False, True):
            layer.absorb = absorb
            for cuts in ([1] * 13, [5, 1, 7], [12, 1]):
                state, outs, t = None, [], 0
                for n in cuts:
                    y, state = layer(x[:, t:t + n], state)
                    outs.append(y)
                    t += n
                assert _dist(torch.cat(outs, 1), full) < 1e-12
                assert _dist(state.c, st.c) < 1e-12
    assert state_nbytes(state) == layer.state_numel(2, 13) * 8


def test_mla_float32_absorbed_close():
    layer = _mla(torch.float32)
    x = _x(1, 30, 20)
    with torch.no_grad():
        a = layer(x)[0]
        layer.absorb = True
        b = layer(x)[0]
    assert _dist(a, b) < 1e-5


def test_mla_config_counts_and_cache():
    for kw in ({}, {"q_lora_rank": 0, "output_gate": True}, {"qk_rope_head_dim": 0}):
        cfg = MLAConfig(n_head=3, kv_lora_rank=12, qk_nope_head_dim=6, v_head_dim=5,
                        **{"q_lora_rank": 8, "qk_rope_head_dim": 4, **kw})
        layer = cfg.build(20)
        assert sum(p.numel() for p in layer.parameters()) == cfg.num_parameters(20)
        assert layer.state_numel(1, 7) == cfg.state_numel(1, 7)
    dsv3 = MLAConfig(n_head=128, q_lora_rank=1536)
    assert dsv3.state_numel(1, 1) == 576
    assert MLAConfig(n_head=32, qk_rope_head_dim=0).state_numel(1, 1) == 512


def test_mla_bad_input():
    layer = _mla(torch.float32)
    with pytest.raises(ValueError, match=r"\[B, T, d=20\]"):
        layer(torch.zeros(1, 3, 19))
    _, state = layer(_x(1, 3, 20))
    with pytest.raises(ValueError, match="state.c"):
        layer(_x(2, 1, 20), state)
    with pytest.raises(TypeError, match="LatentState"):
        layer(_x(1, 1, 20), (state.c, state.k_rope))
    with pytest.raises(TypeError, match="float64"):
        layer.double()(_x(1, 1, 20, dtype=torch.float64), state)
    with pytest.raises(ValueError, match="even"):
        MLAConfig(n_head=2, qk_rope_head_dim=3)
    assert isinstance(state, LatentState)


# -- Qwen3-Next gated attention --------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_q3():
    pytest.importorskip("transformers")
    q3 = import_without_fla("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig
    return q3, Qwen3NextConfig


def test_gated_attention_equals_transformers(hf_q3):
    q3, Config = hf_q3
    cfg = Config(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 num_hidden_layers=1, layer_types=["full_attention"], attn_implementation="eager")
    layer = _randomise(q3.Qwen3NextAttention(cfg, layer_idx=0).float().eval())
    rot = q3.Qwen3NextRotaryEmbedding(cfg)
    ours = GatedAttention.from_hf(layer)
    assert ours.rotary_dim == 2  # partial_rotary_factor 0.25 of 8
    x = _x(2, 9, 24)
    with torch.no_grad():
        ref, _ = layer(x, rot(x, _positions(9)), _hf_causal_mask(9))
        y, _ = ours(x)
        assert _dist(y, ref) < HF_TOL
        state, outs = None, []
        for a, b in ((0, 4), (4, 5), (5, 9)):
            o, state = ours(x[:, a:b], state)
            outs.append(o)
        assert _dist(torch.cat(outs, 1), y) < STEP_TOL
    spec = GatedAttentionConfig(n_head=4, n_kv_head=2, head_dim=8)
    assert sum(p.numel() for p in spec.build(24).parameters()) == spec.num_parameters(24)
    assert state_nbytes(state) == spec.state_numel(2, 9) * 4


# -- routing and experts ---------------------------------------------------------------------
def test_route_bias_selects_but_never_weighs():
    g = torch.Generator().manual_seed(0)
    s = torch.rand(50, 16, generator=g, dtype=torch.float64)
    bias = 0.3 * torch.randn(16, generator=g, dtype=torch.float64)
    w0, i0 = moe_mod.route(s, top_k=4, routed_scaling_factor=2.5)
    w1, i1 = moe_mod.route(s, top_k=4, bias=bias, routed_scaling_factor=2.5)
    assert (i0.sort(-1).values != i1.sort(-1).values).any()  # the bias changed selections
    for w, i in ((w0, i0), (w1, i1)):
        chosen = s.gather(1, i)
        assert _dist(w, 2.5 * chosen / chosen.sum(-1, keepdim=True)) < 1e-12  # unbiased scores
        assert _dist(w.sum(-1), torch.full((50,), 2.5)) < 1e-12


def test_route_group_limited():
    g = torch.Generator().manual_seed(1)
    s = torch.rand(40, 32, generator=g)
    w, i = moe_mod.route(s, top_k=4, n_group=8, topk_group=2)
    groups = i // 4
    assert max(row.unique().numel() for row in groups) <= 2  # at most 2 groups per token
    # the groups kept are the two with the best top-2 sums
    top2 = s.view(40, 8, 4).topk(2, -1).values.sum(-1).topk(2, -1).indices.sort(-1).values
    for n in range(40):
        assert set(groups[n].tolist()) <= set(top2[n].tolist())
    with pytest.raises(ValueError, match="top_k"):
        moe_mod.route(s, top_k=9, n_group=8, topk_group=2)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_expert_loop_equals_batched(dtype, tol):
    g = torch.Generator().manual_seed(2)
    E, d, h, N, k = 6, 8, 5, 37, 2
    x = torch.randn(N, d, generator=g, dtype=dtype)
    gu = torch.randn(E, 2 * h, d, generator=g, dtype=dtype)
    dn = torch.randn(E, d, h, generator=g, dtype=dtype)
    w, i = moe_mod.route(torch.rand(N, E, generator=g, dtype=dtype) ** 3, top_k=k)
    a = moe_mod.experts_loop(x, w, i, gu, dn)
    b = moe_mod.experts_batched(x, w, i, gu, dn)
    assert _dist(a, b) < tol
    # and both equal the per-token definition
    ref = torch.stack([sum(w[n, j] * moe_mod._expert(x[n:n + 1], gu[i[n, j]], dn[i[n, j]])[0]
                           for j in range(k)) for n in range(N)])
    assert _dist(a, ref) < tol * 10


def test_balancing_update():
    bias = torch.zeros(4)
    load = torch.tensor([10, 2, 4, 4])
    assert torch.equal(moe_mod.update_bias(bias, load, 0.01), torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    assert torch.equal(moe_mod.expert_load(torch.tensor([[0, 1], [0, 3]]), 4), torch.tensor([2, 1, 0, 1]))


def test_moe_equals_deepseek_v3(hf_ds):
    ds, Config = hf_ds
    cfg = Config(hidden_size=16, moe_intermediate_size=6, n_routed_experts=16, num_experts_per_tok=3,
                 n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
                 num_hidden_layers=1, experts_implementation="eager")
    ref = _randomise(ds.DeepseekV3MoE(cfg).float().eval())
    ours = MoE(16, 16, 3, 6, n_shared=2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    sd = {k.replace("gate.", "router.") if k.startswith("gate.") else k: v
          for k, v in ref.state_dict().items()}
    ours.load_state_dict(sd)
    x = _x(3, 10, 16)
    with torch.no_grad():
        for form in ("loop", "batched"):
            ours.experts.form = form
            assert _dist(ours(x), ref(x)) < HF_TOL
    spec = MoEConfig(16, 3, 6, n_shared=2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert spec.num_parameters(16) == sum(p.numel() for p in ref.parameters())
    assert spec.num_active_parameters(16) == spec.num_parameters(16) - 13 * 3 * 6 * 16


def test_moe_equals_qwen3_next(hf_q3):
    q3, Config = hf_q3
    cfg = Config(hidden_size=16, moe_intermediate_size=6, shared_expert_intermediate_size=10,
                 num_experts=8, num_experts_per_tok=2, num_hidden_layers=1,
                 experts_implementation="eager")
    ref = _randomise(q3.Qwen3NextSparseMoeBlock(cfg).float().eval())
    ours = MoE(16, 8, 2, 6, shared_hidden=10, scoring="softmax", shared_gate=True)
    names = {"gate.weight": "router.weight", "shared_expert_gate.weight": "shared_gate.weight"}
    sd = {names.get(k, k.replace("shared_expert.", "shared_experts.")): v
          for k, v in ref.state_dict().items()}
    sd["router.e_score_correction_bias"] = torch.zeros(8)
    ours.load_state_dict(sd)
    x = _x(2, 7, 16)
    with torch.no_grad():
        assert _dist(ours(x), ref(x)) < HF_TOL
    spec = MoEConfig(8, 2, 6, shared_hidden=10, scoring="softmax", shared_gate=True)
    assert spec.num_parameters(16) == sum(p.numel() for p in ref.parameters())


def test_moe_config_counts():
    for spec in (MoEConfig(8, 2, 6, n_shared=1), MoEConfig(8, 2, 6, n_group=4, topk_group=2),
                 SwiGLUConfig(hidden=12)):
        m = spec.build(10)
        assert sum(p.numel() for p in m.parameters()) == spec.num_parameters(10)
    assert "e_score_correction_bias" not in dict(MoEConfig(8, 2, 6).build(10).named_parameters())
    with pytest.raises(ValueError, match="n_group"):
        MoEConfig(9, 2, 6, n_group=2)
    with pytest.raises(ValueError, match="scoring"):
        MoEConfig(8, 2, 6, scoring="relu")


def test_attention_window_cuts_every_mla_layer_and_restores_it():
    """A one-layer model whose MLA sees its last w tokens gives, at every position t, what
    the full model gives on tokens t − w + 1 … t alone (RoPE is relative); both paths
    (expanded, absorbed) agree; a window as long as the context changes nothing."""
    from tinyk3.layers import MLAConfig, attention_window
    from tinyk3.models import LM, LMConfig

    torch.manual_seed(0)
    spec = MLAConfig(n_head=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
                     v_head_dim=4)
    model = LM(LMConfig(vocab_size=11, block_size=64, n_embd=16, pattern=[spec],
                        pos_emb=False, norm="rmsnorm")).double()
    mla = [m for m in model.modules() if hasattr(m, "window")]
    idx = torch.randint(0, 11, (2, 9))
    w = 3
    with torch.no_grad():
        base = model(idx)
        with attention_window(model, 9):
            same = model(idx)
        with attention_window(model, w):
            cut = model(idx)
            for m in mla:
                m.absorb = True
            cut_absorbed = model(idx)
            for m in mla:
                m.absorb = False
        after = model(idx)
        alone = torch.stack([model(idx[:, max(0, t - w + 1):t + 1])[:, -1] for t in range(9)],
                            dim=1)
    assert (same - base).abs().max() < 1e-12  # a window of the whole context: no change
    assert (cut - alone).abs().max() < 1e-12  # the window is exactly the last w tokens
    assert (cut - base).abs().max() > 1e-3  # and it matters
    assert (cut_absorbed - cut).abs().max() < 1e-10  # both paths honour it
    assert (after - base).abs().max() == 0 and all(m.window is None for m in mla)
    with pytest.raises(ValueError, match="positive int or None"):
        with attention_window(model, 0):
            pass

"""Whole models from ``transformers`` (chapters 12-14): DeepSeek-V3, Kimi K2's configuration of
it, and Qwen3-Next, each built offline at a tiny random configuration (vocabulary 256, two to
four layers, every weight random, the router's score-correction bias too, group-limited routing
on for DeepSeek-V3) and loaded with :func:`tinyk3.models.from_hf`.

Checked: logits within ``LOGIT_TOL`` of ``transformers``' in float32; a sequence fed through
the cache in pieces gives the full forward's logits (float64, tight); :func:`count_parameters`
equals the reference model's parameter count; the checkpoint path (per-expert tensors, ``model.`` prefixes, a
multi-token-prediction layer to drop) gives the same model; the presets' counts.
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import import_without_fla
from tinyk3.models import LM, count_parameters, from_checkpoint, from_hf, presets
from tinyk3.models.hub import convert_state_dict, lm_config_from_hf
from tinyk3.util import randomise_

LOGIT_TOL = 1e-4  # float32, the bound (measured 4e-6 DeepSeek-V3, 2.3e-5 Qwen3-Next,
# on logits up to ≈ 5; each layer alone agrees to ≤ 1.6e-6, and four layers of unit-gain random
# weights amplify float32 rounding)
CACHE_TOL = 1e-10  # float64, piecewise decoding against the full forward (measured ≤ 4e-14;
# in float32 the same comparison measures ≤ 9e-5, rounding amplified as above)


def _randomise(model, seed=0):
    qwen3 = "qwen3" in type(model).__name__.lower()

    def centre(name):  # Qwen3-Next's norms store 1 + w, except the linear layers' gated norm
        return 0.0 if qwen3 and "linear_attn.norm" not in name else 1.0

    return randomise_(model, seed, norm_centre=centre, bias_std=0.05)


def _dist(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module")
def hf_ds():
    pytest.importorskip("transformers")
    ds = import_without_fla("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config
    return ds, DeepseekV3Config


@pytest.fixture(scope="module")
def hf_q3():
    pytest.importorskip("transformers")
    q3 = import_without_fla("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig
    return q3, Qwen3NextConfig


DS_CONFIGS = {
    "deepseek_v3 (8 groups of 2, 4 kept)": dict(
        q_lora_rank=16, n_routed_experts=16, n_group=8, topk_group=4, num_experts_per_tok=3,
        first_k_dense_replace=1, num_hidden_layers=3, routed_scaling_factor=2.5),
    "kimi_k2 (one group, full-rank q)": dict(
        q_lora_rank=None, n_routed_experts=12, n_group=1, topk_group=1, num_experts_per_tok=4,
        first_k_dense_replace=1, num_hidden_layers=2, routed_scaling_factor=2.827,
        rope_interleave=False),
}


def _ds_model(hf_ds, name, seed=0):
    ds, Config = hf_ds
    cfg = Config(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=8,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12,
                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_shared_experts=1,
                 max_position_embeddings=128, attn_implementation="eager",
                 experts_implementation="eager", **DS_CONFIGS[name])
    return _randomise(ds.DeepseekV3ForCausalLM(cfg).float().eval(), seed)


def _q3_model(hf_q3, seed=0):
    q3, Config = hf_q3
    cfg = Config(vocab_size=256, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                 linear_value_head_dim=6, linear_conv_kernel_dim=4, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=8,
                 shared_expert_intermediate_size=12, mlp_only_layers=[1],
                 layer_types=["linear_attention", "linear_attention", "full_attention",
                              "linear_attention"],
                 max_position_embeddings=128, attn_implementation="eager",
                 experts_implementation="eager")
    return _randomise(q3.Qwen3NextForCausalLM(cfg).float().eval(), seed)


def _idx(B=2, T=21, seed=3):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _check_model(hf_model, ours):
    idx = _idx()
    with torch.no_grad():
        ref = hf_model(idx).logits
        logits = ours(idx)
        dist = _dist(logits, ref)
        assert dist < LOGIT_TOL, dist
        assert ref.abs().max() > 0.5  # logits of a size where the comparison means something
        ours64 = copy.deepcopy(ours).double()
        full64 = ours64(idx)
        assert _dist(full64, logits) < 1e-3
        for cuts in ([21], [1] * 21, [6, 1, 9, 5]):
            cache, outs, t = ours64.new_cache(), [], 0
            for n in cuts:
                outs.append(ours64(idx[:, t:t + n], cache))
                t += n
            assert cache.length == 21
            assert _dist(torch.cat(outs, 1), full64) < CACHE_TOL, cuts
    total, active = count_parameters(ours.config)
    assert total == sum(p.numel() for p in hf_model.parameters())
    assert total == sum(p.numel() for p in ours.parameters())
    assert active < total
    return dist


@pytest.mark.parametrize("name", list(DS_CONFIGS))
def test_deepseek_v3_from_hf(hf_ds, name):
    hf_model = _ds_model(hf_ds, name)
    ours = from_hf(hf_model)
    assert isinstance(ours, LM) and ours.config.kinds == ("mla",) * hf_model.config.num_hidden_layers
    _check_model(hf_model, ours)
    # the router's bias reached our buffer (it is zero at init in transformers)
    assert ours.transformer.h[1].mlp.router.e_score_correction_bias.abs().max() > 0


def test_qwen3_next_from_hf(hf_q3):
    hf_model = _q3_model(hf_q3)
    ours = from_hf(hf_model)
    assert ours.config.kinds == ("gated_deltanet", "gated_deltanet", "gated_attention",
                                 "gated_deltanet")
    assert [m.kind for m in ours.config.layer_mlps] == ["moe", "swiglu", "moe", "moe"]
    _check_model(hf_model, ours)


def test_checkpoint_names_per_expert_and_mtp(hf_ds):
    """The published layout: one tensor per expert, a ``model.`` prefix, an MTP layer."""
    hf_model = _ds_model(hf_ds, "deepseek_v3 (8 groups of 2, 4 kept)")
    sd, hub = hf_model.state_dict(), {}
    for key, t in sd.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            for e, w in enumerate(t):
                g, u = w.chunk(2, dim=0)
                hub[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = g
                hub[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = u
        elif key.endswith("mlp.experts.down_proj"):
            for e, w in enumerate(t):
                hub[key.replace("down_proj", f"{e}.down_proj.weight")] = w
        else:
            hub[key] = t
    hub["model.layers.3.eh_proj.weight"] = torch.zeros(3, 3)  # an MTP layer's tensor: dropped
    config = hf_model.config.to_dict()
    ours = from_checkpoint(config, hub)
    idx = _idx()
    with torch.no_grad():
        assert _dist(ours(idx), hf_model(idx).logits) < LOGIT_TOL
    bad = dict(hub)
    del bad["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match="incomplete"):
        convert_state_dict(lm_config_from_hf(config), bad)
    yarn = dict(config, rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4})
    with pytest.raises(NotImplementedError, match="yarn"):
        from_checkpoint(yarn, hub)


def test_presets_counts_against_published():
    """DeepSeek-V3 671B / 37B and Kimi K2 1T / 32B (published, rounded): within 2% of total and
    3% of active (K2's published figures round ≈1.03T and ≈32.6B down)."""
    for preset, total, active in ((presets.deepseek_v3, 671e9, 37e9),
                                  (presets.kimi_k2, 1.0e12, 32e9)):
        n = count_parameters(preset())
        assert abs(n.total / total - 1) < 0.04, (preset.__name__, n)
        assert abs(n.active / active - 1) < 0.03, (preset.__name__, n)


def test_preset_count_equals_built_model_at_scale():
    """count_parameters equals the parameters of the model built on the meta device, at
    DeepSeek-V3's and Qwen3-Next-80B's real sizes (no memory is allocated)."""
    for preset in (presets.deepseek_v3, presets.kimi_k2, presets.qwen3_next_80b,
                   presets.kimi_linear_48b):
        cfg = preset()
        with torch.device("meta"):
            model = LM(cfg)
        assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg).total


def test_hybrid_layer_patterns():
    """Kimi Linear: MLA at the released config's 1-based 4, 8, ..., 24, 27 (20 KDA, 7 MLA);
    Kimi K3: every fourth layer and the last (69 KDA, 24 MLA); Qwen3-Next: every fourth."""
    kl = presets.kimi_linear_48b().kinds
    assert [i + 1 for i, k in enumerate(kl) if k == "mla"] == [4, 8, 12, 16, 20, 24, 27]
    assert kl.count("kda") == 20
    k3 = presets.kimi_k3_mixers()
    assert (k3.n_layer, k3.kinds.count("kda"), k3.kinds.count("mla")) == (93, 69, 24)
    assert [i + 1 for i, k in enumerate(k3.kinds) if k == "mla"][-3:] == [88, 92, 93]
    q3 = presets.qwen3_next_80b().kinds
    assert q3.count("gated_attention") == 12 and q3[3] == "gated_attention"
    mla = presets.deepseek_v3().layer_mixers[0]
    assert mla.state_numel(1, 1) == 576  # per token per layer
    per_head_kv = mla.n_head * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    assert per_head_kv == 40960 and int(per_head_kv / mla.state_numel(1, 1)) == 71


class _ByteTokenizer:
    """Bytes as token ids (vocabulary 256), the interface try_checkpoint uses."""

    def __call__(self, text, return_tensors="pt"):
        class Out:
            input_ids = torch.tensor([list(text.encode())])
        return Out()

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def test_try_checkpoint_offline_and_with_a_local_model(hf_q3, capsys, monkeypatch):
    from tinyk3.models.demo import try_checkpoint
    monkeypatch.delenv("TINYK3_ALLOW_DOWNLOAD", raising=False)
    assert try_checkpoint("some/repo") is None
    assert "Skipped" in capsys.readouterr().out
    hf_model = _q3_model(hf_q3)
    result = try_checkpoint("local/tiny", "Hello", 5, allow_download=True,
                            loader=lambda repo: (_ByteTokenizer(), hf_model))
    out = capsys.readouterr().out
    assert result is not None and result["distance"] < LOGIT_TOL and "greedy continuation" in out

    def broken(repo):
        raise OSError("no network")
    assert try_checkpoint("x/y", allow_download=True, loader=broken) is None
    assert "OSError: no network" in capsys.readouterr().out


@pytest.fixture(scope="module")
def hf_kl():
    pytest.importorskip("transformers")
    kl = import_without_fla("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig
    return kl, KimiLinearConfig


def _kl_model(hf_kl, seed=0):
    kl, Config = hf_kl
    cfg = Config(vocab_size=256, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, q_lora_rank=None,
                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, linear_num_heads=2,
                 linear_head_dim=8, linear_conv_kernel_dim=4, num_local_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=1,
                 n_group=2, topk_group=1, routed_scaling_factor=2.446,
                 layer_types=["linear_attention", "linear_attention", "full_attention",
                              "linear_attention"],
                 mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=128,
                 attn_implementation="eager", experts_implementation="eager")
    return _randomise(kl.KimiLinearForCausalLM(cfg).float().eval(), seed)


def test_kimi_linear_from_hf(hf_kl):
    """Kimi Linear (chapter 15's model, here because its layers are chapters 12-14's): KDA and
    NoPE MLA side by side in one cache, a dense first layer, group-limited routing."""
    hf_model = _kl_model(hf_kl)
    ours = from_hf(hf_model)
    assert ours.config.kinds == ("kda", "kda", "mla", "kda")
    assert not ours.transformer.h[2].attn.use_rope
    _check_model(hf_model, ours)


def test_kimi_linear_hub_config_layers_are_one_based(hf_kl):
    """The released config lists its MLA layers 1-based (``full_attn_layers``): layer 3 there
    is index 2 here; an off-by-one would move the MLA layer and fail the load."""
    hf_model = _kl_model(hf_kl)
    cfg = hf_model.config.to_dict()
    for key in ("layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        cfg.pop(key)
    cfg["linear_attn_config"] = {"full_attn_layers": [3], "kda_layers": [1, 2, 4], "num_heads": 2,
                                 "head_dim": 8, "short_conv_kernel_size": 4}
    assert lm_config_from_hf(cfg).kinds == ("kda", "kda", "mla", "kda")
    ours = from_checkpoint(cfg, hf_model.state_dict())
    idx = _idx()
    with torch.no_grad():
        assert _dist(ours(idx), hf_model(idx).logits) < LOGIT_TOL

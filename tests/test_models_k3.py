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

import numpy as np
import pytest
import torch

import k3_tiny
from tinyk3.models import LM, count_parameters, from_checkpoint
from tinyk3.models.hub import lm_config_from_hf

mx = pytest.importorskip("mlx.core")
k3 = pytest.importorskip("mlx_lm.models.kimi_k3")

TOL = 1e-4  # float32 logits, the bound (logits up to about 3.6; measured below)

V = k3_tiny.SIZES["V"]
TEXT = k3_tiny.text_config()
CONFIG = k3_tiny.config(TEXT)


def _checkpoint(seed=0) -> dict[str, torch.Tensor]:
    return k3_tiny.checkpoint(TEXT, seed)


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
    assert cfg.attn_res_block_size == 2
    assert cfg.layer_mlps[1].latent_dim == k3_tiny.SIZES["L"]


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
    """presets.kimi_k3(): the counts its docstring states; 2.8T is the total rounded, and the
    report's 104.2B activated is the active count without the input embedding (DeepSeek-V3's
    convention); the model built on the meta device has that many parameters."""
    from tinyk3.models import presets
    cfg = presets.kimi_k3()
    n = count_parameters(cfg)
    assert (n.total, n.active) == (2_779_484_393_568, 105_363_935_328)
    assert round(n.total / 1e12, 1) == 2.8
    assert round((n.active - cfg.vocab_size * cfg.n_embd) / 1e9, 1) == 104.2
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


def test_try_published_offline_and_with_a_local_packed_checkpoint(capsys, monkeypatch):
    """Chapter 17's optional cell: skipped offline; on a tiny K3 in the released format (MXFP4
    experts, padded A_log) built here, it loads, counts and decodes."""
    from tinyk3.models import try_published
    from tinyk3.mxfp4 import quantize_mxfp4
    monkeypatch.delenv("TINYK3_ALLOW_DOWNLOAD", raising=False)
    assert try_published("some/repo") is None
    assert "Skipped" in capsys.readouterr().out
    text = k3_tiny.text_config(L=32, HE=32)
    sd = k3_tiny.checkpoint(text, pack=quantize_mxfp4, a_log_pad=2)
    result = try_published("local/k3", 9, allow_download=True,
                           loader=lambda repo: (k3_tiny.config(text, mxfp4=True), sd))
    out = capsys.readouterr().out
    assert result is not None and result["count_ok"] and result["decode_distance"] < 1e-3
    assert result["packed"] == 3 * 3 * text["num_experts"]  # 3 MoE layers, w1/w2/w3 per expert
    assert "tensors read as MXFP4" in out and "greedy continuation" in out

    def broken(repo):
        raise OSError("no network")
    assert try_published("x/y", allow_download=True, loader=broken) is None
    assert "OSError: no network" in capsys.readouterr().out

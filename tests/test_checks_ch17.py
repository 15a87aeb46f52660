"""Chapter 17's exercises (Kimi K3), answered the way learners get them wrong and right.

The wrong answers are written independently of the registered Mistake functions; the
references are tied to the library (:class:`tinyk3.models.lm.DepthMix`, the reader of K3
configs and the built experts) and, where it is importable, to mlx-lm's ``models/kimi_k3.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import right, wrong
from tinyk3 import checks
from tinyk3.layers import MoEConfig
from tinyk3.models import presets
from tinyk3.models.hub import lm_config_from_hf
from tinyk3.models.lm import DepthMix

# -- kimi_k3.depth_mix ----------------------------------------------------------------------------


def _rms_normed(s, eps):
    return s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps)


@wrong("kimi_k3.depth_mix", "scaled_by_sqrt_d")
def dm_sdpa_style(sources, w_norm, w_proj, eps):
    """Softmax attention's habit: scores over √d."""
    w = w_norm * w_proj
    logits = (_rms_normed(sources, eps) * w).sum(-1) / math.sqrt(sources.shape[-1])
    p = logits.softmax(0)
    return (p[..., None] * sources).sum(0)


@wrong("kimi_k3.depth_mix", "normed_values")
def dm_normed_values(sources, w_norm, w_proj, eps):
    keys = _rms_normed(sources, eps)
    p = (keys @ (w_norm * w_proj)).softmax(0)
    return torch.einsum("sbt,sbtd->btd", p, keys)


@wrong("kimi_k3.depth_mix", "softmax_per_channel")
def dm_softmax_channels(sources, w_norm, w_proj, eps):
    """A weight per source AND channel: softmax over depth of normed ⊙ w."""
    p = (_rms_normed(sources, eps) * (w_norm * w_proj)).softmax(0)
    return (p * sources).sum(0)


@wrong("kimi_k3.depth_mix", "softmax_over_tokens")
def dm_softmax_last_axis(sources, w_norm, w_proj, eps):
    p = (_rms_normed(sources, eps) @ (w_norm * w_proj)).softmax(-1)
    return (p.unsqueeze(-1) * sources).sum(0)


@wrong("kimi_k3.depth_mix", "raw_logits")
def dm_raw_keys(sources, w_norm, w_proj, eps):
    p = (sources @ (w_norm * w_proj)).softmax(0)
    return (p.unsqueeze(-1) * sources).sum(0)


@wrong("kimi_k3.depth_mix", "partial_added")
def dm_residual_on_top(sources, w_norm, w_proj, eps):
    p = (_rms_normed(sources, eps) @ (w_norm * w_proj)).softmax(0)
    return sources[-1] + (p.unsqueeze(-1) * sources).sum(0)


@right("kimi_k3.depth_mix")
def dm_ok_loop(sources, w_norm, w_proj, eps):
    """One source at a time, in float64, the softmax written out."""
    w = (w_norm * w_proj).double()
    logits = []
    for s in sources.double():
        rms = torch.sqrt(s.pow(2).mean(-1) + eps)
        logits.append((s @ w) / rms)
    logits = torch.stack(logits)
    e = torch.exp(logits - logits.max(0).values)
    p = e / e.sum(0)
    out = sum(p[i, ..., None] * s for i, s in enumerate(sources.double()))
    return out.to(sources.dtype)


@right("kimi_k3.depth_mix")
def dm_ok_lib(sources, w_norm, w_proj, eps):
    mix = DepthMix(sources.shape[-1], eps).to(sources.dtype)
    with torch.no_grad():
        mix.norm.weight.copy_(w_norm)
        mix.proj.weight.copy_(w_proj[None])
        return mix(list(sources[:-1]), sources[-1])


# -- kimi_k3.routed_experts ------------------------------------------------------------------------


@wrong("kimi_k3.routed_experts", "hidden_not_latent")
def re_full_width(config):
    n = config["num_hidden_layers"] - config["first_k_dense_replace"]
    per = 3 * config["moe_intermediate_size"] * config["hidden_size"]  # "d × h, as in ch 14"
    return n * config["num_experts"] * per, n * config["num_experts_per_token"] * per


@wrong("kimi_k3.routed_experts", "every_layer")
def re_all_layers(config):
    per = 3 * config["moe_intermediate_size"] * config["routed_expert_hidden_size"]
    total = config["num_hidden_layers"] * config["num_experts"] * per
    return total, total * config["num_experts_per_token"] // config["num_experts"]


@wrong("kimi_k3.routed_experts", "two_matrices")
def re_up_and_down(config):
    n = config["num_hidden_layers"] - config["first_k_dense_replace"]
    up = config["moe_intermediate_size"] * config["routed_expert_hidden_size"]
    return n * config["num_experts"] * 2 * up, n * config["num_experts_per_token"] * 2 * up


@wrong("kimi_k3.routed_experts", "shared_in_active")
def re_shared_used_too(config):
    n = config["num_hidden_layers"] - config["first_k_dense_replace"]
    per = 3 * config["moe_intermediate_size"] * config["routed_expert_hidden_size"]
    used = config["num_experts_per_token"] + config["num_shared_experts"]
    return n * config["num_experts"] * per, n * used * per


@wrong("kimi_k3.routed_experts", None)
def re_float_share(config):
    n = config["num_hidden_layers"] - config["first_k_dense_replace"]
    per = 3 * config["moe_intermediate_size"] * config["routed_expert_hidden_size"]
    total = n * config["num_experts"] * per
    return total, total * (config["num_experts_per_token"] / config["num_experts"]) * 1.001


@right("kimi_k3.routed_experts")
def re_ok_per_layer(config):
    total = active = 0
    for layer in range(config["num_hidden_layers"]):
        if layer < config["first_k_dense_replace"]:
            continue  # a dense feed-forward
        expert = 3 * config["moe_intermediate_size"] * config["routed_expert_hidden_size"]
        total += config["num_experts"] * expert
        active += config["num_experts_per_token"] * expert
    return total, active


@right("kimi_k3.routed_experts")
def re_ok_float_share(config):
    n = config["num_hidden_layers"] - config["first_k_dense_replace"]
    total = n * config["num_experts"] * 3 * config["moe_intermediate_size"] * \
        config["routed_expert_hidden_size"]
    return total, round(total * config["num_experts_per_token"] / config["num_experts"])


# -- the lists --------------------------------------------------------------------------------------


def test_the_depth_mix_reference_is_the_library_read():
    for c in checks.EXERCISES["kimi_k3.depth_mix"].cases():
        ref = checks.EXERCISES["kimi_k3.depth_mix"].reference(*c.args)
        lib = dm_ok_lib(*c.args)
        tol = 1e-12 if ref.dtype == torch.float64 else 1e-5
        assert ref.dtype == c.args[0].dtype
        assert (ref.double() - lib.double()).abs().max() <= tol * max(1.0, ref.abs().max()), c.label


def test_the_depth_mix_cases_make_the_scale_mistake_visible():
    """The √d mistake must change the weights, not only round them: on the cases with more
    than one source its output is far from the reference (so the cases are not degenerate),
    and a single source gives the partial sum exactly."""
    ex = checks.EXERCISES["kimi_k3.depth_mix"]
    far = 0
    for c in ex.cases():
        ref = ex.reference(*c.args)
        if c.args[0].shape[0] == 1:
            assert torch.equal(ref, c.args[0][0])
            continue
        far += float((dm_sdpa_style(*c.args) - ref).abs().max()) > 1e-2
    assert far >= 4


def test_the_depth_mix_reference_equals_mlx_lm():
    mx = pytest.importorskip("mlx.core")
    k3 = pytest.importorskip("mlx_lm.models.kimi_k3")
    for c in checks.EXERCISES["kimi_k3.depth_mix"].cases():
        sources, w_norm, w_proj, eps = c.args
        if sources.dtype != torch.float32:
            continue
        blocks = k3.ResidualBlocks(eps)
        for s in sources[:-1]:
            blocks.append(mx.array(s.numpy()))
        w = mx.array((w_norm * w_proj).numpy())
        theirs = k3._attn_res_mix(blocks, mx.array(sources[-1].numpy()), w, eps, False)
        ours = checks.EXERCISES["kimi_k3.depth_mix"].reference(*c.args)
        assert np.abs(np.array(theirs) - ours.numpy()).max() < 1e-5, c.label




def test_the_experts_reference_is_the_hub_readers_configuration():
    """Every case read by the library's reader of K3 configs (the released dict with the case's
    values): the routed experts of its MoE layers, counted from the layer configurations; on
    the tiny cases, counted from the built modules' ``experts`` tensors."""
    ex = checks.EXERCISES["kimi_k3.routed_experts"]
    for c in ex.cases():
        text = dict(presets.KIMI_K3_TEXT_CONFIG, **c.args[0])
        cfg = lm_config_from_hf({"model_type": "kimi_k3", "text_config": text})
        moes = [m for m in cfg.layer_mlps if isinstance(m, MoEConfig)]
        per = [3 * m.expert_hidden * (m.latent_dim or cfg.n_embd) for m in moes]
        expected = (sum(m.n_experts * p for m, p in zip(moes, per)),
                    sum(m.top_k * p for m, p in zip(moes, per)))
        assert ex.reference(*c.args) == expected, c.label
        if cfg.n_embd <= 64:
            counted = sum(p.numel() for m in moes
                          for name, p in m.build(cfg.n_embd).named_parameters()
                          if name.startswith("experts."))
            assert counted == expected[0], c.label
    k3 = ex.reference(ex.cases()[0].args[0])
    assert k3 == (2_722_740_830_208, 48_620_371_968)  # 2.72T of K3's 2.78T; 48.6B of 105.4B

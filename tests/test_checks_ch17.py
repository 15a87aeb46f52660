"""Chapter 17's exercises (Kimi K3), answered the way learners get them wrong and right.

The wrong answers are written independently of the registered Mistake functions; the
references are tied to the library (:class:`tinyk3.models.lm.DepthMix`, :func:`moe.situ`) and,
where it is importable, to mlx-lm's ``models/kimi_k3.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import right, wrong
from tinyk3 import checks
from tinyk3.layers import moe
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


# -- kimi_k3.situ_glu -----------------------------------------------------------------------------


@wrong("kimi_k3.situ_glu", "silu_glu")
def sg_silu(gate, up):
    return F.silu(gate) * up


@wrong("kimi_k3.situ_glu", "caps_swapped")
def sg_swapped(gate, up):
    return 25 * torch.tanh(gate / 25) * torch.sigmoid(gate) * 4 * torch.tanh(up / 4)


@wrong("kimi_k3.situ_glu", "no_sigmoid")
def sg_no_sigmoid(gate, up):
    return 4 * torch.tanh(gate / 4) * 25 * torch.tanh(up / 25)


@wrong("kimi_k3.situ_glu", "value_uncapped")
def sg_gate_only(gate, up):
    return 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * up


@wrong("kimi_k3.situ_glu", "silu_capped")
def sg_cap_after_silu(gate, up):
    return 4 * torch.tanh(F.silu(gate) / 4) * 25 * torch.tanh(up / 25)


@wrong("kimi_k3.situ_glu", "hard_clamp")
def sg_clamp(gate, up):
    """A hard clamp where a soft cap belongs."""
    return F.silu(gate.clamp(-4, 4)) * up.clamp(-25, 25)


@right("kimi_k3.situ_glu")
def sg_ok_parts(gate, up):
    def soft_cap(x, c):
        return c * torch.tanh(x / c)

    return (soft_cap(gate, 4.0) * torch.sigmoid(gate) * soft_cap(up, 25.0)).to(gate.dtype)


@right("kimi_k3.situ_glu")
def sg_ok_lib(gate, up):
    return moe.situ(gate, up)


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


def test_the_situ_reference_is_the_library_and_respects_its_caps():
    ex = checks.EXERCISES["kimi_k3.situ_glu"]
    big = 0
    for c in ex.cases():
        ref = ex.reference(*c.args)
        assert ref.dtype == c.args[0].dtype
        tol = 1e-12 if ref.dtype == torch.float64 else 1e-5
        assert (ref.double() - moe.situ(*c.args).double()).abs().max() <= tol * max(
            1.0, float(ref.abs().max())), c.label
        assert float(ref.abs().max()) < 100.0  # |4·tanh·σ| < 4 and |25·tanh| < 25
        big += float((sg_silu(*c.args) - ref).abs().max()) > 1.0  # the caps bite somewhere
    assert big >= 3


def test_the_situ_reference_equals_mlx_lm():
    mx = pytest.importorskip("mlx.core")
    k3 = pytest.importorskip("mlx_lm.models.kimi_k3")
    for c in checks.EXERCISES["kimi_k3.situ_glu"].cases():
        gate, up = (a.float() for a in c.args)
        theirs = np.array(k3._situ(mx.array(up.numpy()), mx.array(gate.numpy()), 4.0, 25.0))
        ours = checks.EXERCISES["kimi_k3.situ_glu"].reference(gate, up).numpy()
        assert np.abs(theirs - ours).max() < 1e-5 * max(1.0, np.abs(ours).max()), c.label

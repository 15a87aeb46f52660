"""MXFP4, the format of Kimi K3's released routed experts: ``tinyk3.mxfp4`` against a table
written here and against mlx's own MXFP4 (``mx.quantize`` / ``mx.dequantize``, mode
``mxfp4``); ``from_checkpoint`` on a tiny K3 checkpoint whose experts are packed as released,
against mlx-lm's ``kimi_k3`` loading the same files through its own loader
(``mlx_lm.utils.load_model``: its ``sanitize`` reads ``weight_packed`` and its compressed-tensors
path runs the experts as MXFP4)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import k3_tiny
from tinyk3 import mxfp4
from tinyk3.models import from_checkpoint

# E2M1 as OCP MX v1.0 defines it: sign bit 3, then exponent (2 bits, bias 1) and mantissa (1
# bit); exponent 0 is subnormal (0 or 0.5).
OCP_E2M1 = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


def _ocp(code: int) -> float:
    e, m = (code >> 1) & 3, code & 1
    mag = 0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + 0.5 * m)
    return -mag if code & 8 else mag


def test_e2m1_codes_follow_the_ocp_definition():
    for code in range(16):
        assert mxfp4.e2m1_value(code) == _ocp(code)
        assert abs(mxfp4.e2m1_value(code)) == OCP_E2M1[code & 7]
    assert mxfp4.e8m0_scale(127) == 1.0 and mxfp4.e8m0_scale(130) == 8.0
    assert mxfp4.e8m0_scale(0) == 2.0 ** -127
    for bad in (16, -1, 1.0, True):
        with pytest.raises(ValueError, match="code"):
            mxfp4.e2m1_value(bad)
    with pytest.raises(ValueError, match="NaN"):
        mxfp4.e8m0_scale(255)


def test_one_byte_by_hand():
    """0x2F: low nibble 0xF (code 15, −6) first, high nibble 0x2 (code 2, 1.0) second."""
    packed = torch.full((1, 16), 0x2F, dtype=torch.uint8)
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    w = mxfp4.dequantize_mxfp4(packed, scale)
    assert w.shape == (1, 32)
    assert w[0, :4].tolist() == [-12.0, 2.0, -12.0, 2.0]


def test_quantize_round_trip_and_error_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 6)[:, None]
    packed, scale = mxfp4.quantize_mxfp4(w)
    assert packed.shape == (6, 32) and scale.shape == (6, 2)
    back = mxfp4.dequantize_mxfp4(packed, scale, dtype=torch.float64)
    # on the grid: quantising the dequantised weights gives the same bytes
    assert torch.equal(mxfp4.quantize_mxfp4(back)[0], packed)
    # nearest rounding: error at most half the grid step at the group's top (2·2^(e−2)·½)
    step = torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step + 1e-12).all()
    assert torch.equal(mxfp4.quantize_mxfp4(torch.zeros(2, 32))[0], torch.zeros(2, 16, dtype=torch.uint8))


def test_bad_input_is_named():
    p, s = torch.zeros(2, 16, dtype=torch.uint8), torch.full((2, 1), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize_mxfp4(p.float(), s)
    with pytest.raises(ValueError, match="scales"):
        mxfp4.dequantize_mxfp4(p, torch.full((2, 2), 127, dtype=torch.uint8))
    with pytest.raises(ValueError, match="255"):
        mxfp4.dequantize_mxfp4(p, torch.full((2, 1), 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple"):
        mxfp4.quantize_mxfp4(torch.randn(2, 40))
    with pytest.raises(ValueError, match="inf or NaN"):
        mxfp4.quantize_mxfp4(torch.full((1, 32), float("nan")))


# -- against mlx ------------------------------------------------------------------------------

mx = pytest.importorskip("mlx.core")


def _mlx_pack(w: torch.Tensor):
    """mlx's MXFP4 of ``w [out, in]``, as the checkpoint stores it: uint8 bytes, low nibble
    first (mlx packs eight codes per uint32, lowest bits first: the same byte order)."""
    q, s = mx.quantize(mx.array(w.float().numpy()), group_size=32, bits=4, mode="mxfp4")
    packed = torch.from_numpy(np.array(q).view(np.uint8).copy()).reshape(w.shape[0], -1)
    return packed, torch.from_numpy(np.array(s).copy())


def test_dequantize_equals_mlx():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (5, 48), generator=g, dtype=torch.uint8)
    scale = torch.randint(100, 140, (5, 3), generator=g, dtype=torch.uint8)
    ours = mxfp4.dequantize_mxfp4(packed, scale)
    q = mx.array(packed.numpy().view(np.uint32))
    theirs = mx.dequantize(q, mx.array(scale.numpy()), group_size=32, bits=4, mode="mxfp4",
                           dtype=mx.float32)
    assert torch.equal(ours, torch.from_numpy(np.array(theirs)))


def test_quantize_equals_mlx():
    """mlx chooses the scale that clips nothing (``scale_rule="no_clip"``): the same bytes. The
    OCP rule picks a scale half as large in the groups whose largest value would land in
    (6, 8) after division: it clips those and keeps a finer grid for the rest."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 96, generator=g) * 0.05
    theirs = _mlx_pack(w)
    packed, scale = mxfp4.quantize_mxfp4(w, scale_rule="no_clip")
    assert torch.equal(scale, theirs[1]) and torch.equal(packed, theirs[0])
    _, scale_ocp = mxfp4.quantize_mxfp4(w)
    amax = w.reshape(8, 3, 32).abs().amax(-1)
    clips = amax / torch.exp2(scale_ocp.float() - 127) > 6
    assert clips.any() and torch.equal(scale_ocp + clips.to(torch.uint8), theirs[1])


# -- the released checkpoint's experts, against mlx-lm ---------------------------------------

TEXT = k3_tiny.text_config(L=32, HE=32)  # both expert input widths a multiple of 32
TOL = 2e-4  # float32 logits up to 3.7: measured 5.4e-5 (ours in float32), 7.7e-5 (float64)


@pytest.fixture(scope="module")
def packed_pair(tmp_path_factory):
    from safetensors.torch import save_file

    utils = pytest.importorskip("mlx_lm.utils")
    sd = k3_tiny.checkpoint(TEXT, seed=4, pack=_mlx_pack, a_log_pad=3)
    cfg = k3_tiny.config(TEXT, mxfp4=True)
    path = tmp_path_factory.mktemp("kimi_k3_mxfp4")
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    ref, _ = utils.load_model(path)
    return from_checkpoint(cfg, sd), ref, sd


def test_packed_experts_load_as_released(packed_pair):
    ours, _, sd = packed_pair
    assert any(k.endswith("weight_packed") for k in sd)
    assert not any(".experts.0.w1.weight" in k and k.endswith(".weight") for k in sd)
    kda = ours.transformer.h[0].attn
    assert kda.A_log.shape == (TEXT["linear_attn_config"]["num_heads"],)  # padding sliced off
    assert (kda.A_log < 10).all()
    # our dequantisation against mlx's, tensor by tensor (layer 1, expert 2, gate w1)
    key = "language_model.model.layers.1.block_sparse_moe.experts.2.w1."
    theirs = mx.dequantize(mx.array(sd[key + "weight_packed"].numpy().view(np.uint32)),
                           mx.array(sd[key + "weight_scale"].numpy()), group_size=32, bits=4,
                           mode="mxfp4", dtype=mx.float32)
    gate = ours.transformer.h[1].mlp.experts.gate_up_proj[2, : TEXT["moe_intermediate_size"]]
    assert torch.equal(gate.detach(), torch.from_numpy(np.array(theirs)))


def test_packed_logits_equal_mlx_lm(packed_pair):
    """mlx-lm runs the experts as MXFP4 (quantised matmuls), we run them dequantised: the same
    numbers, summed in another order."""
    ours, ref, _ = packed_pair
    idx = torch.randint(0, TEXT["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = ours(idx)
        exact = copy.deepcopy(ours).double()(idx)
    theirs = torch.from_numpy(np.array(ref(mx.array(idx.numpy()))))
    assert theirs.abs().max() > 0.5
    assert (exact - theirs.double()).abs().max() < TOL
    assert (logits - theirs).abs().max() < TOL


def test_a_packed_expert_needs_both_tensors():
    sd = k3_tiny.checkpoint(TEXT, seed=4, pack=mxfp4.quantize_mxfp4)
    del sd["language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_scale"]
    with pytest.raises(ValueError, match="layer 2, expert 5, down_proj: MXFP4 needs both"):
        from_checkpoint(k3_tiny.config(TEXT, mxfp4=True), sd)

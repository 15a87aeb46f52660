"""Qwen3-Next's Gated DeltaNet layer (chapter 12), :class:`tinyk3.layers.GatedDeltaNet`.

Oracle: ``transformers``' ``Qwen3NextGatedDeltaNet`` (``models/qwen3_next``) at tiny random
configurations with the same weights, with more value heads than key heads and ``Dv ≠ Dk`` so
that the per-key-head grouping of ``in_proj_qkvz`` / ``in_proj_ba`` matters. fla and
causal_conv1d are hidden while the modelling module is imported (with fla installed,
transformers binds its Triton kernels, which fail on CPU).
"""

from __future__ import annotations

import pytest
import torch

from helpers import import_without_fla
from tinyk3.layers import (
    MIXER_CONFIGS,
    MIXERS,
    ConvState,
    GatedDeltaNet,
    GatedDeltaNetConfig,
    GatedDeltaState,
    mixer_config,
    state_nbytes,
)
from tinyk3.util import randomise_

HF_TOL = 1e-4  # float32, ours against transformers' (measured ≤ 3.4e-6, outputs ≈ 4)
STEP_TOL = 1e-5  # float32, decoding against the full forward (measured ≤ 1e-6)


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    q3 = import_without_fla("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig
    return q3, Qwen3NextConfig


SHAPES = {  # (Hk, Hv, Dk, Dv)
    "Hv=2Hk,Dv<Dk": (2, 4, 8, 6),
    "Hv=Hk": (2, 2, 8, 8),
    "Hv=3Hk": (1, 3, 4, 5),
}


def _hf_layer(hf, shape, *, d=32, K=4, seed=0):
    """A ``Qwen3NextGatedDeltaNet`` with every parameter random (gates that decay strongly and
    weakly, a norm weight ≠ 1)."""
    q3, Config = hf
    Hk, Hv, Dk, Dv = SHAPES[shape]
    cfg = Config(hidden_size=d, num_hidden_layers=1, linear_num_key_heads=Hk,
                 linear_num_value_heads=Hv, linear_key_head_dim=Dk, linear_value_head_dim=Dv,
                 linear_conv_kernel_dim=K, layer_types=["linear_attention"])
    return randomise_(q3.Qwen3NextGatedDeltaNet(cfg, layer_idx=0).float().eval(), seed)


def _x(B, T, d, seed=1):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed))


def _dist(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("T,chunk_size", [(70, 64), (45, 16), (1, 64)])
def test_equals_transformers_layer(hf, shape, T, chunk_size):
    hf_layer = _hf_layer(hf, shape, seed=T)
    ours = GatedDeltaNet.from_hf(hf_layer, chunk_size=chunk_size)
    x = _x(2, T, 32, seed=T)
    with torch.no_grad():
        ref = hf_layer(x)
        y, state = ours(x)
    Hk, Hv, Dk, Dv = SHAPES[shape]
    assert y.shape == ref.shape and ref.abs().max() > 0.1  # a signal, not zeros
    assert _dist(y, ref) <= HF_TOL
    assert state.S.shape == (2, Hv, Dk, Dv)


def test_the_grouping_of_the_fused_projections_matters(hf):
    """Reading ``in_proj_qkvz`` as plain ``[q | k | v | z]`` blocks (no per-key-head grouping)
    gives another layer: the oracle would catch a wrong split."""
    hf_layer = _hf_layer(hf, "Hv=2Hk,Dv<Dk", seed=2)
    ours = GatedDeltaNet.from_hf(hf_layer)
    x = _x(1, 20, 32)
    Hk, Hv, Dk, Dv = SHAPES["Hv=2Hk,Dv<Dk"]

    def ungrouped(qkvz, ba):
        q, k, v, z = qkvz.split([Hk * Dk, Hk * Dk, Hv * Dv, Hv * Dv], dim=2)
        b, a = ba.split([Hv, Hv], dim=2)
        return q, k, v, z, b, a

    with torch.no_grad():
        ref = hf_layer(x)
        q, k, v, z, b, a = ours.split(ours.in_proj_qkvz(x), ours.in_proj_ba(x))
        assert q.shape == (1, 20, Hk * Dk) and v.shape == z.shape == (1, 20, Hv * Dv)
        assert b.shape == a.shape == (1, 20, Hv)
        ours.split = ungrouped
        wrong, _ = ours(x)
    assert _dist(wrong, ref) > 1e-2


def test_decoding_through_the_state_equals_transformers_full_forward(hf):
    hf_layer = _hf_layer(hf, "Hv=2Hk,Dv<Dk", seed=3)
    ours = GatedDeltaNet.from_hf(hf_layer, chunk_size=16)
    x = _x(1, 24, 32, seed=3)
    with torch.no_grad():
        ref = hf_layer(x)
        y, state = ours(x[:, :17])
        ys = [y]
        for t in range(17, 24):
            y, state = ours(x[:, t : t + 1], state)
            ys.append(y)
    assert _dist(torch.cat(ys, 1), ref) <= HF_TOL


def test_from_hf_copies_every_tensor(hf):
    hf_layer = _hf_layer(hf, "Hv=3Hk", seed=4)
    ours = GatedDeltaNet.from_hf(hf_layer)
    assert (ours.n_head, ours.n_v_head, ours.head_dim, ours.v_head_dim) == SHAPES["Hv=3Hk"]
    assert ours.norm_eps == hf_layer.norm.variance_epsilon and ours.conv_size == 4
    sd = hf_layer.state_dict()
    assert set(ours.state_dict()) == set(sd)
    for name, t in ours.state_dict().items():
        assert torch.equal(t, sd[name]), name
    with pytest.raises(RuntimeError, match="Missing key"):
        ours.load_hf_state_dict({k: v for k, v in sd.items() if k != "A_log"})


# -- the state -------------------------------------------------------------------------------------

def _layer(seed=0):
    torch.manual_seed(seed)
    return GatedDeltaNet(24, 2, 8, n_v_head=4, v_head_dim=6, chunk_size=16)


def test_decoding_token_by_token_equals_full_forward():
    m = _layer()
    x = _x(2, 21, 24, seed=11)
    with torch.no_grad():
        full, full_state = m(x)
        state, ys = None, []
        for t in range(x.shape[1]):
            y, state = m(x[:, t : t + 1], state)
            ys.append(y)
    assert _dist(torch.cat(ys, 1), full) <= STEP_TOL
    assert _dist(state.S, full_state.S) <= STEP_TOL
    for a, b in zip(state.conv, full_state.conv):
        assert _dist(a, b) <= STEP_TOL


@pytest.mark.parametrize("prefill", [1, 3, 16, 17])
def test_prefill_then_decoding_equals_full_forward(prefill):
    m = _layer()
    x = _x(1, 24, 24, seed=prefill)
    with torch.no_grad():
        full, _ = m(x)
        y, state = m(x[:, :prefill])
        ys = [y]
        for t in range(prefill, x.shape[1]):
            y, state = m(x[:, t : t + 1], state)
            ys.append(y)
    assert _dist(torch.cat(ys, 1), full) <= STEP_TOL


def test_pieces_of_any_size_and_the_state_is_not_modified():
    m = _layer()
    x = _x(2, 30, 24, seed=4)
    with torch.no_grad():
        full, _ = m(x)
        y1, s1 = m(x[:, :11])
        saved = [s1.S.clone(), *(c.clone() for c in s1.conv)]
        y2, s2 = m(x[:, 11:12], s1)
        y3, _ = m(x[:, 12:], s2)
        again, _ = m(x[:, 11:12], s1)
    assert _dist(torch.cat([y1, y2, y3], 1), full) <= STEP_TOL
    assert torch.equal(again, y2)
    for before, after in zip(saved, [s1.S, *s1.conv]):
        assert torch.equal(before, after)


def test_state_size_by_formula_and_measured():
    m = _layer()  # Hk = 2 of 8, Hv = 4 of 6, K = 4
    with torch.no_grad():
        _, state = m(_x(3, 5, 24))
    assert isinstance(state, GatedDeltaState) and isinstance(state.conv, ConvState)
    assert state.S.shape == (3, 4, 8, 6)
    assert [tuple(c.shape) for c in state.conv] == [(3, 16, 3), (3, 16, 3), (3, 24, 3)]
    numel = 3 * 4 * 8 * 6 + 3 * (16 + 16 + 24) * 3
    assert m.state_numel(3, 5) == m.state_numel(3, 10_000) == numel
    assert state_nbytes(state) == 4 * numel


# -- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"n_head": 2, "head_dim": 8},
    {"n_head": 2, "head_dim": 8, "n_v_head": 6, "v_head_dim": 4, "conv_size": 2},
    {"n_head": 3, "head_dim": 5, "n_v_head": 3, "conv_size": 1},
])
@pytest.mark.parametrize("d_model", [24, 7])
def test_parameter_count_formula(fields, d_model):
    cfg = mixer_config("gated_deltanet", **fields)
    m = cfg.build(d_model)
    assert isinstance(m, GatedDeltaNet) and m.config == cfg
    assert cfg.num_parameters(d_model) == sum(p.numel() for p in m.parameters())


def test_registered_and_the_released_size():
    """Qwen3-Next-80B-A3B's layer (transformers' Qwen3NextConfig defaults: d = 2048, 16 key
    heads, 32 value heads, 128 wide): the formula against a layer built on the meta device."""
    assert MIXER_CONFIGS["gated_deltanet"] is GatedDeltaNetConfig
    assert MIXERS["gated_deltanet"] is GatedDeltaNet
    cfg = GatedDeltaNetConfig(n_head=16, head_dim=128, n_v_head=32)
    with torch.device("meta"):
        m = cfg.build(2048)
    assert cfg.num_parameters(2048) == sum(p.numel() for p in m.parameters())
    assert cfg.state_numel(1) == 32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3


@pytest.mark.parametrize("fields,match", [
    ({"n_head": 2, "head_dim": 8, "n_v_head": 3}, "multiple of n_head"),
    ({"n_head": 2, "head_dim": 8, "conv_size": 0}, "conv_size must be >= 1"),
    ({"n_head": 2, "head_dim": 8, "norm_eps": -1.0}, "norm_eps must be a positive"),
    ({"n_head": 2, "head_dim": 0}, "head_dim must be a positive int"),
])
def test_bad_configurations_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        GatedDeltaNetConfig(**fields)
    with pytest.raises(ValueError, match=match):
        GatedDeltaNet(16, **fields)


def test_bad_inputs_raise():
    m = _layer()
    x = _x(2, 5, 24)
    with torch.no_grad():
        _, state = m(x)
        with pytest.raises(ValueError, match=r"\[B, T, d=24\]"):
            m(_x(2, 5, 16))
        with pytest.raises(ValueError, match="no tokens"):
            m(x[:, :0])
        with pytest.raises(TypeError, match="must be the GatedDeltaState"):
            m(x, tuple(state))
        with pytest.raises(ValueError, match=r"state.S must be \[B, HV, Dk, Dv\]"):
            m(x[:1], state)
        with pytest.raises(TypeError, match="must be the ConvState"):
            m(x, GatedDeltaState(state.S, state.conv.q))


def test_every_parameter_gets_a_gradient():
    m = _layer()
    y, _ = m(_x(2, 19, 24))
    y.square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name

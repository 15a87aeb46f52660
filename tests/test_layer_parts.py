"""tinyk3.layers' building blocks: the short convolution and its state, the mixer and MLP
configurations, and the registries through which later chapters add layer kinds."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from tinyk3.layers import (
    MIXER_CONFIGS,
    MIXERS,
    DeltaNet,
    DeltaNetConfig,
    GeluMLPConfig,
    LinearAttentionConfig,
    ShortConvolution,
    SoftmaxAttention,
    SoftmaxAttentionConfig,
    mixer_config,
    register_mixer,
)
from tinyk3.layers.conv import init_jointly_, short_convolutions
from tinyk3.layers.registry import MixerSpec

f64 = torch.float64


def _x(B=2, T=9, Ch=6, seed=0):
    return torch.randn(B, T, Ch, generator=torch.Generator().manual_seed(seed), dtype=f64)


def _conv(Ch=6, K=4, seed=0, **kw):
    torch.manual_seed(seed)
    return ShortConvolution(Ch, K, **kw).double()


# -- the short convolution ---------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["silu", None])
@torch.no_grad()
def test_short_convolution_is_the_causal_sum_over_the_last_k_inputs(bias, activation):
    conv = _conv(bias=bias, activation=activation)
    x = _x()
    y, state = conv(x)
    w = conv.weight[:, 0, :]  # [Ch, K]
    ref = torch.zeros_like(x)
    for t in range(x.shape[1]):  # y_t = act(b + Σ_i w_i x_{t-K+1+i}), zeros before the first token
        acc = conv.bias.clone() if bias else torch.zeros(6, dtype=f64)
        acc = acc.expand(2, 6).clone()
        for i in range(4):
            if t - 3 + i >= 0:
                acc += w[:, i] * x[:, t - 3 + i]
        ref[:, t] = torch.nn.functional.silu(acc) if activation else acc
    assert (y - ref).abs().max().item() <= 1e-13
    assert torch.equal(state, x[:, -3:].transpose(1, 2))  # the last K - 1 inputs, [B, Ch, K-1]
    assert conv.state_numel(2) == state.numel() == 2 * 6 * 3


@pytest.mark.parametrize("blocks", [[1] * 9, [2, 1, 6], [5, 4], [3, 3, 3]])
@torch.no_grad()
def test_short_convolution_fed_in_pieces_equals_one_pass(blocks):
    conv = _conv()
    x = _x()
    full, full_state = conv(x)
    outs, state, start = [], None, 0
    for n in blocks:
        kept = None if state is None else state.clone()
        y, new = conv(x[:, start : start + n], state)
        assert kept is None or torch.equal(state, kept)  # the state passed in is untouched
        outs.append(y)
        state, start = new, start + n
    assert (torch.cat(outs, 1) - full).abs().max().item() <= 1e-14
    assert torch.equal(state, full_state)


def test_short_convolution_with_one_tap_has_an_empty_state():
    conv = _conv(K=1)
    y, state = conv(_x())
    assert state.shape == (2, 6, 0) and conv.state_numel(2) == 0
    assert torch.allclose(y, torch.nn.functional.silu(_x() * conv.weight[:, 0, 0] + conv.bias))


def test_short_convolution_initialises_like_conv1d():
    torch.manual_seed(3)
    ours = ShortConvolution(12, 4)
    torch.manual_seed(3)
    ref = nn.Conv1d(12, 12, 4, groups=12)
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)
    assert ours.weight.shape == (12, 1, 4)  # fla's and Kimi Linear's *_conv1d.weight
    assert ShortConvolution(12, 4, bias=False).bias is None


def test_joint_initialisation_is_one_conv1d_over_all_channels_split():
    torch.manual_seed(4)
    convs = [ShortConvolution(8, 3, init=False) for _ in range(3)]
    init_jointly_(convs)
    after = torch.rand(4)
    torch.manual_seed(4)
    ref = nn.Conv1d(24, 24, 3, groups=24)  # the fused convolution the library had before
    assert torch.equal(torch.cat([c.weight for c in convs]), ref.weight)
    assert torch.equal(torch.cat([c.bias for c in convs]), ref.bias)
    assert torch.equal(after, torch.rand(4))  # and the random stream continues the same way
    with pytest.raises(ValueError, match="share kernel_size"):
        init_jointly_([ShortConvolution(2, 3), ShortConvolution(2, 4)])


def test_several_convolutions_in_one_call_equal_each_module_alone():
    torch.manual_seed(5)
    convs = [ShortConvolution(c, 4) for c in (4, 4, 6)]
    x = torch.randn(2, 7, 14, requires_grad=True)
    y, states = short_convolutions(convs, x)
    parts = x.split([4, 4, 6], dim=2)
    alone = [c(p) for c, p in zip(convs, parts)]
    assert (y - torch.cat([a for a, _ in alone], dim=2)).abs().max().item() <= 1e-6
    assert all(torch.equal(s, a) for s, (_, a) in zip(states, alone))  # the inputs, copied
    _, first = short_convolutions(convs, x[:, :5])
    y2, _ = short_convolutions(convs, x[:, 5:], first)
    assert (y2 - y[:, 5:]).abs().max().item() <= 1e-6  # and it continues from its states
    y.square().sum().backward()
    assert x.grad is not None and all(c.weight.grad is not None for c in convs)
    with pytest.raises(ValueError, match=r"x must be \[B, T, 14\]"):
        short_convolutions(convs, x[..., :6])


def test_short_convolution_errors():
    conv = _conv()
    with pytest.raises(ValueError, match=r"x must be \[B, T, 6\]"):
        conv(_x(Ch=5))
    with pytest.raises(ValueError, match=r"state must be \[B, channels, K-1\] = \[2, 6, 3\]"):
        conv(_x(), torch.zeros(2, 6, 2, dtype=f64))
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="kernel_size must be a positive int"):
            ShortConvolution(4, bad)
    with pytest.raises(ValueError, match="activation"):
        ShortConvolution(4, 2, activation="relu")


# -- configurations and registries -------------------------------------------------------------

def test_the_three_mixer_kinds_are_registered():
    assert {"softmax": SoftmaxAttentionConfig, "linear": LinearAttentionConfig,
            "deltanet": DeltaNetConfig}.items() <= MIXER_CONFIGS.items()
    assert MIXERS["deltanet"] is DeltaNet and MIXERS["softmax"] is SoftmaxAttention
    spec = mixer_config("deltanet", n_head=2, conv_size=4)
    assert spec == DeltaNetConfig(n_head=2, conv_size=4)
    layer = spec.build(16)
    assert isinstance(layer, DeltaNet) and (layer.n_head, layer.conv_size) == (2, 4)
    assert sum(p.numel() for p in layer.parameters()) == spec.num_parameters(16)
    with pytest.raises(ValueError, match="unknown mixer 'mamba'"):
        mixer_config("mamba", n_head=2)


@pytest.mark.parametrize("spec,d_model", [
    (SoftmaxAttentionConfig(n_head=3), 24),
    (SoftmaxAttentionConfig(n_head=1, conv_size=2), 8),
    (LinearAttentionConfig(n_head=2, feature_map="taylor2", normalize=False), 16),
    (LinearAttentionConfig(n_head=4, conv_size=4), 32),
    (DeltaNetConfig(n_head=2), 16),
    (DeltaNetConfig(n_head=4, conv_size=3), 32),
])
def test_mixer_parameter_formula_equals_the_built_layer(spec, d_model):
    layer = spec.build(d_model)
    assert sum(p.numel() for p in layer.parameters()) == spec.num_parameters(d_model)


@pytest.mark.parametrize("ratio,d_model", [(4, 16), (1, 7), (3, 24)])
def test_mlp_parameter_formula_equals_the_built_layer(ratio, d_model):
    spec = GeluMLPConfig(ratio=ratio)
    assert sum(p.numel() for p in spec.build(d_model).parameters()) == spec.num_parameters(d_model)


@pytest.mark.parametrize("make,match", [
    (lambda: DeltaNetConfig(n_head=True), "n_head must be a positive int"),
    (lambda: DeltaNetConfig(n_head=0), "n_head must be a positive int"),
    (lambda: SoftmaxAttentionConfig(n_head=2, conv_size=-1), "conv_size must be a non-negative int"),
    (lambda: SoftmaxAttentionConfig(n_head=2, conv_size=True), "conv_size must be a non-negative int"),
    (lambda: GeluMLPConfig(ratio=True), "ratio must be a positive int"),
    (lambda: LinearAttentionConfig(n_head=2, feature_map="gelu"), "unknown feature_map 'gelu'"),
    (lambda: SoftmaxAttentionConfig(n_head=3).build(16), r"d_model \(16\) must be divisible by n_head \(3\)"),
])
def test_bad_layer_configurations_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_configurations_are_frozen_values():
    spec = DeltaNetConfig(n_head=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.n_head = 3
    assert dataclasses.replace(spec, conv_size=4) == DeltaNetConfig(n_head=2, conv_size=4)
    assert hash(spec) == hash(DeltaNetConfig(n_head=2))


def test_a_new_mixer_kind_is_a_registered_module():
    """The extension point of Parts IV-V: a new kind needs a module and a config, nothing else."""

    class Identity(nn.Module):  # a mixer that passes x through and keeps no state
        def __init__(self, d_model, scale):
            super().__init__()
            self.scale = nn.Parameter(torch.full((d_model,), float(scale)))

        def forward(self, x, state=None):
            return x * self.scale, None

    @dataclasses.dataclass(frozen=True)
    class IdentityConfig(MixerSpec):
        scale: int = 1
        kind = "test-identity"
        module = Identity

        def check(self, d_model):
            pass

        def num_parameters(self, d_model):
            return d_model

    register_mixer(IdentityConfig)
    try:
        from tinyk3.models import LM, LMConfig, count_parameters

        config = LMConfig(vocab_size=11, block_size=8, n_embd=8, pattern="IA",
                          mixers={"I": IdentityConfig(scale=2), "A": SoftmaxAttentionConfig(2)})
        model = LM(config)
        assert isinstance(model.transformer.h[0].attn, Identity)
        assert count_parameters(config).total == model.num_parameters()
        idx = torch.randint(0, 11, (1, 6), generator=torch.Generator().manual_seed(0))
        cache = model.new_cache()
        with torch.no_grad():
            pieces = torch.cat([model(idx[:, :4], cache=cache), model(idx[:, 4:], cache=cache)], 1)
            assert (pieces - model(idx)).abs().max().item() <= 1e-5
        with pytest.raises(ValueError, match="taken"):
            register_mixer(IdentityConfig)
    finally:
        MIXER_CONFIGS.pop("test-identity"), MIXERS.pop("test-identity")

"""The KDA layer (chapter 12), :class:`tinyk3.layers.KimiDeltaAttention`.

Oracles: ``transformers``' ``KimiLinearDeltaAttention`` (``models/kimi_linear``) at a tiny
random configuration with the same weights (Kimi Linear's form: softplus gate, low-rank output
gate, no GVA); and, for what ``transformers`` does not have (Kimi K3's lower-bound gate and
full-rank output gate, grouped value heads), a token loop written here from the equations, in
float64. fla and causal_conv1d are hidden while the modelling module is imported (with fla
installed, transformers binds its Triton kernels, which fail on CPU).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import import_without_fla
from tinyk3.layers import (
    MIXER_CONFIGS,
    MIXERS,
    ConvState,
    KDAConfig,
    KDAState,
    KimiDeltaAttention,
    mixer_config,
    state_nbytes,
)
from tinyk3.util import randomise_

HF_TOL = 1e-4  # float32, ours against transformers' (measured 3e-7 to 6e-6, outputs ≈ 2)
LOOP_TOL = 1e-10  # float64, ours against the token loop written here
STEP_TOL = 1e-5  # float32, decoding against the full forward (measured ≤ 5e-7)


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    kl = import_without_fla("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig
    return kl, KimiLinearConfig


def _hf_layer(hf, *, d=32, H=2, D=8, K=4, eps=1e-5, seed=0):
    """A ``KimiLinearDeltaAttention`` with every parameter random (A_log, dt_bias are left
    uninitialised by its constructor): gates that decay strongly and weakly, a norm weight ≠ 1."""
    kl, Config = hf
    cfg = Config(hidden_size=d, num_hidden_layers=1, num_attention_heads=2, rms_norm_eps=eps,
                 layer_types=["linear_attention"],
                 linear_attn_config={"head_dim": D, "num_heads": H, "short_conv_kernel_size": K})
    layer = kl.KimiLinearDeltaAttention(cfg, layer_idx=0).float().eval()
    return randomise_(layer, seed, decay=(1, 16))  # dt ≈ softplus(−3 ± 1)


def _x(B, T, d, seed=1, dtype=torch.float32):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _dist(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# -- transformers' layer ---------------------------------------------------------------------------

@pytest.mark.parametrize("T,chunk_size", [(70, 64), (45, 16), (1, 64)])
def test_equals_transformers_layer(hf, T, chunk_size):
    """Same weights, same output: T not a multiple of the chunk size; a single token (the
    recurrent step on our side, transformers' chunk form on its)."""
    hf_layer = _hf_layer(hf, seed=T)
    ours = KimiDeltaAttention.from_hf(hf_layer, chunk_size=chunk_size)
    x = _x(2, T, 32, seed=T)
    with torch.no_grad():
        ref = hf_layer(x)
        y, state = ours(x)
    assert y.shape == ref.shape and ref.abs().max() > 0.1  # a signal, not zeros
    assert _dist(y, ref) <= HF_TOL
    assert state.S.shape == (2, 2, 8, 8)


def test_equals_transformers_decoding_through_its_cache(hf):
    """Prefill then one-token steps through our state equal transformers' full forward."""
    hf_layer = _hf_layer(hf, seed=3)
    ours = KimiDeltaAttention.from_hf(hf_layer)
    x = _x(1, 20, 32, seed=3)
    with torch.no_grad():
        ref = hf_layer(x)
        y, state = ours(x[:, :13])
        ys = [y]
        for t in range(13, 20):
            y, state = ours(x[:, t : t + 1], state)
            ys.append(y)
    assert _dist(torch.cat(ys, 1), ref) <= HF_TOL


def test_from_hf_copies_every_tensor_and_takes_checkpoint_names(hf):
    hf_layer = _hf_layer(hf, seed=5)
    ours = KimiDeltaAttention.from_hf(hf_layer)
    assert (ours.d_model, ours.n_head, ours.head_dim, ours.conv_size) == (32, 2, 8, 4)
    assert ours.norm_eps == hf_layer.o_norm.variance_epsilon and ours.gate_rank == 8
    sd = hf_layer.state_dict()
    assert torch.equal(ours.A_log, sd["forget_gate.A_log"].view(-1))
    assert torch.equal(ours.dt_bias, sd["forget_gate.dt_bias"])
    conv = torch.cat([ours.q_conv1d.weight, ours.k_conv1d.weight, ours.v_conv1d.weight])
    assert torch.equal(conv, sd["conv1d.weight"])
    # the published checkpoint's names: separate convolutions, no forget_gate. prefix
    ckpt = {k.removeprefix("forget_gate."): v for k, v in sd.items() if k != "conv1d.weight"}
    for name, w in zip(("q", "k", "v"), sd["conv1d.weight"].split(16)):
        ckpt[f"{name}_conv1d.weight"] = w
    other = KimiDeltaAttention(32, 2, 8, gate_rank=8)
    other.load_hf_state_dict(ckpt)
    x = _x(1, 9, 32)
    with torch.no_grad():
        assert torch.equal(other(x)[0], ours(x)[0])
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_hf_state_dict({k: v for k, v in ckpt.items() if k != "b_proj.weight"})


# -- a token loop, for the forms transformers does not have ------------------------------------------

def token_loop(m: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer token by token in float64, from the equations (not from the library)."""
    P = {n: p.detach().double() for n, p in m.named_parameters()}
    x = x.double()
    B, T, _ = x.shape
    H, HV, Dk, Dv, K = m.n_head, m.n_v_head, m.head_dim, m.v_head_dim, m.conv_size
    W = torch.cat([P["q_proj.weight"], P["k_proj.weight"], P["v_proj.weight"]])  # [C, d]
    w_conv = torch.cat([P[f"{n}_conv1d.weight"] for n in "qkv"])[:, 0, :]  # [C, K], oldest first
    head_of = torch.arange(HV) // (HV // H)  # the key head serving each value head
    A = P["A_log"].exp()[:, None]  # [HV, 1]
    dt_bias = P["dt_bias"].view(HV, Dk)
    S = x.new_zeros(B, HV, Dk, Dv)
    past = x.new_zeros(B, K - 1, W.shape[0])
    ys = []
    for t in range(T):
        xt = x[:, t]
        window = torch.cat([past, (xt @ W.T)[:, None]], dim=1)  # the last K projected tokens
        past = window[:, 1:]
        c = F.silu((window * w_conv.T).sum(1))  # [B, C]
        q, k, v = c.split([H * Dk, H * Dk, HV * Dv], dim=1)
        q, k, v = q.view(B, H, Dk), k.view(B, H, Dk), v.view(B, HV, Dv)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(Dk)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q, k = q[:, head_of], k[:, head_of]  # [B, HV, Dk]
        f = (xt @ P["f_a_proj.weight"].T @ P["f_b_proj.weight"].T).view(B, HV, Dk) + dt_bias
        if m.gate == "softplus":
            g = -A * torch.log1p(torch.exp(f))
        else:
            g = -5.0 * torch.sigmoid(A * f)
        beta = torch.sigmoid(xt @ P["b_proj.weight"].T)  # [B, HV]
        S = torch.exp(g)[..., None] * S  # Diag(exp(g_t)) S_{t−1}
        err = v - torch.einsum("bhk,bhkv->bhv", k, S)  # v_t − k_t S
        S = S + beta[..., None, None] * k[..., None] * err[:, :, None, :]
        o = torch.einsum("bhk,bhkv->bhv", q, S)  # [B, HV, Dv]
        if m.output_gate == "low_rank":
            u = xt @ P["g_a_proj.weight"].T @ P["g_b_proj.weight"].T
        else:
            u = xt @ P["g_proj.weight"].T
        o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + m.norm_eps) * P["o_norm.weight"]
        o = o * torch.sigmoid(u.view(B, HV, Dv))
        ys.append(o.reshape(B, HV * Dv) @ P["o_proj.weight"].T)
    return torch.stack(ys, 1)


LOOP_CASES = {  # (gate, output_gate, n_v_head, v_head_dim, gate_rank)
    "K3": ("lower_bound", "full", 0, 0, 0),
    "K3-GVA": ("lower_bound", "full", 4, 0, 0),
    "KimiLinear-GVA-Dv": ("softplus", "low_rank", 4, 6, 5),
    "lower-bound-low-rank": ("lower_bound", "low_rank", 0, 0, 3),
}


def _random_layer(gate, output_gate, n_v_head, v_head_dim, gate_rank, seed=0, **kw):
    torch.manual_seed(seed)
    m = KimiDeltaAttention(24, 2, 8, n_v_head=n_v_head, v_head_dim=v_head_dim, gate=gate,
                           output_gate=output_gate, gate_rank=gate_rank, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # A_log = 0 at init for the lower-bound gate: make the gates vary
        m.A_log.copy_(torch.empty(m.n_v_head).uniform_(-1, 2.5, generator=gen))
        m.dt_bias.add_(torch.randn(m.dt_bias.shape, generator=gen))
        m.o_norm.weight.add_(0.2 * torch.randn(m.o_norm.weight.shape, generator=gen))
    return m


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_equals_token_loop(case):
    """float64: ours (chunked prefill at T = 37, chunk 16) against the loop."""
    m = _random_layer(*LOOP_CASES[case], chunk_size=16).double()
    x = _x(2, 37, 24, seed=7, dtype=torch.float64)
    with torch.no_grad():
        y, _ = m(x)
    ref = token_loop(m, x)
    assert ref.abs().max() > 0.1
    assert _dist(y, ref) <= LOOP_TOL


def test_lower_bound_gate_range_and_float32_prefill():
    """K3's gate stays in [−5, 0); at the strongest decays float32 chunked prefill stays finite
    and close to the float64 loop (every chunk size the op accepts by contract)."""
    m = _random_layer("lower_bound", "full", 0, 0, 0)
    with torch.no_grad():
        m.A_log.fill_(1.5)  # about half the gates saturate at −5, a quarter above −1
        gen = torch.Generator().manual_seed(0)
        m.dt_bias.copy_(2 * torch.randn(m.dt_bias.shape, generator=gen) + 1)
        x = _x(1, 80, 24, seed=2)
        g = m.log_decay(x)  # −5 itself in float32 where the sigmoid rounds to 1
        assert g.min() >= -5 and g.max() < 0
        assert (g < -4.9).float().mean() > 0.4 and (g > -1).float().mean() > 0.2
        ref = token_loop(m, x)
        for C in (16, 32, 64):
            m.chunk_size = C
            y, _ = m(x)
            assert torch.isfinite(y).all() and _dist(y, ref) <= 1e-4


# -- the state: decoding and prefill ---------------------------------------------------------------

CASES = ["KimiLinear", "K3-GVA"]


def _case_layer(case):
    if case == "KimiLinear":
        return _random_layer("softplus", "low_rank", 0, 0, 0, chunk_size=16)
    return _random_layer("lower_bound", "full", 4, 0, 0, chunk_size=16)


@pytest.mark.parametrize("case", CASES)
def test_decoding_token_by_token_equals_full_forward(case):
    m = _case_layer(case)
    x = _x(2, 21, 24, seed=11)
    with torch.no_grad():
        full, full_state = m(x)
        state, ys = None, []
        for t in range(x.shape[1]):
            y, state = m(x[:, t : t + 1], state)
            ys.append(y)
    assert _dist(torch.cat(ys, 1), full) <= STEP_TOL
    assert _dist(state.S, full_state.S) <= STEP_TOL
    for a, b in zip(state.conv, full_state.conv):  # the same inputs, projected one by one
        assert _dist(a, b) <= STEP_TOL


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prefill", [1, 3, 16, 17])
def test_prefill_then_decoding_equals_full_forward(case, prefill):
    m = _case_layer(case)
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
    m = _case_layer("K3-GVA")
    x = _x(2, 30, 24, seed=4)
    with torch.no_grad():
        full, _ = m(x)
        y1, s1 = m(x[:, :11])
        saved = [s1.S.clone(), *(c.clone() for c in s1.conv)]
        y2, s2 = m(x[:, 11:12], s1)
        y3, _ = m(x[:, 12:], s2)
        again, _ = m(x[:, 11:12], s1)  # the same state again: the same output
    assert _dist(torch.cat([y1, y2, y3], 1), full) <= STEP_TOL
    assert torch.equal(again, y2)
    for before, after in zip(saved, [s1.S, *s1.conv]):
        assert torch.equal(before, after)


def test_state_size_by_formula_and_measured():
    m = _case_layer("K3-GVA")  # H = 2 key heads, HV = 4 value heads of 8, K = 4
    with torch.no_grad():
        _, state = m(_x(3, 5, 24))
    assert isinstance(state, KDAState) and isinstance(state.conv, ConvState)
    assert state.S.shape == (3, 4, 8, 8) and state.S.dtype == torch.float32
    assert [tuple(c.shape) for c in state.conv] == [(3, 16, 3), (3, 16, 3), (3, 32, 3)]
    numel = 3 * 4 * 8 * 8 + 3 * (16 + 16 + 32) * 3
    assert m.state_numel(3, 5) == m.state_numel(3, 10_000) == numel
    assert state_nbytes(state) == 4 * numel


# -- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"n_head": 2, "head_dim": 8},
    {"n_head": 2, "head_dim": 8, "gate": "lower_bound", "output_gate": "full"},
    {"n_head": 2, "head_dim": 8, "n_v_head": 6, "v_head_dim": 4, "gate_rank": 3, "conv_size": 2},
    {"n_head": 3, "head_dim": 5, "n_v_head": 3, "output_gate": "full", "conv_size": 1},
])
@pytest.mark.parametrize("d_model", [24, 7])
def test_parameter_count_formula(fields, d_model):
    cfg = mixer_config("kda", **fields)
    m = cfg.build(d_model)
    assert isinstance(m, KimiDeltaAttention) and m.config == cfg
    assert cfg.num_parameters(d_model) == sum(p.numel() for p in m.parameters())


def test_registered_and_sizes_of_the_released_models():
    """Kimi Linear 48B (d = 2304, 32 heads of 128) and Kimi K3 (d = 7168, 96 heads of 128, the
    K3 gates; their released configs): the formula against a layer built on the meta device (no memory)."""
    assert MIXER_CONFIGS["kda"] is KDAConfig and MIXERS["kda"] is KimiDeltaAttention
    kimi = KDAConfig(n_head=32, head_dim=128)
    k3 = KDAConfig(n_head=96, head_dim=128, gate="lower_bound", output_gate="full")
    for cfg, d in ((kimi, 2304), (k3, 7168)):
        with torch.device("meta"):
            m = cfg.build(d)
        assert cfg.num_parameters(d) == sum(p.numel() for p in m.parameters())
    assert kimi.state_numel(1) == 32 * 128 * 128 + 3 * 32 * 128 * 3
    assert k3.state_numel(1) == 96 * 128 * 128 + 3 * 96 * 128 * 3


@pytest.mark.parametrize("fields,match", [
    ({"n_head": 2, "head_dim": 8, "n_v_head": 3}, "multiple of n_head"),
    ({"n_head": 2, "head_dim": 8, "gate": "sigmoid"}, "gate must be one of"),
    ({"n_head": 2, "head_dim": 8, "output_gate": "rank1"}, "output_gate must be one of"),
    ({"n_head": 2, "head_dim": 8, "conv_size": 0}, "conv_size must be >= 1"),
    ({"n_head": 2, "head_dim": 8, "norm_eps": 0.0}, "norm_eps must be a positive"),
    ({"n_head": 0, "head_dim": 8}, "n_head must be a positive int"),
    ({"n_head": 2, "head_dim": 8, "chunk_size": 0}, "chunk_size must be a positive int"),
])
def test_bad_configurations_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        KDAConfig(**fields)
    with pytest.raises(ValueError, match=match):
        KimiDeltaAttention(16, **fields)


def test_bad_inputs_raise():
    m = _case_layer("KimiLinear")
    x = _x(2, 5, 24)
    with torch.no_grad():
        _, state = m(x)
        with pytest.raises(ValueError, match=r"\[B, T, d=24\]"):
            m(_x(2, 5, 16))
        with pytest.raises(ValueError, match=r"\[B, T, d=24\]"):
            m(x[0])
        with pytest.raises(ValueError, match="no tokens"):
            m(x[:, :0])
        with pytest.raises(TypeError, match="floating-point"):
            m(torch.ones(2, 5, 24, dtype=torch.long))
        with pytest.raises(TypeError, match="must be the KDAState"):
            m(x, (state.S, state.conv))
        with pytest.raises(ValueError, match=r"state.S must be \[B, HV, Dk, Dv\]"):
            m(x[:1], state)  # a state of batch 2 for a batch of 1
        with pytest.raises(TypeError, match="must be the ConvState"):
            m(x, KDAState(state.S, None))
        with pytest.raises(ValueError, match="the state must be"):
            m(x, KDAState(state.S, ConvState(*(c[..., :1] for c in state.conv))))


@pytest.mark.parametrize("case", CASES)
def test_every_parameter_gets_a_gradient(case):
    m = _case_layer(case)
    y, _ = m(_x(2, 19, 24))
    y.square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name

"""tinyk3.layers: three token mixers, one interface; decoding from a state equals one full pass.

Each mixer is also checked against a reference written here from the paper's equations, in
the papers' own layout where they differ from ours (DeltaNet's ``S ∈ R^{Dv×Dk}``, ``o = S q``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tinyk3.gpt2 import CausalSelfAttention, GPTConfig
from tinyk3.layers import (
    MIXERS,
    ConvState,
    DeltaNet,
    DeltaState,
    KVState,
    LinearAttention,
    LinearState,
    SoftmaxAttention,
    state_nbytes,
)
from tinyk3.ops import delta_rule
from tinyk3.ops.feature_maps import FEATURE_MAPS

C, H = 16, 2
D = C // H
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
KINDS = ["softmax", "linear", "deltanet"]


def _layer(kind, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return MIXERS[kind](C, H, **kw).to(dtype)


def _x(B=2, T=12, dtype=torch.float32, seed=1):
    return torch.randn(B, T, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _fed(layer, x, blocks):
    """Run ``x`` through ``layer`` in blocks of the given sizes, carrying the state."""
    assert sum(blocks) == x.shape[1]
    outs, state, start = [], None, 0
    for n in blocks:
        y, state = layer(x[:, start : start + n], state)
        outs.append(y)
        start += n
    return torch.cat(outs, dim=1), state


def _clone(state):
    """A deep copy of a state (a NamedTuple of tensors, None and nested NamedTuples)."""
    if state is None or isinstance(state, torch.Tensor):
        return None if state is None else state.clone()
    return type(state)(*(_clone(s) for s in state))


def _equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def _flat(state):
    """The tensors of a state, in order (None fields skipped)."""
    if state is None:
        return []
    if isinstance(state, torch.Tensor):
        return [state]
    return [t for s in state for t in _flat(s)]


# -- decoding from a state equals the full pass ------------------------------------------

BLOCKS = {"1x12": [1] * 12, "5+1x7": [5] + [1] * 7, "3+4+5": [3, 4, 5], "12": [12], "1+11": [1, 11]}


@pytest.mark.parametrize("blocks", BLOCKS.values(), ids=BLOCKS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_state_continues_the_sequence(kind, dtype, blocks):
    layer = _layer(kind, dtype)
    x = _x(dtype=dtype)
    full, full_state = layer(x)
    got, state = _fed(layer, x, blocks)
    assert got.shape == full.shape == x.shape and got.dtype == dtype
    err = (got - full).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, full.abs().max().item()), f"{kind} {blocks}: max abs error {err:.3g}"
    # the final state does not depend on how the sequence was cut either
    assert type(state) is type(full_state) is layer.State
    assert len(_flat(state)) == len(_flat(full_state)) > 0
    for a, b in zip(_flat(state), _flat(full_state), strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= TOL[dtype] * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_state_is_never_modified_and_can_be_branched(kind):
    layer = _layer(kind)
    x = _x(T=10)
    _, state = layer(x[:, :6])
    kept = _clone(state)
    y_a, _ = layer(x[:, 6:], state)  # continue one way ...
    assert _equal(state, kept), "the state passed in was modified"
    other = _x(T=4, seed=9)
    layer(other, state)  # ... and another ...
    y_b, _ = layer(x[:, 6:], state)  # ... then the first way again, from the same state
    assert _equal(state, kept)
    assert torch.equal(y_a, y_b)


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_causal_future_tokens_leave_the_past_unchanged(kind):
    layer = _layer(kind, torch.float64)
    x = _x(T=10, dtype=torch.float64)
    y, _ = layer(x)
    for t in (0, 4, 8):
        x2 = x.clone()
        x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])
        y2, _ = layer(x2)
        assert (y2[:, : t + 1] - y[:, : t + 1]).abs().max().item() <= 1e-14
        assert (y2[:, t + 1] - y[:, t + 1]).abs().max().item() > 1e-3  # the change does arrive


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_every_parameter(kind):
    layer = _layer(kind)
    x = _x(T=6).requires_grad_()
    y, _ = layer(x)
    y.square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()


# -- each mixer against a reference written from the paper ---------------------------------

@torch.no_grad()
def test_softmax_attention_is_gpt2_attention():
    layer = _layer("softmax")
    gpt_attn = CausalSelfAttention(GPTConfig(vocab_size=8, block_size=16, n_layer=1, n_head=H, n_embd=C))
    sd = layer.state_dict()  # GPT-2's c_attn is q_proj, k_proj, v_proj stacked; c_proj is o_proj
    gpt_attn.load_state_dict({
        "c_attn.weight": torch.cat([sd[f"{n}_proj.weight"] for n in "qkv"]),
        "c_attn.bias": torch.cat([sd[f"{n}_proj.bias"] for n in "qkv"]),
        "c_proj.weight": sd["o_proj.weight"], "c_proj.bias": sd["o_proj.bias"]})
    x = _x(T=12)
    y, state = layer(x)
    assert torch.equal(y, gpt_attn(x))
    assert isinstance(state, KVState) and state.conv is None
    assert state.k.shape == state.v.shape == (2, H, 12, D)  # the KV cache, [B, H, T, D]


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("fmap", sorted(FEATURE_MAPS))
@torch.no_grad()
def test_linear_attention_matches_the_sum_over_past_tokens(fmap, normalize):
    """o_t = Σ_{j≤t} (φ(q_t)·φ(k_j)) v_j  [/ Σ_{j≤t} φ(q_t)·φ(k_j)], written as a double loop."""
    layer = _layer("linear", torch.float64, feature_map=fmap, normalize=normalize)
    x = _x(B=1, T=7, dtype=torch.float64)
    y, state = layer(x)
    q, k, v = layer.project(x)  # [1, T, C] each
    phi = FEATURE_MAPS[fmap]
    scale = D ** -0.25 if fmap == "taylor2" else 1.0
    heads = []
    for h in range(H):
        sl = slice(h * D, (h + 1) * D)
        fq, fk, vh = phi(q[0, :, sl] * scale), phi(k[0, :, sl] * scale), v[0, :, sl]  # [T, Dk], [T, D]
        rows = []
        for t in range(7):
            w = torch.stack([fq[t] @ fk[j] for j in range(t + 1)])  # [t+1]
            o = (w[:, None] * vh[: t + 1]).sum(0)
            rows.append(o / (w.sum() + 1e-6) if normalize else o)
        heads.append(torch.stack(rows))  # [T, D]
    ref = layer.o_proj(torch.cat(heads, dim=-1))[None]  # [1, T, C]
    assert (y - ref).abs().max().item() <= 1e-10 * max(1.0, ref.abs().max().item())
    assert isinstance(state, LinearState) and state.conv is None
    assert state.S.shape == (1, H, layer.feature_dim, D)
    assert layer.feature_dim == (1 + D + D * D if fmap == "taylor2" else D)
    if normalize:
        assert state.z.shape == (1, H, layer.feature_dim)
    else:
        assert state.z is None


@torch.no_grad()
def test_deltanet_matches_the_paper_layout_reference():
    """Yang et al. (2024) write S ∈ R^{Dv×Dk}: S_t = S_{t-1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,
    o_t = S_t q_t, with q, k = L2-normalised SiLU features and β_t = σ(W_β x_t)."""
    layer = _layer("deltanet", torch.float64)
    x = _x(B=1, T=9, dtype=torch.float64)
    y, state = layer(x)
    S_ours = state.S
    q, k, v = layer.project(x)  # [1, T, C] each
    beta = torch.sigmoid(layer.b_proj(x))[0]  # [T, H]
    heads, finals = [], []
    for h in range(H):
        sl = slice(h * D, (h + 1) * D)
        S = torch.zeros(D, D, dtype=torch.float64)  # [Dv, Dk]
        rows = []
        for t in range(9):
            q_t = F.silu(q[0, t, sl]) / F.silu(q[0, t, sl]).norm()
            k_t = F.silu(k[0, t, sl]) / F.silu(k[0, t, sl]).norm()
            b = beta[t, h]
            I = torch.eye(D, dtype=torch.float64)
            S = S @ (I - b * torch.outer(k_t, k_t)) + b * torch.outer(v[0, t, sl], k_t)
            rows.append(S @ q_t)
        heads.append(torch.stack(rows))
        finals.append(S)
    ref = layer.o_proj(torch.cat(heads, dim=-1))[None]
    assert (y - ref).abs().max().item() <= 1e-12
    # our state is the transpose: [B, H, Dk, Dv]
    assert S_ours.shape == (1, H, D, D)
    assert (S_ours[0] - torch.stack(finals).transpose(-1, -2)).abs().max().item() <= 1e-12


def test_deltanet_passes_unit_keys_and_beta_per_head_and_token_to_its_op():
    seen = {}

    def spy(q, k, v, beta, *, initial_state=None):
        seen.update(q=q, k=k, v=v, beta=beta, initial_state=initial_state)
        return delta_rule.recurrent(q, k, v, beta, initial_state=initial_state)

    torch.manual_seed(0)
    layer = DeltaNet(C, H, op=spy)
    x = _x(B=3, T=5)
    layer(x)
    assert seen["q"].shape == seen["k"].shape == seen["v"].shape == (3, H, 5, D)
    assert seen["beta"].shape == (3, H, 5)  # [B, H, T]
    assert ((seen["beta"] > 0) & (seen["beta"] < 1)).all()
    torch.testing.assert_close(seen["k"].norm(dim=-1), torch.ones(3, H, 5))
    torch.testing.assert_close(seen["q"].norm(dim=-1), torch.ones(3, H, 5))
    assert seen["initial_state"] is None
    # β for head h and token t comes from b_proj's row h applied to x_t
    expected = torch.sigmoid(x[1, 3] @ layer.b_proj.weight[1] + layer.b_proj.bias[1])
    torch.testing.assert_close(seen["beta"][1, 1, 3], expected)


def test_linear_attention_uses_the_recurrent_op_for_one_token(monkeypatch):
    from tinyk3.ops import linear_attention as ops

    calls = []
    for name in ("recurrent", "parallel"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    layer = _layer("linear")
    _, state = layer(_x(T=4))
    layer(_x(T=1), state)
    layer(_x(T=3), state)
    assert calls == ["parallel", "recurrent", "parallel"]


# -- state size ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_state_bytes_measured_equal_formula(kind, dtype):
    layer = _layer(kind, dtype)
    B, sizes, state, T = 3, [], None, 0
    for n in (4, 1, 1, 6):
        _, state = layer(_x(B=B, T=n, dtype=dtype), state)
        T += n
        nbytes = layer.state_nbytes(state)
        assert nbytes == state_nbytes(state)
        # the ops keep fixed states in float32 at least; the KV cache has the model's dtype
        assert nbytes == layer.state_numel(B, T) * dtype.itemsize
        sizes.append(nbytes)
    if kind == "softmax":
        assert sizes == [2 * B * C * T * dtype.itemsize for T in (4, 5, 6, 12)]  # grows with T
    else:
        assert len(set(sizes)) == 1  # fixed, whatever the length
    assert {"softmax": 2 * B * 12 * C, "linear": B * H * (D * D + D), "deltanet": B * H * D * D}[kind] == \
        layer.state_numel(B, 12)


def test_state_nbytes_of_nested_states():
    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64)
    assert state_nbytes(None) == 0
    assert state_nbytes(a) == 24
    assert state_nbytes((a, b)) == 24 + 32
    assert state_nbytes([a, (b, None)]) == 56
    with pytest.raises(TypeError, match="tensor, None or a tuple"):
        state_nbytes({"S": a})


# -- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [SoftmaxAttention, LinearAttention, DeltaNet])
def test_bad_sizes_are_refused(cls):
    with pytest.raises(ValueError, match=r"divisible by n_head"):
        cls(10, 3)
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        cls(0, 1)
    with pytest.raises(ValueError, match="n_head must be a positive int"):
        cls(8, 2.0)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_inputs_are_refused(kind):
    layer = _layer(kind)
    with pytest.raises(ValueError, match=r"\[B, T, d=16\]"):
        layer(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"\[B, T, d=16\]"):
        layer(torch.randn(5, C))
    with pytest.raises(ValueError, match="no tokens"):
        layer(torch.randn(2, 0, C))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer([[0.0] * C])
    _, state = layer(_x(B=2, T=3))
    with pytest.raises((ValueError, TypeError)):
        layer(_x(B=1, T=1), state)  # batch of 1 against a state for 2


def test_softmax_attention_state_errors():
    layer = _layer("softmax")
    _, (k, v, _) = layer(_x(B=2, T=3))
    with pytest.raises(TypeError, match="must be the KVState this layer returned, got Tensor"):
        layer(_x(T=1), k)
    with pytest.raises(TypeError, match="must be the KVState this layer returned, got tuple"):
        layer(_x(T=1), (k, v))
    with pytest.raises(ValueError, match=r"cached k must be \[B=2, H=2, T, D=8\]"):
        layer(_x(T=1), KVState(k[:1], v))
    with pytest.raises(ValueError, match="differ in length"):
        layer(_x(T=1), KVState(k, v[:, :, :2]))
    with pytest.raises(TypeError, match="float64"):
        layer(_x(T=1), KVState(k.double(), v.double()))
    with pytest.raises(ValueError, match="has no convolution"):
        layer(_x(T=1), KVState(k, v, ConvState(k, k, k)))


def test_linear_attention_state_errors():
    layer = _layer("linear")
    with pytest.raises(ValueError, match="unknown feature map 'gelu'"):
        LinearAttention(C, H, feature_map="gelu")
    _, (S, z, _) = layer(_x(B=2, T=3))
    with pytest.raises(TypeError, match="must be the LinearState"):
        layer(_x(T=1), S)
    with pytest.raises(ValueError, match="shape"):
        layer(_x(T=2), LinearState(S[:, :1], z[:, :1]))
    plain = _layer("linear", normalize=False)
    with pytest.raises(TypeError, match="S alone"):
        plain(_x(T=1), LinearState(S, z))
    with pytest.raises(TypeError, match="holds z"):
        layer(_x(T=1), LinearState(S, None))


def test_deltanet_state_errors():
    layer = _layer("deltanet")
    _, (S, _) = layer(_x(B=2, T=3))
    with pytest.raises(ValueError, match="shape"):
        layer(_x(T=1), DeltaState(S[..., :4]))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        layer(_x(T=1), DeltaState((S,)))
    with pytest.raises(TypeError, match="must be the DeltaState"):
        layer(_x(T=1), (S,))


def test_repr_names_the_configuration():
    assert "feature_map='elu+1', normalize=True" in repr(LinearAttention(C, H))
    assert "d_model=16, n_head=2" in repr(DeltaNet(C, H))
    assert math.isclose(LinearAttention(C, H, feature_map="taylor2").qk_scale, D ** -0.25)


# -- the short causal convolution (conv_size > 0) ---------------------------------------------

@pytest.mark.parametrize("blocks", BLOCKS.values(), ids=BLOCKS.keys())
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_short_convolution_state_continues_the_sequence(kind, blocks):
    layer = _layer(kind, torch.float64, conv_size=4)
    x = _x(dtype=torch.float64)
    full, full_state = layer(x)
    got, state = _fed(layer, x, blocks)
    assert (got - full).abs().max().item() <= 1e-12 * max(1.0, full.abs().max().item())
    assert isinstance(state.conv, ConvState)
    assert all(s.shape == (2, C, 3) for s in state.conv)  # the last K - 1 = 3 projected q, k, v
    for a, b in zip(_flat(state), _flat(full_state), strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-12 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_short_convolution_is_causal_and_changes_the_output(kind):
    layer = _layer(kind, torch.float64, conv_size=3)
    x = _x(T=10, dtype=torch.float64)
    y, _ = layer(x)
    for t in (0, 4, 8):
        x2 = x.clone()
        x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])
        assert (layer(x2)[0][:, : t + 1] - y[:, : t + 1]).abs().max().item() <= 1e-14
    plain = _layer(kind, torch.float64)  # same seed: same projections, no convolution
    assert (plain(x)[0] - y).abs().max().item() > 1e-3


@torch.no_grad()
def test_short_convolution_is_a_depthwise_causal_filter_with_silu():
    layer = _layer("deltanet", torch.float64, conv_size=4)
    x = _x(B=1, T=7, dtype=torch.float64)
    q, k, v, _ = layer.qkv(x)
    p = torch.cat(layer.project(x), dim=-1)[0]  # [T, 3C]
    convs = (layer.q_conv, layer.k_conv, layer.v_conv)
    w = torch.cat([c.weight[:, 0, :] for c in convs])  # [3C, K]
    b = torch.cat([c.bias for c in convs])  # [3C]
    expected = torch.zeros_like(p)
    for t in range(7):  # h_t = SiLU(Σ_i w_i ⊙ p_{t-(K-1)+i} + b), zeros before the first token
        acc = b.clone()
        for i in range(4):
            if t - 3 + i >= 0:
                acc += w[:, i] * p[t - 3 + i]
        expected[t] = torch.nn.functional.silu(acc)
    got = torch.cat([z.transpose(1, 2).reshape(1, 7, C) for z in (q, k, v)], dim=-1)[0]
    assert (got - expected).abs().max().item() <= 1e-13


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_short_convolution_state_bytes_equal_formula(kind):
    layer = _layer(kind, torch.float64, conv_size=4)
    state, T = None, 0
    for n in (5, 1, 2):
        _, state = layer(_x(B=3, T=n, dtype=torch.float64), state)
        T += n
        assert layer.state_nbytes(state) == layer.state_numel(3, T) * 8


@pytest.mark.parametrize("bad", [-1, True, 2.0])
def test_bad_conv_size_is_refused(bad):
    with pytest.raises(ValueError, match="conv_size must be an int >= 0"):
        DeltaNet(C, H, conv_size=bad)


def test_short_convolution_state_errors():
    layer = _layer("linear", conv_size=4)
    _, state = layer(_x(T=5))
    with pytest.raises(TypeError, match="must be the LinearState"):
        layer(_x(T=1), state.conv)  # the conv state alone, not the layer's state
    with pytest.raises(TypeError, match="state.conv must be the ConvState"):
        layer(_x(T=1), state._replace(conv=tuple(state.conv)))
    cq, ck, cv = state.conv
    with pytest.raises(ValueError, match=r"the state must be \[B, channels, K-1\] = \[2, 16, 3\]"):
        layer(_x(T=1), state._replace(conv=ConvState(cq[:, :, :2], ck, cv)))


def test_softmax_attention_with_rope_is_llamas_attention():
    """RoPE attention (the rows of chapter 18) against transformers' Llama attention with
    biases, the same weights; then decoded in pieces through the cache."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as ml

    from tinyk3.layers import SoftmaxAttentionConfig

    torch.manual_seed(0)
    d, H, T = 16, 2, 11
    cfg = LlamaConfig(hidden_size=d, num_attention_heads=H, num_key_value_heads=H,
                      attention_bias=True, rope_theta=10000.0, intermediate_size=32,
                      num_hidden_layers=1, vocab_size=10, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    ref_layer = ml.LlamaAttention(cfg, layer_idx=0).eval()
    ours = SoftmaxAttentionConfig(n_head=H, rope=True).build(d)
    ours.load_state_dict(ref_layer.state_dict())  # the same names: q, k, v, o with biases
    x = torch.randn(2, T, d)
    cos, sin = ml.LlamaRotaryEmbedding(cfg)(x, torch.arange(T)[None].expand(2, -1))
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(2, 1, T, T)
    with torch.no_grad():
        ref, _ = ref_layer(x, position_embeddings=(cos, sin), attention_mask=mask)
        full, _ = ours(x)
        a, state = ours(x[:, :4])
        b, state = ours(x[:, 4:5], state)
        c, _ = ours(x[:, 5:], state)
    assert (full - ref).abs().max() < 1e-5  # float32
    assert (torch.cat([a, b, c], dim=1) - ref).abs().max() < 1e-5
    plain = SoftmaxAttentionConfig(n_head=H).build(d)
    plain.load_state_dict(ref_layer.state_dict())
    with torch.no_grad():
        assert (plain(x)[0] - ref).abs().max() > 1e-2  # RoPE changes the outputs


def test_softmax_attention_rope_config_is_checked():
    from tinyk3.layers import SoftmaxAttentionConfig

    with pytest.raises(TypeError, match="rope must be True or False"):
        SoftmaxAttentionConfig(n_head=2, rope=1)
    with pytest.raises(ValueError, match="rope_theta must be positive"):
        SoftmaxAttentionConfig(n_head=2, rope=True, rope_theta=0)
    with pytest.raises(ValueError, match="head size must be even"):
        SoftmaxAttentionConfig(n_head=2, rope=True).build(6)

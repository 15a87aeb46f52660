"""tinyk3.models: one model, a mixer per layer; the decoding state changes the cost, never the
logits; parameters counted by formula; GPT-2 is one of these models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import feed_in_blocks, param_dtype, random_idx
from tinyk3.generate import generate
from tinyk3.gpt2 import GPT, GPTConfig
from tinyk3.gpt2 import count_parameters as gpt2_count_parameters
from tinyk3.layers import (
    DeltaNetConfig,
    DeltaState,
    GeluMLPConfig,
    KVState,
    LinearAttentionConfig,
    LinearState,
    SoftmaxAttentionConfig,
)
from tinyk3.models import (
    LM,
    LMCache,
    LMConfig,
    MixerCache,
    MixerConfig,
    MixerLM,
    ParameterCount,
    count_parameters,
    from_gpt,
    presets,
)

VOCAB, BLOCK = 64, 32
KINDS = ["softmax", "linear", "deltanet"]
ALL = KINDS + ["hybrid"]  # "hybrid": DeltaNet, linear attention and softmax layers in one model
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _config(mixer="softmax", **overrides):
    if mixer == "hybrid":
        return _hybrid(**overrides)
    kw = dict(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32, mixer=mixer)
    kw.update(overrides)
    return MixerConfig(**kw)


def _hybrid(conv_size=0, pos_emb=True, block_size=BLOCK, **overrides):
    """Three layers, three kinds ("DLA"), the last a softmax layer with 2 heads, not 4."""
    kw = dict(vocab_size=VOCAB, block_size=block_size, n_embd=32, pattern="DLA", pos_emb=pos_emb,
              mixers={"D": DeltaNetConfig(n_head=4, conv_size=conv_size),
                      "L": LinearAttentionConfig(n_head=4, conv_size=conv_size),
                      "A": SoftmaxAttentionConfig(n_head=2, conv_size=conv_size)})
    kw.update(overrides)
    return LMConfig(**kw)


def _model(mixer="softmax", dtype=torch.float32, perturb=0.3, **overrides):
    """A model moved away from its init (std 0.02 makes every mixer's output tiny, which would
    let a wrong cache pass), in eval mode."""
    torch.manual_seed(0)
    model = MixerLM(_config(mixer, **overrides)).to(dtype).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(perturb * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    return model


@pytest.fixture(scope="module", params=[(k, d) for k in ALL for d in (torch.float32, torch.float64)],
                ids=[f"{k}-{d}" for k in ALL for d in ("f32", "f64")])
def model(request):
    return _model(*request.param)


def _idx(B=2, T=16, seed=1):
    return random_idx(VOCAB, B, T, seed)


# -- the cache never changes the logits ----------------------------------------------------

@pytest.mark.parametrize("blocks", [
    [1] * 16,  # token by token
    [7, 5, 1, 1, 1, 1],  # prefill, a block appended to a non-empty state, then decoding
    [16],  # prefill only
    [3, 3, 3, 3, 4],
    [1, 15],
], ids=["1x16", "7+5+1x4", "16", "3x4+4", "1+15"])
@torch.no_grad()
def test_cached_logits_equal_full_forward(model, blocks):
    idx = _idx()
    full = model(idx)
    got, _ = feed_in_blocks(model, idx, blocks)
    assert full.shape == (2, 16, VOCAB)
    assert full.std() > 0.5  # logits far from the init's, so the mixers matter
    err = (got - full).abs().max().item()
    assert err <= TOL[param_dtype(model)], f"{model.config.kinds}: max abs error {err:.3g}"


@torch.no_grad()
def test_cache_up_to_block_size(model):
    idx = _idx(B=1, T=BLOCK, seed=2)
    got, cache = feed_in_blocks(model, idx, [BLOCK - 3, 1, 1, 1])
    assert cache.length == BLOCK
    assert (got - model(idx)).abs().max().item() <= TOL[param_dtype(model)]


@torch.no_grad()
def test_causality_future_tokens_leave_past_logits_unchanged(model):
    idx = _idx(B=2, T=12)
    logits = model(idx)
    for t in (0, 5, 10):
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1 + torch.arange(2)) % VOCAB
        other = model(changed)
        err = (other[:, : t + 1] - logits[:, : t + 1]).abs().max().item()
        where = f"{model.config.kinds}: token {t + 1} moved logits <= {t}"
        assert err <= TOL[param_dtype(model)], f"{where} by {err:.3g}"
        assert (other[:, t + 1] - logits[:, t + 1]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=5)],
                         ids=["greedy", "sampled", "top_k=5"])
def test_generate_with_and_without_cache_gives_identical_tokens(kind, kw):
    model = _model(kind, torch.float64)  # float64: a sampled token cannot flip between paths
    prompt = _idx(B=2, T=5, seed=3)
    n = BLOCK - 5
    runs = [generate(model, prompt, n, use_cache=c, generator=torch.Generator().manual_seed(7), **kw)
            for c in (True, False)]
    assert runs[0].shape == (2, BLOCK)
    assert torch.equal(runs[0][:, :5], prompt)
    assert torch.equal(runs[0], runs[1])
    assert len(set(runs[0][0, 5:].tolist())) > 2  # not a degenerate constant stream


# -- cache size ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_cache_bytes_grow_for_softmax_and_stay_fixed_otherwise(kind, dtype):
    model = _model(kind, dtype)
    B, L, C, H = 3, 2, 32, 4
    D, itemsize = C // H, dtype.itemsize
    cache = model.new_cache()
    assert cache.nbytes() == 0
    sizes, lengths, T = [], [], 0
    for n in (4, 1, 1, 10, 1):
        model(_idx(B=B, T=n, seed=T), cache=cache)
        T += n
        lengths.append(T)
        sizes.append(cache.nbytes())
        layer = model.transformer.h[0].attn
        assert sizes[-1] == L * layer.state_numel(B, T) * itemsize  # measured = formula
    if kind == "softmax":  # K and V, every layer, every channel, every token: linear in T
        assert sizes == [2 * L * C * t * B * itemsize for t in lengths]
    elif kind == "linear":  # S [Dk, Dv] and z [Dk] per head and layer, whatever T
        assert sizes == [L * B * H * (D * D + D) * itemsize] * len(lengths)
    else:  # S [Dk, Dv] per head and layer
        assert sizes == [L * B * H * D * D * itemsize] * len(lengths)


@torch.no_grad()
def test_cache_bookkeeping_and_branching():
    model = _model("deltanet")
    cache = model.new_cache()
    assert isinstance(cache, LMCache) and MixerCache is LMCache
    assert (cache.n_layer, cache.length, cache.batch_size, cache.kinds) == (2, 0, None, ("deltanet",) * 2)
    assert cache.layers == [None, None]
    idx = _idx(B=2, T=10)
    model(idx[:, :6], cache=cache)
    assert (cache.length, cache.batch_size) == (6, 2)
    assert all(isinstance(s, DeltaState) and s.S.shape == (2, 4, 8, 8) for s in cache.layers)
    assert cache.states is cache.layers  # the old name
    assert "length=6" in repr(cache) and "deltanet" in repr(cache)
    # the states are replaced, never modified: a copy of the cache object resumes exactly
    saved = LMCache(cache.kinds)
    saved.layers, saved.length, saved.batch_size = list(cache.layers), cache.length, cache.batch_size
    kept = [s.S.clone() for s in cache.layers]
    a = model(idx[:, 6:], cache=cache)
    assert all(torch.equal(s.S, k) for s, k in zip(saved.layers, kept))
    b = model(idx[:, 6:], cache=saved)
    assert torch.equal(a, b)
    assert cache.length == saved.length == 10


# -- hybrids: a pattern of mixers ---------------------------------------------------------------

@pytest.mark.parametrize("conv_size", [0, 4])
@pytest.mark.parametrize("split", [1, 2, 5, 8, 15])
@torch.no_grad()
def test_hybrid_split_at_any_point_gives_the_full_logits(conv_size, split):
    model = _model("hybrid", torch.float64, conv_size=conv_size)
    idx = _idx()
    got, cache = feed_in_blocks(model, idx, [split, 16 - split])
    assert (got - model(idx)).abs().max().item() <= 1e-10
    assert [type(s) for s in cache.layers] == [DeltaState, LinearState, KVState]
    assert cache.kinds == model.config.kinds == ("deltanet", "linear", "softmax")
    assert all((s.conv is None) == (conv_size == 0) for s in cache.layers)
    assert cache.layers[2].k.shape == (2, 2, 16, 16)  # the softmax layer: 2 heads of 16
    assert cache.nbytes() == sum(block.attn.state_numel(2, 16) * 8 for block in model.transformer.h)


def test_pattern_forms_are_equivalent():
    specs = dict(D=DeltaNetConfig(n_head=2), A=SoftmaxAttentionConfig(n_head=2))
    base = dict(vocab_size=VOCAB, block_size=BLOCK, n_embd=16)
    by_string = LMConfig(pattern="DDA", mixers=specs, **base)
    by_keys = LMConfig(pattern=["D", "D", "A"], mixers=specs, **base)
    by_specs = LMConfig(pattern=[specs["D"], specs["D"], specs["A"]], **base)
    assert by_string == by_keys and by_string.pattern == ("D", "D", "A")
    assert by_string.layer_mixers == by_specs.layer_mixers == (specs["D"], specs["D"], specs["A"])
    assert by_string.n_layer == 3 and by_string.mixer is None  # a hybrid has no single mixer
    torch.manual_seed(0)
    a = LM(by_string)
    torch.manual_seed(0)
    b = LM(by_specs)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert type(a.transformer.h[2].attn).__name__ == "SoftmaxAttention"


def test_one_mlp_per_layer():
    config = _hybrid(mlp=(GeluMLPConfig(1), GeluMLPConfig(2), GeluMLPConfig(4)))
    model = LM(config)
    assert [b.mlp.c_fc.out_features for b in model.transformer.h] == [32, 64, 128]
    assert count_parameters(config).total == model.num_parameters()


def test_model_config_is_the_config_it_was_built_from():
    config = _hybrid()
    assert LM(config).config is config
    assert dataclasses.replace(config, n_embd=64).layer_mixers == config.layer_mixers


# -- parameters and GPT-2 ----------------------------------------------------------------------

@pytest.mark.parametrize("config", [
    _config("softmax"),
    _config("linear"),
    _config("linear", feature_map="taylor2"),
    _config("deltanet"),
    _config("deltanet", pos_emb=False, mlp_ratio=2, n_layer=3),
    _config("softmax", vocab_size=257, n_head=1, n_embd=24, block_size=7),
    _config("deltanet", conv_size=4),
    _config("linear", conv_size=2),
    _hybrid(),
    _hybrid(conv_size=3, pos_emb=False),
], ids=["softmax", "linear", "taylor2", "deltanet", "deltanet-nope-r2-L3", "odd-sizes", "deltanet-conv4",
        "linear-conv2", "hybrid", "hybrid-conv3-nope"])
def test_count_parameters_equals_the_built_model(config):
    model = LM(config)
    count = count_parameters(config)
    assert isinstance(count, ParameterCount)
    assert count.total == model.num_parameters() == sum(p.numel() for p in model.parameters())
    assert count.active == count.total  # no experts: every parameter is used by every token
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, counted once
    assert ("wpe" in model.transformer) is config.pos_emb


def test_gpt2_small_preset_has_124_439_808_parameters():
    config = presets.gpt2_small()
    assert (config.vocab_size, config.block_size, config.n_layer, config.n_embd) == (50257, 1024, 12, 768)
    assert config.layer_mixers == (SoftmaxAttentionConfig(n_head=12),) * 12
    assert count_parameters(config) == (124_439_808, 124_439_808)
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = LM(config)
    assert model.num_parameters() == 124_439_808
    assert count_parameters(GPTConfig()) == count_parameters(config)  # chapter 1's config too
    assert gpt2_count_parameters(GPTConfig()) == 124_439_808


def test_gpt2_is_an_lm_with_the_same_logits():
    """chapter 1's GPT, loaded into an LM: c_attn split into q, k, v; the same logits, to the bit."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32)).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ours = from_gpt(gpt).eval()
    assert isinstance(ours, LM) and ours.config.kinds == ("softmax", "softmax")
    idx = _idx()
    with torch.no_grad():
        expected = gpt(idx)
        assert torch.equal(ours(idx), expected)
        assert expected.std() > 0.5
        got, _ = feed_in_blocks(ours, idx, [5, 1, 10])
        assert (got - expected).abs().max().item() <= 1e-5
    assert ours.num_parameters() == gpt.num_parameters() == gpt2_count_parameters(gpt.config)
    assert torch.equal(ours.transformer.h[1].attn.k_proj.weight,
                       gpt.transformer.h[1].attn.c_attn.weight[32:64])
    with pytest.raises(TypeError, match="tinyk3.gpt2.GPT"):
        from_gpt(ours)


# Sums of the first edition's parameters (tinyk3.models before the split into q, k, v, commit
# 898e3eb: a fused c_attn [3C, C] and qkv_conv [3C, 1, K]) for the model built below. The split
# layers keep its random draws, so chapter 5's stored results are reproduced.
FIRST_EDITION_SUMS = {
    "transformer.wte.weight": -1.0055941770478967,
    "c_attn": -1.1027048544547142,  # layer 0: q_proj, k_proj, v_proj weights together
    "qkv_conv.weight": -1.7220700979232788,  # layer 0: q_conv, k_conv, v_conv
    "qkv_conv.bias": -3.5730192065238953,
    "transformer.h.1.attn.o_proj.weight": 0.423108277236679,  # was attn.c_proj
    "transformer.h.1.attn.b_proj.weight": -0.11025052514742129,
    "transformer.h.1.mlp.c_fc.weight": -1.7628998991806384,
}


def test_the_flat_config_keeps_the_first_editions_random_draws():
    torch.manual_seed(0)
    model = MixerLM(MixerConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64,
                                mixer="deltanet", conv_size=4, pos_emb=False))
    next_draw = torch.rand(1).item()
    sd, attn = model.state_dict(), model.transformer.h[0].attn
    got = {key: sd[key].double().sum().item() for key in FIRST_EDITION_SUMS if key in sd}
    got["c_attn"] = sum(getattr(attn, f"{n}_proj").weight.double().sum().item() for n in "qkv")
    for part in ("weight", "bias"):
        got[f"qkv_conv.{part}"] = sum(getattr(getattr(attn, f"{n}_conv"), part).double().sum().item()
                                      for n in "qkv")
    for key, expected in FIRST_EDITION_SUMS.items():
        assert got[key] == pytest.approx(expected, rel=1e-6, abs=1e-6), key
    assert attn.q_conv.weight[0, 0, 0].item() == pytest.approx(-0.3411652445793152, rel=1e-6)
    assert attn.k_conv.weight[0, 0, 0].item() == pytest.approx(-0.3729492425918579, rel=1e-6)
    assert next_draw == pytest.approx(0.4275987148284912, rel=1e-6)  # the stream continues alike


def test_gpt2_style_init():
    torch.manual_seed(0)
    model = MixerLM(_config("deltanet", n_layer=4, n_embd=64, vocab_size=512))
    sd = model.state_dict()
    for name in ("transformer.h.0.attn.q_proj.weight", "transformer.h.0.attn.v_proj.weight",
                 "transformer.h.0.mlp.c_fc.weight", "transformer.wte.weight",
                 "transformer.h.1.attn.b_proj.weight"):
        assert abs(sd[name].std().item() - 0.02) < 0.003, name
    for name in ("transformer.h.0.attn.o_proj.weight", "transformer.h.3.mlp.c_proj.weight"):
        assert abs(sd[name].std().item() - 0.02 / (2 * 4) ** 0.5) < 0.002, name  # residual writes
    assert torch.all(sd["transformer.h.2.attn.b_proj.bias"] == 0)  # β starts at 0.5
    assert torch.all(sd["transformer.h.2.attn.k_proj.bias"] == 0)


# -- configuration and input errors -------------------------------------------------------------

@pytest.mark.parametrize("overrides,match", [
    (dict(mixer="mamba"), "unknown mixer 'mamba'"),
    (dict(n_embd=30), r"divisible by n_head \(4\)"),
    (dict(mixer="linear", feature_map="gelu"), "unknown feature_map 'gelu'"),
    (dict(n_layer=0), "n_layer must be a positive int"),
    (dict(n_layer=True), "n_layer must be a positive int"),
    (dict(vocab_size=64.0), "vocab_size must be a positive int"),
    (dict(block_size=True), "block_size must be a positive int"),
    (dict(n_head=True), "n_head must be a positive int"),
    (dict(mlp_ratio=0), "ratio must be a positive int"),
    (dict(conv_size=-1), "conv_size must be a non-negative int"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
])
def test_bad_config_is_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


@pytest.mark.parametrize("overrides,exc,match", [
    (dict(pattern=""), ValueError, "pattern is empty"),
    (dict(pattern="DX"), ValueError, r"pattern\[1\] = 'X' is not a key of mixers"),
    (dict(pattern=3), TypeError, "pattern must be a string or a sequence"),
    (dict(mixers={"D": "deltanet"}, pattern="D"), TypeError, "must be a mixer configuration"),
    (dict(mlp=(GeluMLPConfig(),)), ValueError, r"one MLP configuration per layer \(3\)"),
    (dict(mlp="gelu"), TypeError, "mlp must be an MLP configuration"),
    (dict(pos_emb=1), TypeError, "pos_emb must be a bool"),
    (dict(n_embd=34), ValueError, r"DeltaNetConfig: d_model \(34\) must be divisible by n_head \(4\)"),
])
def test_bad_lm_config_is_refused(overrides, exc, match):
    with pytest.raises(exc, match=match):
        _hybrid(**overrides)


def test_bad_config_types():
    with pytest.raises(TypeError, match="must be a bool"):
        _config(pos_emb=1)
    with pytest.raises(TypeError, match="normalize must be a bool"):
        _config(mixer="linear", normalize=1)
    with pytest.raises(TypeError, match="LMConfig"):
        MixerLM(GPTConfig())
    with pytest.raises(TypeError, match="LMConfig or a GPTConfig"):
        count_parameters(dict(n_embd=8))


@torch.no_grad()
def test_bad_inputs_are_refused():
    model = _model("linear")
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="no tokens"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 64\)"):
        model(torch.tensor([[1, 64]]))
    with pytest.raises(ValueError, match=f"{BLOCK + 1} tokens"):
        model(_idx(B=1, T=BLOCK + 1))


@torch.no_grad()
def test_bad_caches_are_refused_and_left_intact():
    model = _model("softmax")
    cache = model.new_cache()
    model(_idx(B=2, T=BLOCK - 2), cache=cache)
    with pytest.raises(ValueError, match="cache holds batch size 2, idx has 1"):
        model(_idx(B=1, T=1), cache=cache)
    with pytest.raises(ValueError, match=rf"{BLOCK + 1} tokens \({BLOCK - 2} cached \+ 3 new\)"):
        model(_idx(B=2, T=3), cache=cache)
    assert cache.length == BLOCK - 2 and all(s.k.shape[2] == BLOCK - 2 for s in cache.layers)
    with pytest.raises(ValueError, match=r"cache is for layers \['deltanet', 'deltanet'\].*new_cache"):
        model(_idx(B=2, T=1), cache=_model("deltanet").new_cache())
    with pytest.raises(ValueError, match=r"cache is for layers \['softmax', 'softmax', 'softmax'\]"):
        model(_idx(B=2, T=1), cache=LMCache(["softmax"] * 3))
    with pytest.raises(TypeError, match="LMCache"):
        model(_idx(B=2, T=1), cache=GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=64)).new_cache())
    with pytest.raises(ValueError, match="one mixer kind per layer"):
        LMCache([])


@pytest.mark.parametrize("kind", ALL)
@torch.no_grad()
def test_without_positions_the_model_runs_past_block_size(kind):
    model = _model(kind, torch.float64, pos_emb=False, block_size=8)
    idx = _idx(B=1, T=20)
    got, cache = feed_in_blocks(model, idx, [12, 1, 7])
    assert cache.length == 20
    assert (got - model(idx)).abs().max().item() <= TOL[torch.float64]


def test_dropout_acts_in_training_only():
    model = _model("deltanet", dropout=0.5)
    idx = _idx(B=1, T=6)
    model.train()
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    assert torch.equal(model(idx), model(idx))


def test_flat_config_is_an_lm_config():
    config = _config("linear", feature_map="relu")
    assert isinstance(config, LMConfig) and MixerLM is LM
    assert config.mixer == "linear" and config.kinds == ("linear", "linear")
    assert config.layer_mixers[0] == LinearAttentionConfig(n_head=4, feature_map="relu")
    assert config.layer_mlps == (GeluMLPConfig(ratio=4),) * 2


# -- the short convolution in every mixer -------------------------------------------------------

@pytest.mark.parametrize("kind", ALL)
@torch.no_grad()
def test_cached_logits_equal_full_forward_with_short_convolution(kind):
    model = _model(kind, torch.float64, conv_size=4)
    idx = _idx()
    full = model(idx)
    for blocks in ([1] * 16, [7, 5, 1, 1, 1, 1], [2, 14]):
        got, cache = feed_in_blocks(model, idx, blocks)
        assert (got - full).abs().max().item() <= 1e-10, f"{kind} {blocks}"
    assert cache.nbytes() > 0
    assert all(s.conv is not None for s in cache.layers)


def test_attention_maps_of_gpt2_as_an_lm_equal_chapter_1s():
    from tinyk3.gpt2 import attention_maps

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32)).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn_like(p))
    idx = _idx(B=1, T=9)
    expected = attention_maps(gpt, idx)
    assert expected.shape == (2, 1, 4, 9, 9)
    assert (attention_maps(from_gpt(gpt), idx) - expected).abs().max().item() <= 1e-6
    with pytest.raises(TypeError, match="every layer must be softmax attention"):
        attention_maps(_model("deltanet"), idx)
    with pytest.raises(TypeError, match="without a short convolution"):
        attention_maps(_model("softmax", conv_size=2), idx)


@pytest.mark.parametrize("attn_res", [0, 2], ids=["plain", "attention-residuals"])
def test_a_block_without_mlp(attn_res):
    """NoMLPConfig: a mixer-only block (no ln_2, no MLP, no second depth read); counted exactly,
    decoding in pieces equals the full forward, and it differs from the block with an MLP."""
    from tinyk3.layers import DeltaNetConfig, NoMLPConfig, SwiGLUConfig
    from tinyk3.models import count_parameters

    mixer = DeltaNetConfig(n_head=2, conv_size=4)
    cfg = LMConfig(vocab_size=30, block_size=32, n_embd=16, pattern=(mixer,) * 3,
                   mlp=(NoMLPConfig(), SwiGLUConfig(24), NoMLPConfig()), pos_emb=False,
                   norm="rmsnorm", attn_res_block_size=attn_res)
    torch.manual_seed(0)
    model = LM(cfg).double().eval()
    assert not hasattr(model.transformer.h[0], "ln_2") and model.transformer.h[0].mlp is None
    assert hasattr(model.transformer.h[1], "ln_2")
    assert count_parameters(cfg).total == sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, 30, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache()
        pieces = torch.cat([model(idx[:, :4], cache), model(idx[:, 4:5], cache),
                            model(idx[:, 5:], cache)], dim=1)
    assert (pieces - full).abs().max() < 1e-12


def test_block_keeps_its_parameter_order():
    """ln_1, the mixer, ln_2, the MLP: the order of a block's parameters sets the order in which
    gradient clipping sums their norms, so moving a module changes training runs by rounding,
    and the stored notebooks' results with them (a mixer-only block once moved ln_2)."""
    from tinyk3.layers import SoftmaxAttentionConfig

    cfg = LMConfig(vocab_size=16, block_size=8, n_embd=8,
                   pattern=(SoftmaxAttentionConfig(n_head=2),), norm="rmsnorm")
    names = [n.split(".")[3] for n, _ in LM(cfg).named_parameters() if n.startswith("transformer.h.0.")]
    assert list(dict.fromkeys(names)) == ["ln_1", "attn", "ln_2", "mlp"]

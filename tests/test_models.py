"""tinyk3.models: one model, three mixers; the decoding state changes the cost, never the logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinyk3.generate import generate
from tinyk3.gpt2 import GPT, GPTConfig
from tinyk3.gpt2 import count_parameters as gpt2_count_parameters
from tinyk3.models import MixerCache, MixerConfig, MixerLM, count_parameters

VOCAB, BLOCK = 64, 32
KINDS = ["softmax", "linear", "deltanet"]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _config(mixer="softmax", **overrides):
    kw = dict(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32, mixer=mixer)
    kw.update(overrides)
    return MixerConfig(**kw)


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


@pytest.fixture(scope="module", params=[(k, d) for k in KINDS for d in (torch.float32, torch.float64)],
                ids=[f"{k}-{d}" for k in KINDS for d in ("f32", "f64")])
def model(request):
    return _model(*request.param)


def _idx(B=2, T=16, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _dtype(model):
    return model.transformer.wte.weight.dtype


def _feed(model, idx, blocks):
    """Feed ``idx`` through one cache in blocks of the given sizes; return all logits."""
    assert sum(blocks) == idx.shape[1]
    cache, outs, start = model.new_cache(), [], 0
    for n in blocks:
        outs.append(model(idx[:, start : start + n], cache=cache))
        start += n
        assert cache.length == start
    return torch.cat(outs, dim=1), cache


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
    got, _ = _feed(model, idx, blocks)
    assert full.shape == (2, 16, VOCAB)
    assert full.std() > 0.5  # logits far from the init's, so the mixers matter
    err = (got - full).abs().max().item()
    assert err <= TOL[_dtype(model)], f"{model.config.mixer}: max abs error {err:.3g}"


@torch.no_grad()
def test_cache_up_to_block_size(model):
    idx = _idx(B=1, T=BLOCK, seed=2)
    got, cache = _feed(model, idx, [BLOCK - 3, 1, 1, 1])
    assert cache.length == BLOCK
    assert (got - model(idx)).abs().max().item() <= TOL[_dtype(model)]


@torch.no_grad()
def test_causality_future_tokens_leave_past_logits_unchanged(model):
    idx = _idx(B=2, T=12)
    logits = model(idx)
    for t in (0, 5, 10):
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1 + torch.arange(2)) % VOCAB
        other = model(changed)
        err = (other[:, : t + 1] - logits[:, : t + 1]).abs().max().item()
        where = f"{model.config.mixer}: token {t + 1} moved logits <= {t}"
        assert err <= TOL[_dtype(model)], f"{where} by {err:.3g}"
        assert (other[:, t + 1] - logits[:, t + 1]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
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
    assert isinstance(cache, MixerCache)
    assert (cache.n_layer, cache.length, cache.batch_size, cache.mixer) == (2, 0, None, "deltanet")
    idx = _idx(B=2, T=10)
    model(idx[:, :6], cache=cache)
    assert (cache.length, cache.batch_size) == (6, 2)
    assert all(s.shape == (2, 4, 8, 8) for s in cache.states)  # [B, H, Dk, Dv]
    assert "length=6" in repr(cache) and "deltanet" in repr(cache)
    # the states are replaced, never modified: a copy of the cache object resumes exactly
    saved = MixerCache(2, "deltanet")
    saved.states, saved.length, saved.batch_size = list(cache.states), cache.length, cache.batch_size
    kept = [s.clone() for s in cache.states]
    a = model(idx[:, 6:], cache=cache)
    assert all(torch.equal(s, k) for s, k in zip(saved.states, kept))
    b = model(idx[:, 6:], cache=saved)
    assert torch.equal(a, b)
    assert cache.length == saved.length == 10


# -- parameters and GPT-2 ----------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [
    dict(mixer="softmax"),
    dict(mixer="linear"),
    dict(mixer="linear", feature_map="taylor2"),
    dict(mixer="deltanet"),
    dict(mixer="deltanet", pos_emb=False, mlp_ratio=2, n_layer=3),
    dict(mixer="softmax", vocab_size=257, n_head=1, n_embd=24, block_size=7),
    dict(mixer="deltanet", conv_size=4),
    dict(mixer="linear", conv_size=2),
], ids=["softmax", "linear", "taylor2", "deltanet", "deltanet-nope-r2-L3", "odd-sizes", "deltanet-conv4",
        "linear-conv2"])
def test_num_parameters_equals_formula(overrides):
    config = _config(**overrides)
    model = MixerLM(config)
    assert model.num_parameters() == count_parameters(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    assert ("wpe" in model.transformer) is config.pos_emb


def test_softmax_mixer_lm_is_gpt2():
    """Same parameter names, count and logits as tinyk3.gpt2.GPT: the softmax model is GPT-2."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32)).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ours = MixerLM(_config("softmax")).eval()
    ours.load_state_dict(gpt.state_dict())
    idx = _idx()
    with torch.no_grad():
        assert torch.equal(ours(idx), gpt(idx))
    assert ours.num_parameters() == gpt.num_parameters() == gpt2_count_parameters(gpt.config)
    # and GPT-2 small's count, from the formula alone
    gpt2_small = MixerConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert count_parameters(gpt2_small) == 124_439_808


def test_gpt2_style_init():
    torch.manual_seed(0)
    model = MixerLM(_config("deltanet", n_layer=4, n_embd=64, vocab_size=512))
    sd = model.state_dict()
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight",
                 "transformer.wte.weight", "transformer.h.1.attn.b_proj.weight"):
        assert abs(sd[name].std().item() - 0.02) < 0.003, name
    for name in ("transformer.h.0.attn.c_proj.weight", "transformer.h.3.mlp.c_proj.weight"):
        assert abs(sd[name].std().item() - 0.02 / (2 * 4) ** 0.5) < 0.002, name  # residual writes
    assert torch.all(sd["transformer.h.2.attn.b_proj.bias"] == 0)  # β starts at 0.5


# -- configuration and input errors -------------------------------------------------------------

@pytest.mark.parametrize("overrides,match", [
    (dict(mixer="mamba"), "unknown mixer 'mamba'"),
    (dict(n_embd=30), r"divisible by n_head \(4\)"),
    (dict(feature_map="gelu"), "unknown feature_map 'gelu'"),
    (dict(n_layer=0), "n_layer must be a positive int"),
    (dict(vocab_size=64.0), "vocab_size must be a positive int"),
    (dict(n_head=True), "n_head must be a positive int"),
    (dict(mlp_ratio=0), "mlp_ratio must be a positive int"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
])
def test_bad_config_is_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


def test_bad_config_types():
    with pytest.raises(TypeError, match="bools"):
        _config(pos_emb=1)
    with pytest.raises(TypeError, match="MixerConfig"):
        MixerLM(GPTConfig())


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
    assert cache.length == BLOCK - 2 and all(k.shape[2] == BLOCK - 2 for k, _ in cache.states)
    with pytest.raises(ValueError, match=r"cache is for 2 'deltanet' layers.*new_cache"):
        model(_idx(B=2, T=1), cache=_model("deltanet").new_cache())
    with pytest.raises(ValueError, match=r"cache is for 3 'softmax' layers"):
        model(_idx(B=2, T=1), cache=MixerCache(3, "softmax"))
    with pytest.raises(TypeError, match="MixerCache"):
        model(_idx(B=2, T=1), cache=GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=64)).new_cache())
    with pytest.raises(ValueError, match="positive int"):
        MixerCache(0, "softmax")


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_without_positions_the_model_runs_past_block_size(kind):
    model = _model(kind, torch.float64, pos_emb=False, block_size=8)
    idx = _idx(B=1, T=20)
    got, cache = _feed(model, idx, [12, 1, 7])
    assert cache.length == 20
    assert (got - model(idx)).abs().max().item() <= TOL[torch.float64]


def test_dropout_acts_in_training_only():
    model = _model("deltanet", dropout=0.5)
    idx = _idx(B=1, T=6)
    model.train()
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    assert torch.equal(model(idx), model(idx))


def test_config_is_a_plain_dataclass():
    config = _config("linear", feature_map="relu")
    assert dataclasses.replace(config, mixer="deltanet").mixer == "deltanet"
    assert config.head_dim == 8


# -- the short convolution in every mixer -------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_cached_logits_equal_full_forward_with_short_convolution(kind):
    model = _model(kind, torch.float64, conv_size=4)
    idx = _idx()
    full = model(idx)
    for blocks in ([1] * 16, [7, 5, 1, 1, 1, 1], [2, 14]):
        got, cache = _feed(model, idx, blocks)
        assert (got - full).abs().max().item() <= 1e-10, f"{kind} {blocks}"
    assert cache.nbytes() > 0

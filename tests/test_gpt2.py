"""tinyk3.gpt2: equal to transformers' GPT-2 at a tiny random config, exact parameter count,
tied head, causality, and clear errors. Nothing is downloaded: models are built from configs."""

from __future__ import annotations

import pytest
import torch

from tinyk3 import models
from tinyk3.gpt2 import GPT, GPTConfig, count_parameters

transformers = pytest.importorskip("transformers")

VOCAB, BLOCK, LAYERS, EMBD, HEADS = 257, 32, 2, 48, 3
TOL32 = dict(atol=1e-5, rtol=1e-5)  # float32 logits of size O(1)


def _hf_config(**overrides):
    kw = dict(vocab_size=VOCAB, n_positions=BLOCK, n_embd=EMBD, n_layer=LAYERS, n_head=HEADS,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    kw.update(overrides)
    return transformers.GPT2Config(**kw)


def _perturb(model, seed):
    """Random values in every tensor (LayerNorm weights/biases and all linear biases too), so
    that a loader which skips, swaps or forgets to transpose any of them is caught."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def hf_lm():
    torch.manual_seed(0)
    return _perturb(transformers.GPT2LMHeadModel(_hf_config()), seed=1)


@pytest.fixture(scope="module")
def hf_base():
    torch.manual_seed(0)
    return _perturb(transformers.GPT2Model(_hf_config()), seed=2)


@pytest.fixture(scope="module")
def idx():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (2, BLOCK), generator=g)


def _tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD)
    kw.update(overrides)
    return GPTConfig(**kw)


# -- equal to transformers ----------------------------------------------------------------

def test_from_hf_model_matches_transformers_logits(hf_lm, idx):
    ours = GPT.from_hf(hf_lm).eval()
    assert ours.config == _tiny_config()  # n_head and eps read from the model's config
    with torch.no_grad():
        expected = hf_lm(idx).logits
        got = ours(idx)
    assert got.shape == (2, BLOCK, VOCAB) and got.dtype == torch.float32
    assert expected.abs().max() > 0.5  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(got, expected, **TOL32)


def test_from_hf_state_dict_with_config_matches(hf_lm, idx):
    ours = GPT.from_hf(hf_lm.state_dict(), _tiny_config()).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf_lm(idx).logits, **TOL32)


def test_from_hf_gpt2model_state_dict_without_lm_head(hf_base, idx):
    """A GPT2Model has no head and keys without ``transformer.``; the tied head is rebuilt."""
    sd = hf_base.state_dict()
    assert not any(key.startswith(("transformer.", "lm_head")) for key in sd)
    with torch.no_grad():
        hidden = hf_base(idx).last_hidden_state  # after ln_f
        expected = hidden @ hf_base.wte.weight.T  # the tied head
        for source in (GPT.from_hf(sd, _tiny_config()), GPT.from_hf(hf_base)):
            torch.testing.assert_close(source.eval()(idx), expected, **TOL32)


def test_from_hf_float64_is_tight(hf_lm, idx):
    hf64 = transformers.GPT2LMHeadModel(_hf_config())
    hf64.load_state_dict(hf_lm.state_dict())
    hf64 = hf64.double().eval()
    ours = GPT.from_hf(hf64).eval()
    assert ours.transformer.wte.weight.dtype == torch.float32  # built fresh, values copied
    ours = ours.double()
    with torch.no_grad():
        err = (ours(idx) - hf64(idx).logits).abs().max().item()
    assert err <= 1e-10


def test_from_hf_ignores_old_causal_mask_buffers(hf_lm, idx):
    """Older transformers saved ``attn.bias``/``attn.masked_bias`` buffers: they are skipped."""
    sd = dict(hf_lm.state_dict())
    for i in range(LAYERS):
        sd[f"transformer.h.{i}.attn.bias"] = torch.ones(1, 1, BLOCK, BLOCK).tril()
        sd[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    ours = GPT.from_hf(sd, _tiny_config()).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf_lm(idx).logits, **TOL32)


def test_from_hf_head_stays_tied(hf_lm):
    ours = GPT.from_hf(hf_lm)
    assert ours.lm_head.weight is ours.transformer.wte.weight
    torch.testing.assert_close(ours.lm_head.weight, hf_lm.transformer.wte.weight, atol=0, rtol=0)


def test_from_hf_rejects_missing_and_unexpected_keys(hf_lm):
    sd = dict(hf_lm.state_dict())
    del sd["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(KeyError, match=r"missing \['transformer.h.1.mlp.c_fc.bias'\]"):
        GPT.from_hf(sd, _tiny_config())
    sd = dict(hf_lm.state_dict())
    sd["transformer.h.0.attn.rotary"] = torch.zeros(3)
    with pytest.raises(KeyError, match="unexpected"):
        GPT.from_hf(sd, _tiny_config())
    with pytest.raises(KeyError, match="wte.weight"):
        GPT.from_hf({"foo.weight": torch.zeros(2)})


def test_from_hf_state_dict_without_config_refuses_to_guess_heads(hf_lm):
    """n_embd = 48 is not a multiple of GPT-2's head size 64: the state dict does not say how
    many heads there are, so no guess (a wrong one gives silently wrong logits)."""
    with pytest.raises(ValueError, match=r"n_embd=48 is not a multiple of .*64.*config="):
        GPT.from_hf(hf_lm.state_dict())
    with pytest.raises(ValueError, match="n_embd=48"):  # GPT2Model keys, no "transformer."
        GPT.from_hf({k.removeprefix("transformer."): v for k, v in hf_lm.state_dict().items()
                     if k != "lm_head.weight"})


def test_from_hf_state_dict_without_config_uses_head_size_64():
    """n_embd = 128: the GPT-2 family's head size 64 gives 2 heads, and the logits match."""
    torch.manual_seed(0)
    hf = _perturb(transformers.GPT2LMHeadModel(_hf_config(n_embd=128, n_head=2, n_layer=1,
                                                          vocab_size=50, n_positions=8)), seed=5)
    ours = GPT.from_hf(hf.state_dict()).eval()
    assert ours.config == GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=128)
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, **TOL32)


def test_from_hf_rejects_wrong_shapes_and_types(hf_lm):
    with pytest.raises(ValueError, match="expected"):
        GPT.from_hf(hf_lm.state_dict(), _tiny_config(vocab_size=VOCAB + 1))
    with pytest.raises(TypeError, match="state dict"):
        GPT.from_hf(42)


# -- GPT-2 as a tinyk3.models LM (the one interface of every language model in the course) ------

def test_models_from_hf_matches_transformers_logits(hf_lm, idx):
    ours = models.from_hf(hf_lm).eval()
    assert isinstance(ours, models.LM) and ours.config.kinds == ("softmax",) * LAYERS
    assert ours.config.layer_mixers[0].n_head == HEADS
    with torch.no_grad():
        expected = hf_lm(idx).logits
        torch.testing.assert_close(ours(idx), expected, **TOL32)
        cache = ours.new_cache()  # and fed in pieces through one cache
        pieces = torch.cat([ours(idx[:, m:n], cache=cache) for m, n in [(0, 7), (7, 8), (8, BLOCK)]],
                           dim=1)
        torch.testing.assert_close(pieces, expected, **TOL32)
    total, active = models.count_parameters(ours.config)
    assert total == active == hf_lm.num_parameters() == ours.num_parameters()


def test_models_from_checkpoint_reads_config_json_and_tensors(hf_lm, idx):
    config = hf_lm.config.to_dict()  # what config.json parses to
    ours = models.from_checkpoint(config, dict(hf_lm.state_dict())).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf_lm(idx).logits, **TOL32)
    assert ours.config.layer_norm_eps == hf_lm.config.layer_norm_epsilon


def test_models_loaders_name_what_they_support(hf_lm):
    class Other:
        class config:  # noqa: N801 - mimics a transformers model's config attribute
            model_type = "mamba"

    supported = r"\['deepseek_v3', 'gpt2', 'kimi_linear', 'qwen3_next'\]"
    with pytest.raises(NotImplementedError, match=r"'mamba' is not supported; supported: " + supported):
        models.from_hf(Other())
    with pytest.raises(NotImplementedError, match="'mamba'"):
        models.from_checkpoint({"model_type": "mamba"}, {})
    with pytest.raises(TypeError, match="parsed config.json"):
        models.from_checkpoint(hf_lm.config, {})


# -- parameters ---------------------------------------------------------------------------

def test_gpt2_small_has_124_439_808_parameters():
    config = GPTConfig()
    assert (config.vocab_size, config.block_size, config.n_layer, config.n_head,
            config.n_embd) == (50257, 1024, 12, 12, 768)
    assert count_parameters(config) == 124_439_808
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = GPT(config)
    assert model.num_parameters() == 124_439_808


def test_gpt2_small_count_matches_transformers():
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    assert hf.num_parameters() == count_parameters(GPTConfig()) == 124_439_808


@pytest.mark.parametrize("seed", range(5))
def test_count_parameters_matches_model_on_random_configs(seed):
    g = torch.Generator().manual_seed(seed)

    def rnd(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    n_head = rnd(1, 5)
    config = GPTConfig(vocab_size=rnd(2, 500), block_size=rnd(1, 100), n_layer=rnd(1, 4),
                       n_head=n_head, n_embd=n_head * rnd(1, 9))
    with torch.device("meta"):
        ours = GPT(config)
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.block_size, n_layer=config.n_layer,
            n_head=config.n_head, n_embd=config.n_embd, bos_token_id=0, eos_token_id=0))
    assert count_parameters(config) == ours.num_parameters() == hf.num_parameters()


def test_head_is_tied_to_token_embedding():
    model = GPT(_tiny_config())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    # counted once, and a change through one name is seen through the other
    n_unique = sum(p.numel() for p in {id(p): p for _, p in model.named_parameters(
        remove_duplicate=False)}.values())
    assert model.num_parameters() == n_unique
    with torch.no_grad():
        model.transformer.wte.weight[5, 0] = 123.0
    assert model.lm_head.weight[5, 0].item() == 123.0
    model = model.double()  # dtype conversion keeps the tie
    assert model.lm_head.weight is model.transformer.wte.weight


def test_init_follows_gpt2():
    model = GPT(_tiny_config(n_layer=8, n_embd=96))
    std = 0.02 / (2 * 8) ** 0.5
    c_proj = model.transformer.h[0].mlp.c_proj.weight
    assert abs(c_proj.std().item() - std) < 0.1 * std  # residual projections scaled down
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.002
    assert torch.all(model.transformer.h[0].attn.c_attn.bias == 0)


# -- causality ----------------------------------------------------------------------------

def test_changing_a_later_token_leaves_earlier_logits_bit_identical():
    model = GPT(_tiny_config(dropout=0.0)).eval()
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(0, VOCAB, (2, 12), generator=g)
    with torch.no_grad():
        base = model(idx)
        for t in range(idx.shape[1] - 1):
            changed = idx.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % VOCAB
            out = model(changed)
            assert torch.equal(out[:, : t + 1], base[:, : t + 1]), f"position {t + 1} leaked"
            assert not torch.allclose(out[:, t + 1], base[:, t + 1])  # the token itself matters


def test_int32_ids_accepted():
    model = GPT(_tiny_config()).eval()
    idx = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(idx.int()), model(idx))


# -- clear errors -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return GPT(_tiny_config(block_size=8)).eval()


@pytest.mark.parametrize("bad,exc,pattern", [
    (torch.zeros(1, 4), TypeError, "integer tensor"),
    ([[1, 2, 3]], TypeError, "integer tensor"),
    (torch.tensor([1, 2, 3]), ValueError, r"\[B, T\], got \(3,\)"),
    (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, r"\[B, T\]"),
    (torch.tensor([[1, VOCAB]]), ValueError, rf"token ids must lie in \[0, {VOCAB}\)"),
    (torch.tensor([[-1, 2]]), ValueError, "token ids must lie in"),
    (torch.zeros(1, 9, dtype=torch.long), ValueError, "longer than block_size=8"),
    (torch.zeros(1, 0, dtype=torch.long), ValueError, "no tokens"),
], ids=["float", "list", "1-D", "3-D", "id=vocab", "negative id", "too long", "empty"])
def test_bad_idx_raises_clear_errors(tiny, bad, exc, pattern):
    with pytest.raises(exc, match=pattern):
        tiny(bad)


def test_block_size_itself_is_allowed(tiny):
    with torch.no_grad():
        assert tiny(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, VOCAB)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(n_embd=50, n_head=3), r"n_embd \(50\) must be divisible by n_head \(3\)"),
    (dict(n_layer=0), "n_layer must be a positive int"),
    (dict(vocab_size=2.5), "vocab_size must be a positive int"),
    (dict(n_head=True), "n_head must be a positive int"),  # a bool is no int here
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (dict(dropout=-0.1), "dropout"),
])
def test_bad_config_raises(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        GPTConfig(**kwargs)


def test_head_dim():
    assert GPTConfig().head_dim == 64
    assert _tiny_config().head_dim == 16

"""tinyk3.generate: the KV cache does not change what is generated; sampling is what it says."""

from __future__ import annotations

import pytest
import torch

from tinyk3.generate import generate, sample_next
from tinyk3.gpt2 import GPT, GPTConfig

VOCAB, BLOCK = 64, 32


@pytest.fixture(scope="module")
def model():
    # float64, so that cached and uncached logits agree to ~1e-15 and a sampled token can
    # never flip between the two paths.
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg).double().eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # away from the init, so greedy paths vary (entropy ≈ 3 nats)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@pytest.fixture
def prompt():
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))


def _run(model, prompt, n, *, use_cache, seed=7, **kw):
    g = torch.Generator().manual_seed(seed)
    return generate(model, prompt, n, use_cache=use_cache, generator=g, **kw)


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=5),
    dict(temperature=1.5, top_k=1),
], ids=["greedy", "sampled", "top_k=5", "top_k=1"])
def test_cache_and_no_cache_give_identical_tokens(model, prompt, kw):
    n = BLOCK - prompt.shape[1]  # up to the full context
    with_cache = _run(model, prompt, n, use_cache=True, **kw)
    without = _run(model, prompt, n, use_cache=False, **kw)
    assert with_cache.shape == (2, BLOCK) and with_cache.dtype == torch.long
    assert torch.equal(with_cache[:, :5], prompt)
    assert torch.equal(with_cache, without)
    assert 0 <= with_cache.min() and with_cache.max() < VOCAB


@torch.no_grad()
def test_greedy_is_argmax_of_the_full_forward(model, prompt):
    out = generate(model, prompt, 10, temperature=0.0)
    seq = prompt
    for _ in range(10):  # written out independently of generate
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    assert len(set(out[:, 5:].flatten().tolist())) > 3  # not a degenerate repeat-one-token run


def test_sampling_depends_on_the_generator(model, prompt):
    a = _run(model, prompt, 20, use_cache=True, seed=1)
    b = _run(model, prompt, 20, use_cache=True, seed=2)
    assert torch.equal(a, _run(model, prompt, 20, use_cache=True, seed=1))  # reproducible
    assert not torch.equal(a, b)  # and actually random
    assert not torch.equal(a, _run(model, prompt, 20, use_cache=True, temperature=0.0))


@pytest.mark.parametrize("training", [True, False])
def test_generate_restores_training_mode(model, prompt, training):
    model.train(training)
    try:
        generate(model, prompt, 3)
        assert model.training is training
        with pytest.raises(ValueError, match="token ids"):  # an error inside the loop
            generate(model, torch.full((1, 2), VOCAB), 3)
        assert model.training is training
    finally:
        model.eval()


def test_generate_runs_in_eval_mode():
    """Dropout must be off while generating, even if the model was left in training mode."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16,
                          dropout=0.5)).double()
    model.train()
    prompt = torch.zeros(1, 3, dtype=torch.long)
    outs = {tuple(generate(model, prompt, 12, temperature=0.0).flatten().tolist())
            for _ in range(3)}
    assert len(outs) == 1  # greedy decoding with dropout on would vary run to run
    assert model.training


def test_zero_new_tokens_returns_the_prompt(model, prompt):
    for use_cache in (True, False):
        assert torch.equal(generate(model, prompt, 0, use_cache=use_cache), prompt)


def test_generate_errors(model, prompt):
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int"):
        generate(model, prompt, -1)
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int"):
        generate(model, prompt, True)
    with pytest.raises(ValueError, match=f"exceed block_size={BLOCK}"):
        generate(model, prompt, BLOCK - 4)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        generate(model, prompt[0], 3)


# -- sample_next ------------------------------------------------------------------------------

def _logits(B=3, V=10, seed=0):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_1_is_argmax(temperature):
    logits = _logits(B=8, V=50)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        nxt = sample_next(logits, temperature=temperature, top_k=1, generator=g)
        assert torch.equal(nxt, logits.argmax(-1, keepdim=True))


def test_temperature_zero_is_argmax():
    logits = _logits()
    nxt = sample_next(logits, temperature=0.0, top_k=3)
    assert nxt.shape == (3, 1) and nxt.dtype == torch.long
    assert torch.equal(nxt, logits.argmax(-1, keepdim=True))


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, None), (2.0, 3)])
def test_sample_frequencies_follow_softmax(temperature, top_k):
    """20,000 independent draws: empirical frequencies within 0.015 of the intended
    distribution (binomial standard deviation ≤ 0.0036, so this is > 4σ)."""
    V, N = 6, 20_000
    row = _logits(B=1, V=V, seed=3)
    scaled = row / temperature
    if top_k is not None:
        kth = scaled.topk(top_k).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    p = scaled.softmax(-1)[0]
    nxt = sample_next(row.expand(N, V), temperature, top_k,
                      torch.Generator().manual_seed(4))
    freq = torch.bincount(nxt.flatten(), minlength=V).double() / N
    assert (freq - p.double()).abs().max().item() < 0.015
    if top_k is not None:
        assert (freq[p == 0] == 0).all()  # never outside the top k


def test_top_k_larger_than_vocab_is_clamped():
    logits = _logits(B=2, V=4)
    nxt = sample_next(logits, top_k=100, generator=torch.Generator().manual_seed(0))
    assert nxt.shape == (2, 1)


def test_sample_next_errors():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sample_next(_logits(), temperature=-1.0)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        sample_next(_logits(), top_k=0)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        sample_next(_logits(), top_k=True)

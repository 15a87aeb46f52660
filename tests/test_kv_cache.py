"""tinyk3.kv_cache: the cache changes the cost, never the logits; its size is the formula's."""

from __future__ import annotations

import pytest
import torch

from helpers import feed_in_blocks, param_dtype, random_idx
from tinyk3.gpt2 import GPT, GPTConfig
from tinyk3.kv_cache import KVCache, kv_cache_bytes

VOCAB, BLOCK = 64, 32
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}

def _model(dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    kw.update(overrides)
    return GPT(GPTConfig(**kw)).to(dtype).eval()


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["f32", "f64"])
def model(request):
    return _model(request.param)


def _idx(B=2, T=16, seed=1):
    return random_idx(VOCAB, B, T, seed)


@pytest.mark.parametrize("blocks", [
    [1] * 16,  # token by token
    [7, 5, 1, 1, 1, 1],  # prefill, a block appended to a non-empty cache, then decoding
    [16],  # prefill only: the cache must not change a plain forward pass
    [3, 3, 3, 3, 4],
    [1, 15],
], ids=["1x16", "7+5+1x4", "16", "3x4+4", "1+15"])
@torch.no_grad()
def test_cached_logits_equal_full_forward(model, blocks):
    idx = _idx(B=2, T=16)
    full = model(idx)
    got, _ = feed_in_blocks(model, idx, blocks)
    err = (got - full).abs().max().item()
    assert err <= TOL[param_dtype(model)], f"max abs error {err:.3g}"


@torch.no_grad()
def test_cache_up_to_block_size(model):
    idx = _idx(B=1, T=BLOCK, seed=2)
    got, cache = feed_in_blocks(model, idx, [BLOCK - 3, 1, 1, 1])
    assert cache.length == BLOCK
    assert (got - model(idx)).abs().max().item() <= TOL[param_dtype(model)]


@pytest.mark.parametrize("lengths", [[1], [5], [7, 5, 1], [BLOCK]])
@torch.no_grad()
def test_nbytes_equals_formula(model, lengths):
    cfg, dtype = model.config, param_dtype(model)
    B = 2
    cache = model.new_cache()
    assert cache.nbytes() == 0
    total = 0
    for n in lengths:
        model(_idx(B=B, T=n, seed=total), cache=cache)
        total += n
        expected = kv_cache_bytes(cfg.n_layer, cfg.n_embd, total, batch_size=B,
                                  bytes_per_value=torch.finfo(dtype).bits // 8)
        assert cache.nbytes() == expected
    # and by hand: K and V, 2 layers, 32 numbers each per token
    assert cache.nbytes() == 2 * 2 * 32 * total * B * (8 if dtype == torch.float64 else 4)


def test_kv_cache_bytes_gpt2_small():
    # 2 × 12 layers × 768 × 1,024 tokens × 4 bytes
    assert kv_cache_bytes(12, 768, 1024) == 75_497_472
    assert kv_cache_bytes(12, 768, 1024, batch_size=8, bytes_per_value=2) == 8 * 75_497_472 // 2
    assert kv_cache_bytes(12, 768, 0) == 0
    with pytest.raises(ValueError, match="seq_len must be a non-negative int"):
        kv_cache_bytes(12, 768, -1)
    with pytest.raises(ValueError, match="bytes_per_value must be a positive int"):
        kv_cache_bytes(12, 768, 8, bytes_per_value=True)


@torch.no_grad()
def test_cache_bookkeeping():
    model = _model()
    cache = model.new_cache()
    assert isinstance(cache, KVCache)
    assert (cache.n_layer, cache.length, cache.batch_size) == (2, 0, None)
    model(_idx(B=2, T=7), cache=cache)
    assert (cache.length, cache.batch_size) == (7, 2)
    for layer in range(2):
        assert cache.keys[layer].shape == (2, 4, 7, 8)  # [B, H, T, D]
        assert cache.values[layer].shape == (2, 4, 7, 8)
    model(_idx(B=2, T=5), cache=cache)
    assert cache.length == 12
    assert all(k.shape[2] == 12 for k in cache.keys)
    assert "length=12" in repr(cache) and "n_layer=2" in repr(cache)


def test_append_returns_everything_so_far():
    cache = KVCache(1)
    k1, v1 = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5)
    k2, v2 = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 5)
    k, v = cache.append(0, k1, v1)
    assert torch.equal(k, k1) and torch.equal(v, v1)
    k, v = cache.append(0, k2, v2)
    assert torch.equal(k, torch.cat([k1, k2], 2)) and torch.equal(v, torch.cat([v1, v2], 2))
    assert cache.length == 5


def test_kv_cache_append_errors():
    with pytest.raises(ValueError, match="positive int"):
        KVCache(0)
    with pytest.raises(ValueError, match="positive int"):
        KVCache(2.0)
    with pytest.raises(ValueError, match="KVCache: n_layer must be a positive int, got True"):
        KVCache(True)
    cache = KVCache(2)
    k = torch.randn(2, 4, 3, 8)
    with pytest.raises(IndexError, match="layer 2 out of range for a cache of 2 layers"):
        cache.append(2, k, k)
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        cache.append(0, k, k[:, :, :2])
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        cache.append(0, k[0], k[0])
    cache.append(0, k, k)
    with pytest.raises(ValueError, match="batch, heads and head size must match"):
        cache.append(0, k[:1], k[:1])
    with pytest.raises(ValueError, match="batch, heads and head size must match"):
        cache.append(0, k[..., :4], k[..., :4])


@torch.no_grad()
def test_model_rejects_batch_mismatch_and_leaves_cache_intact():
    model = _model()
    cache = model.new_cache()
    model(_idx(B=2, T=4), cache=cache)
    with pytest.raises(ValueError, match="cache holds batch size 2, idx has 1"):
        model(_idx(B=1, T=1), cache=cache)
    assert (cache.length, cache.batch_size) == (4, 2)
    assert all(k.shape[2] == 4 for k in cache.keys)


@torch.no_grad()
def test_model_rejects_going_past_block_size_and_leaves_cache_intact():
    model = _model()
    cache = model.new_cache()
    model(_idx(B=1, T=BLOCK - 2), cache=cache)
    with pytest.raises(ValueError, match=rf"{BLOCK + 1} tokens \({BLOCK - 2} cached \+ 3 new\)"):
        model(_idx(B=1, T=3), cache=cache)
    assert cache.length == BLOCK - 2
    model(_idx(B=1, T=2), cache=cache)  # exactly block_size is fine
    with pytest.raises(ValueError, match="block_size"):
        model(_idx(B=1, T=1), cache=cache)


@pytest.mark.parametrize("n_layer", [1, 3])
@torch.no_grad()
def test_model_rejects_a_cache_with_the_wrong_number_of_layers(n_layer):
    """With more layers, KVCache.length would read a never-filled layer and every step would
    restart at position 0; with fewer, append would fail half-way. Both are refused upfront."""
    model = _model()  # 2 layers
    cache = KVCache(n_layer)
    with pytest.raises(ValueError, match=rf"cache has {n_layer} layers, the model 2: .*new_cache"):
        model(_idx(B=1, T=3), cache=cache)
    assert cache.length == 0 and cache.nbytes() == 0  # nothing was appended
    assert model(_idx(B=1, T=3), cache=model.new_cache()).shape == (1, 3, VOCAB)

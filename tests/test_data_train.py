"""tinyk3.data and tinyk3.train: offline corpus, byte tokens, batches, and a loop that learns."""

from __future__ import annotations

import math

import pytest
import torch

from tinyk3.data import (
    VOCAB_SIZE,
    decode,
    encode,
    get_batch,
    load_corpus,
    split,
    unigram_entropy,
)
from tinyk3.gpt2 import GPT, GPTConfig
from tinyk3.train import TrainResult, evaluate_loss, train_lm


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def tokens(corpus):
    return encode(corpus)


# -- data ---------------------------------------------------------------------------------

def test_corpus_is_deterministic_offline_text(corpus):
    assert isinstance(corpus, bytes)
    assert len(corpus) > 400_000
    assert load_corpus() == corpus
    text = corpus.decode("utf-8")  # valid UTF-8 throughout
    assert text.count(" the ") > 1000  # English prose, not noise


def test_encode_gives_byte_values(tokens, corpus):
    assert VOCAB_SIZE == 256
    assert tokens.dtype == torch.long and tokens.dim() == 1
    assert len(tokens) == len(corpus)
    assert 0 <= tokens.min() and tokens.max() < VOCAB_SIZE
    assert tokens[:100].tolist() == list(corpus[:100])


@pytest.mark.parametrize("text", ["hello", "", "naïve café — ünïcödé ✓ 日本語 🙂", "a\nb\tc\x00"])
def test_encode_decode_round_trip(text):
    ids = encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte, not per character
    assert decode(ids) == text
    assert decode(ids.tolist()) == text
    assert torch.equal(encode(text.encode("utf-8")), ids)


def test_encode_non_ascii_is_utf8_bytes():
    assert encode("é").tolist() == [0xC3, 0xA9]
    assert encode("✓").tolist() == [0xE2, 0x9C, 0x93]


def test_decode_half_a_character_shows_replacement():
    assert decode([104, 0xE2, 0x9C]) == "h\ufffd"


@pytest.mark.parametrize("val_fraction", [0.1, 0.25, 0.5])
def test_split_sizes(val_fraction):
    data = torch.arange(1000)
    train, val = split(data, val_fraction)
    assert len(train) == int(1000 * (1 - val_fraction))
    assert len(train) + len(val) == 1000
    assert torch.equal(torch.cat([train, val]), data)  # in order, no shuffling


def test_split_default_on_corpus(tokens):
    train, val = split(tokens)
    assert len(train) == int(len(tokens) * 0.9)
    assert len(val) == len(tokens) - len(train)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_split_rejects_bad_fraction(bad):
    with pytest.raises(ValueError, match="val_fraction"):
        split(torch.arange(10), bad)


def test_unigram_entropy_is_the_loss_of_the_frequencies(tokens):
    """Uniform ids give log V, one repeated id gives 0, and on the corpus the value is the
    cross-entropy of a model that predicts the training frequencies for every byte, computed
    as a loss: -mean(log p[token])."""
    assert math.isclose(unigram_entropy(torch.arange(256).repeat(3)), math.log(256),
                        rel_tol=1e-12)
    assert unigram_entropy(torch.full((10,), 7)) == 0.0
    assert math.isclose(unigram_entropy(torch.tensor([0, 0, 1, 1]), vocab_size=2), math.log(2))
    train, _ = split(tokens)
    p = torch.bincount(train, minlength=VOCAB_SIZE).double() / len(train)
    as_loss = -p[train].log().mean().item()
    assert math.isclose(unigram_entropy(train), as_loss, rel_tol=1e-9)
    assert 3.0 < unigram_entropy(train) < math.log(VOCAB_SIZE)


@pytest.mark.parametrize("bad", [torch.zeros(0, dtype=torch.long), torch.ones(3),
                                 torch.zeros(2, 2, dtype=torch.long), torch.tensor([0, 256]),
                                 torch.tensor([-1, 2]), [1, 2]])
def test_unigram_entropy_rejects_bad_tokens(bad):
    with pytest.raises(ValueError, match="unigram_entropy"):
        unigram_entropy(bad)


@pytest.mark.parametrize("B,T", [(1, 1), (4, 8), (16, 32)])
def test_get_batch_windows_and_shift(B, T):
    data = torch.arange(100, 300)  # the value tells where a token came from
    x, y = get_batch(data, B, T, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (B, T)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted by one
    for row_x, row_y in zip(x, y):
        s = int(row_x[0]) - 100
        assert torch.equal(row_x, data[s : s + T])  # a contiguous window
        assert torch.equal(row_y, data[s + 1 : s + T + 1])


def test_get_batch_covers_the_last_window_and_is_seeded():
    data = torch.arange(9)
    x, y = get_batch(data, 5, 8)  # only one window fits
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        get_batch(data, True, 8)
    assert torch.equal(x, data[:8].expand(5, 8)) and torch.equal(y, data[1:].expand(5, 8))
    data = torch.arange(1000)
    a = get_batch(data, 4, 16, torch.Generator().manual_seed(3))
    b = get_batch(data, 4, 16, torch.Generator().manual_seed(3))
    c = get_batch(data, 4, 16, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_get_batch_rejects_short_data():
    with pytest.raises(ValueError, match="need more than block_size=8"):
        get_batch(torch.arange(8), 2, 8)


# -- training -----------------------------------------------------------------------------

def _tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=32, n_layer=2, n_head=2, n_embd=32))


def test_evaluate_loss_is_deterministic_and_starts_near_log_vocab(tokens):
    model = _tiny_gpt()
    model.train()
    val = tokens[-20_000:]
    a = evaluate_loss(model, val, batch_size=4, block_size=32, n_batches=3)
    b = evaluate_loss(model, val, batch_size=4, block_size=32, n_batches=3)
    assert a == b
    assert model.training  # restored
    # Untrained (init std 0.02): near-uniform predictions, loss ≈ ln 256 = 5.545 nats.
    assert abs(a - math.log(VOCAB_SIZE)) < 0.1
    assert evaluate_loss(model, val, 4, 32, n_batches=3, seed=1) != a  # the seed picks windows


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_evaluate_loss_restores_the_mode_even_when_it_raises(tokens, training):
    model = _tiny_gpt()
    model.train(training)
    with pytest.raises(ValueError, match="need more than block_size=32"):
        evaluate_loss(model, tokens[:10], batch_size=4, block_size=32)  # data too short
    assert model.training is training
    assert all(m.training is training for m in model.modules())

    calls = []

    def crash_on_second_batch(module, args):
        assert not module.training  # evaluated in eval mode
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")

    hook = model.register_forward_pre_hook(crash_on_second_batch)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            evaluate_loss(model, tokens[-20_000:], batch_size=4, block_size=32, n_batches=3)
    finally:
        hook.remove()
    assert len(calls) == 2
    assert model.training is training
    assert evaluate_loss(model, tokens[-20_000:], 4, 32, n_batches=1) > 0  # still usable
    assert model.training is training


def test_train_lm_reduces_loss(tokens):
    model = _tiny_gpt()
    train, val = split(tokens[:200_000])
    before = evaluate_loss(model, val, 16, 32, n_batches=4)
    result = train_lm(model, train, val, steps=60, batch_size=16, lr=3e-3, warmup=10,
                      eval_every=20, progress=False)
    assert isinstance(result, TrainResult)
    assert result.steps == [20, 40, 60]
    assert result.val_steps == result.steps
    assert len(result.train_loss) == len(result.val_loss) == 3
    assert all(math.isfinite(v) for v in result.train_loss + result.val_loss)
    assert result.tokens_seen == 60 * 16 * 32
    assert result.seconds > 0
    # Byte-level text: 60 steps take the loss from ≈5.5 to ≈3 (unigram statistics and more).
    assert result.train_loss[-1] < result.train_loss[0] - 0.3
    assert result.train_loss[-1] < 4.0
    assert result.val_loss[-1] < before - 1.0
    assert not model.training  # left in eval mode


def test_train_lm_history_when_steps_not_a_multiple_and_no_val(tokens):
    model = _tiny_gpt()
    result = train_lm(model, tokens[:20_000], steps=7, batch_size=2, block_size=16,
                      eval_every=3, progress=False)
    assert result.steps == [3, 6, 7]  # the last step is always logged
    assert len(result.train_loss) == 3
    assert result.val_steps == [] and result.val_loss == []
    assert result.tokens_seen == 7 * 2 * 16


def test_train_lm_is_reproducible(tokens):
    data = tokens[:20_000]
    runs = [train_lm(_tiny_gpt(), data, steps=6, batch_size=4, eval_every=2, seed=5,
                     progress=False).train_loss for _ in range(2)]
    assert runs[0] == runs[1]
    other = train_lm(_tiny_gpt(), data, steps=6, batch_size=4, eval_every=2, seed=6,
                     progress=False).train_loss
    assert other != runs[0]

"""tinyk3.compare: the closing comparison's models and measurements (chapter 18)."""

from __future__ import annotations

import pytest
import torch

from helpers import feed_in_blocks, random_idx
from tinyk3 import compare
from tinyk3.layers.mla import MultiHeadLatentAttention
from tinyk3.models import LM, count_parameters
from tinyk3.timing import Timing

SMALL = dict(d_model=16, n_head=2)


def _model(name, vocab=32, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return LM(compare.tiny_config(name, vocab_size=vocab, **(SMALL | kw))).to(dtype)


def test_every_mechanism_of_the_course_is_a_row_in_chapter_order_of_its_kind():
    assert len(compare.MECHANISMS) == 9
    assert set(compare.CHAPTERS.values()) <= set(range(1, 18))
    kinds = {n: compare.tiny_config(n, vocab_size=8).kinds for n in compare.MECHANISMS}
    assert kinds["softmax"] == ("softmax", "softmax")
    assert kinds["KDA + MLA"] == ("kda", "mla") and kinds["tiny K3"] == ("kda", "mla")
    assert kinds["Gated DeltaNet"] == ("gated_deltanet",) * 2 and kinds["MLA"] == ("mla",) * 2
    four = compare.tiny_config("KDA + MLA", vocab_size=8, n_layer=4).kinds
    assert four == ("kda", "kda", "kda", "mla")  # three KDA layers to one MLA layer


@pytest.mark.parametrize("name", compare.MECHANISMS)
def test_only_the_mixer_differs_and_the_k3_row_adds_what_k3_changes(name):
    cfg = compare.tiny_config(name, vocab_size=8)
    base = compare.tiny_config("softmax", vocab_size=8)
    for f in ("n_embd", "n_layer", "pos_emb", "norm", "tie_embeddings", "vocab_size"):
        assert getattr(cfg, f) == getattr(base, f), f
    if name == "tiny K3":
        assert cfg.attn_res_block_size == 1
        assert cfg.layer_mlps[1].latent_dim == 32 and cfg.layer_mlps[0].activation == "situ"
        assert cfg.pattern[0].gate == "lower_bound" and cfg.pattern[1].output_gate
    else:
        assert cfg.attn_res_block_size == 0 and cfg.layer_mlps == base.layer_mlps


@pytest.mark.parametrize("name", compare.MECHANISMS)
def test_decoding_in_pieces_equals_the_full_forward_and_counts_agree(name):
    model = _model(name, dtype=torch.float64)
    idx = random_idx(32, B=2, T=21)
    logits, _ = feed_in_blocks(model, idx, [6, 1, 9, 5])
    with torch.no_grad():
        full = model(idx)
    assert (logits - full).abs().max() < 1e-10
    assert count_parameters(model.config).total == model.num_parameters()


@pytest.mark.parametrize("name,per_token,fixed_zero", [
    ("softmax", 2 * 2 * 16 * 4, True),  # K and V of every head, 2 layers, float32
    ("softmax + conv", 2 * 2 * 16 * 4, False),  # plus the convolution windows
    ("MLA", 2 * (8 + 4) * 4, True),  # a latent of d/2 and a RoPE key of D/2 per layer
    ("KDA + MLA", 8 * 4, False),
    ("tiny K3", 8 * 4, False),
    ("linear", 0, False),
    ("DeltaNet", 0, False),
    ("Gated DeltaNet", 0, False),
    ("KDA", 0, False),
])
def test_cache_growth_splits_the_measured_bytes(name, per_token, fixed_zero):
    model = _model(name)
    g = compare.cache_growth(model, (8, 24))
    assert g.per_token == per_token
    assert (g.fixed == 0) == fixed_zero
    assert g.at(40) == compare.prefill(model, 40).nbytes()
    if per_token == 0:  # a fixed state: two heads of 8 x 8 in each of two layers, at least
        assert g.fixed >= 2 * 2 * 8 * 8 * 4
    two = compare.cache_growth(model, (8, 24), batch_size=3)  # per sequence
    assert two.per_token == g.per_token and two.fixed == pytest.approx(g.fixed)


def test_prefill_in_pieces_is_the_prefill_at_once():
    model = _model("softmax")
    a = compare.prefill(model, 50, piece=7, seed=3)
    b = compare.prefill(model, 50, piece=50, seed=3)
    assert a.length == b.length == 50
    for sa, sb in zip(a.layers, b.layers):
        assert torch.allclose(sa.k, sb.k, atol=1e-6) and torch.allclose(sa.v, sb.v, atol=1e-6)


def test_decode_step_seconds_restores_the_context():
    model = _model("KDA + MLA")
    assert compare.absorb_mla(model) == 1
    assert all(m.absorb for m in model.modules() if isinstance(m, MultiHeadLatentAttention))
    cache = compare.prefill(model, 20)
    before = [s for s in cache.layers]
    t = compare.decode_step_seconds(model, cache, repeats=3)
    assert isinstance(t, Timing) and len(t.runs) == 3 and t > 0
    assert cache.length == 20 and all(a is b for a, b in zip(cache.layers, before))
    assert compare.absorb_mla(model, False) == 1


def test_absorbed_decoding_gives_the_naive_logits():
    model = _model("MLA", dtype=torch.float64)
    idx = random_idx(32, B=1, T=12)
    naive, _ = feed_in_blocks(model, idx, [11, 1])
    compare.absorb_mla(model)
    absorbed, _ = feed_in_blocks(model, idx, [11, 1])
    assert (naive - absorbed).abs().max() < 1e-12


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown mechanism 'GPT-4'"):
        compare.tiny_config("GPT-4", vocab_size=8)
    with pytest.raises(ValueError, match="multiple of 2·n_head"):
        compare.tiny_config("MLA", vocab_size=8, d_model=18, n_head=2)
    with pytest.raises((TypeError, ValueError), match="vocab_size"):
        compare.tiny_config("KDA", vocab_size=0)
    model = _model("softmax")
    with pytest.raises(ValueError, match="two ints 0 < a < b"):
        compare.cache_growth(model, (16, 8))
    with pytest.raises(ValueError, match="has seen tokens"):
        compare.decode_step_seconds(model, model.new_cache())
    with pytest.raises(TypeError, match="tinyk3.models.LM"):
        compare.prefill(torch.nn.Linear(2, 2), 4)


def test_decode_times_alternates_lengths_and_keeps_every_run():
    model = _model("softmax")
    times = compare.decode_times(model, (4, 32), rounds=3, repeats=2, min_seconds=0.0)
    assert set(times) == {4, 32}
    assert all(isinstance(t, Timing) and len(t.runs) == 3 * 2 for t in times.values())
    with pytest.raises(ValueError, match="at least one context length"):
        compare.decode_times(model, ())

"""The one timing helper (tinyk3.timing), max_diff (tinyk3.util), the int validation helper and
the benchmark stamp. No timing is asserted to be fast or slow: only the statistic's arithmetic."""

from __future__ import annotations

import pickle

import pytest
import torch

from tinyk3 import _validate, bench, memory, timing, util

# Imports tinyk3.bench, which reaches Triton: rerun with Triton hidden by `make unit-no-triton`.
pytestmark = pytest.mark.triton


def test_timing_is_the_median_with_quartiles():
    t = timing.Timing([5.0, 1.0, 3.0, 2.0, 4.0])
    assert float(t) == 3.0 and t.runs == (1.0, 2.0, 3.0, 4.0, 5.0)
    assert (t.low, t.high) == (2.0, 4.0) and t.spread == pytest.approx(2 / 3)
    assert float(timing.Timing([1.0, 3.0])) == 2.0  # even count: mean of the middle two
    one = timing.Timing([0.5])
    assert (one.low, one.high, one.spread) == (0.5, 0.5, 0.0)
    assert f"{t * 1e3:.0f}" == "3000" and str(t) == "3.0"
    assert t.ms() == "3000.0 (2000.0-4000.0)" and t.ms(0) == "3000 (2000-4000)"
    assert pickle.loads(pickle.dumps(t)).runs == t.runs
    with pytest.raises(ValueError, match="at least one run"):
        timing.Timing([])


def test_time_fn_counts_warmup_and_repeats():
    calls = []
    t = timing.time_fn(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(calls) == 7 and len(t.runs) == 5 and t >= 0
    calls.clear()
    t = timing.time_fn(lambda: calls.append(1), repeats=3, warmup=0, min_seconds=0.02)
    assert sum(t.runs) >= 0.02 and len(calls) == len(t.runs) >= 3


def test_time_fn_max_seconds_bounds_the_runs():
    import time

    t = timing.time_fn(lambda: time.sleep(0.02), repeats=50, warmup=0, max_seconds=0.05)
    assert 1 <= len(t.runs) <= 4


@pytest.mark.parametrize("kwargs", [{"repeats": 0}, {"repeats": True}, {"warmup": -1},
                                    {"repeats": 2.0}])
def test_time_fn_rejects_bad_counts(kwargs):
    with pytest.raises(ValueError, match="time_fn: "):
        timing.time_fn(lambda: None, **kwargs)


def test_distinguishable_compares_quartile_ranges():
    a = timing.Timing([1.0, 1.1, 1.2, 1.3, 1.4])
    b = timing.Timing([1.2, 1.25, 1.3, 1.4, 1.5])
    c = timing.Timing([2.0, 2.1, 2.2, 2.3, 2.4])
    assert not timing.distinguishable(a, b) and timing.distinguishable(a, c)
    assert timing.distinguishable(c, a)


def test_max_diff_is_float64_and_checks_types():
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 2.0078125], dtype=torch.float64)
    assert util.max_diff(a, b) == pytest.approx(0.0078125, abs=0)
    assert util.max_diff(torch.zeros(0), torch.zeros(0)) == 0.0
    with pytest.raises(TypeError, match="two tensors"):
        util.max_diff([1.0], torch.zeros(1))


@pytest.mark.parametrize("bad", [True, False, 0, -3, 2.0, "4", None])
def test_positive_int_rejects_bools_and_non_ints(bad):
    with pytest.raises(ValueError, match="op: n must be a positive int"):
        _validate.positive_int(bad, "n", "op")


def test_int_helpers_accept_ints():
    import numpy as np

    assert _validate.positive_int(np.int64(3), "n") == 3
    assert _validate.nonnegative_int(0, "n") == 0
    with pytest.raises(ValueError, match="non-negative"):
        _validate.nonnegative_int(True, "n")


def test_batched_key_generators_equal_the_one_memory_draws():
    g = torch.Generator().manual_seed(0)
    flat = memory.random_unit_keys(12, 5, generator=g).view(3, 4, 5)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(memory.random_unit_keys(4, 5, batch=3, generator=g), flat)
    g = torch.Generator().manual_seed(1)
    stack = torch.stack([memory.orthonormal_keys(4, 5, generator=g) for _ in range(3)])
    g = torch.Generator().manual_seed(1)
    batched = memory.orthonormal_keys(4, 5, batch=3, generator=g)
    assert torch.equal(batched, stack)
    gram = batched @ batched.mT
    assert torch.allclose(gram, torch.eye(4).expand(3, 4, 4), atol=1e-6)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        memory.random_unit_keys(4, 5, batch=True)


def test_stamp_names_commit_dirty_flag_versions_and_hardware(monkeypatch):
    env = bench.environment()
    assert set(env) >= {"commit", "dirty", "torch", "python", "processor", "threads"}
    monkeypatch.setattr(bench, "git_commit", lambda cwd=None: ("abc1234", True))
    line = bench.stamp()
    assert "abc1234+dirty" in line and f"torch {torch.__version__}" in line
    monkeypatch.setattr(bench, "git_commit", lambda cwd=None: ("abc1234", False))
    assert "abc1234," in bench.stamp() and "+dirty" not in bench.stamp()


def test_git_commit_outside_a_checkout(tmp_path):
    assert bench.git_commit(tmp_path) == ("unknown", None)


def test_moving_mean():
    from tinyk3.util import moving_mean

    assert moving_mean([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_mean([5.0], 10) == [5.0] and moving_mean([], 3) == []
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="window"):
            moving_mean([1, 2], bad)


def test_randomise_draws_each_kind_of_parameter_by_its_rule():
    from torch import nn

    from tinyk3.util import randomise_

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(400, 300, bias=False)
            self.A_log = nn.Parameter(torch.zeros(4000))
            self.dt_bias = nn.Parameter(torch.zeros(4000))
            self.o_norm = nn.Module()
            self.o_norm.weight = nn.Parameter(torch.ones(4000))
            self.register_buffer("e_score_correction_bias", torch.zeros(8))
            self.register_buffer("inv_freq", torch.arange(3.0))

    m = randomise_(Toy(), seed=3, decay=(2.0, 5.0), dt_shift=-3.0)
    rate = m.A_log.detach().exp()
    assert 2.0 <= rate.min() and rate.max() <= 5.0 and abs(rate.mean() - 3.5) < 0.1
    assert abs(m.dt_bias.mean() + 3.0) < 0.1 and abs(m.dt_bias.std() - 1.0) < 0.1
    assert abs(m.o_norm.weight.mean() - 1.0) < 0.02 and abs(m.o_norm.weight.std() - 0.2) < 0.02
    assert abs(m.proj.weight.std() - 400 ** -0.5) < 0.002  # N(0, 1/fan_in)
    assert m.e_score_correction_bias.abs().max() == 0 and m.inv_freq.tolist() == [0, 1, 2]
    same = randomise_(Toy(), seed=3, decay=(2.0, 5.0))
    assert torch.equal(same.proj.weight, m.proj.weight)  # the seed fixes every draw
    m = randomise_(Toy(), seed=3, norm_centre=lambda name: 0.0, bias_std=0.5)
    assert abs(m.o_norm.weight.mean()) < 0.02 and m.e_score_correction_bias.abs().max() > 0
    assert m.inv_freq.tolist() == [0, 1, 2]  # other buffers untouched
    with pytest.raises(TypeError, match="nn.Module"):
        randomise_(torch.zeros(3))


def _square_old(x):
    y = x * x
    return y


def _square_new(x):
    y = x * x
    y = y + 0  # a new line
    return y


def test_source_diff_counts_and_shows_only_changed_lines():
    from tinyk3.notebook import source_diff

    text = source_diff(_square_old, _square_new, "old", "new").splitlines()
    assert text[0] == "new: 4 lines, 2 added, 1 removed (old: 3 lines)"
    assert "-def _square_old(x):" in text and "+def _square_new(x):" in text
    assert "+    y = y + 0  # a new line" in text
    assert not any(line.startswith(("@@", " ")) for line in text[1:])  # changes only


def _documented():
    """Uses ``softmax`` and :func:`~tinyk3.ops.kda.chunked`, :class:`tinyk3.layers.KDAConfig`
    and :func:`the loop <tinyk3.ops.kda.recurrent>`; a lone `x` stays."""


def test_plain_doc_removes_rest_markup():
    from tinyk3.notebook import plain_doc

    assert plain_doc(_documented) == (
        "Uses softmax and chunked, tinyk3.layers.KDAConfig\nand the loop; a lone `x` stays.")
    assert plain_doc(lambda: None) == ""

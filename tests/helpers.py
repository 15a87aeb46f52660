"""What the tests share: model and cache feeding, and how the chapters' hand-written learner
answers are checked (tests/test_checks_chNN.py).

Each chapter file labels its answers where they are written: ``@wrong(exercise_id, mistake)`` on
one coded the way a learner gets the exercise wrong (``mistake`` the name the check should match,
or ``None`` for the exercise's general hint), ``@right(exercise_id)`` on one written differently
from the reference. Answers made by a factory (``_bugged("no_norm")``) are listed instead in a
``REALISTIC`` list of ``(exercise_id, fn, mistake)`` and a ``CORRECT`` dict
``{exercise_id: (fn, ...)}``. The assertions on what ``checks.run`` reports live here, once.
"""

from __future__ import annotations

import pytest
import torch

from tinyk3 import checks, util

# -- operators: the shapes and tolerances every form is held to ---------------------------------

# Relative to max(1, max |reference|). float64: the forms differ only in summation order.
# float32: a few ulps of sums of O(T·D) products (measured ≤ 3e-7; stated bound 1e-5).
OP_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
OP_DTYPES = [torch.float64, torch.float32]
OP_DTYPE_IDS = ["f64", "f32"]

# (B, H, T, Dk, Dv)
OP_SHAPES = [
    (1, 1, 1, 4, 4),  # a single token
    (2, 3, 7, 5, 3),  # Dk > Dv
    (1, 2, 16, 8, 8),  # T > Dk: keys must collide (the delta rule overwrites)
    (2, 1, 9, 3, 6),  # Dk < Dv
    (1, 2, 0, 4, 5),  # an empty sequence: o is [B, H, 0, Dv], the state passes through
]
OP_SHAPE_IDS = ["B{}H{}T{}Dk{}Dv{}".format(*s) for s in OP_SHAPES]


def delta_rule_inputs(B, H, T, Dk, Dv, dtype=torch.float32, seed=0):
    """q, L2-normalised k, v, β ∈ (0, 1) (in ``dtype``) and a non-zero float32 initial state, as
    layers feed the delta-rule operators and kernels."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, Dk, generator=g), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g)
    beta = torch.rand(B, H, T, generator=g)
    S0 = torch.randn(B, H, Dk, Dv, generator=g)
    return tuple(t.to(dtype) for t in (q, k, v, beta)) + (S0,)


# -- models and caches ---------------------------------------------------------------------------

def random_idx(vocab_size, B=2, T=16, seed=1):
    """Deterministic token ids ``[B, T]`` below ``vocab_size``."""
    return torch.randint(0, vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def param_dtype(model):
    """The dtype of a language model's parameters (its token embedding's)."""
    return model.transformer.wte.weight.dtype


def feed_in_blocks(model, idx, blocks):
    """Feed ``idx`` through one cache in blocks of the given sizes; return all logits and the
    cache. The cache's ``length`` must follow the tokens fed."""
    assert sum(blocks) == idx.shape[1]
    cache, outs, start = model.new_cache(), [], 0
    for n in blocks:
        outs.append(model(idx[:, start : start + n], cache=cache))
        start += n
        assert cache.length == start
    return torch.cat(outs, dim=1), cache


# -- learner answers -----------------------------------------------------------------------------


def run(exercise_id, fn):
    """``checks.run`` without printing: the verdict, for assertions on it."""
    return checks.run(exercise_id, fn, verbose=False)


def flat(text: str) -> str:
    """Whitespace runs made single spaces: printed reports are wrapped to 88 columns."""
    return " ".join(text.split())


def assert_failed(result, mistake=None):
    """A failed verdict matched to ``mistake`` (None: the exercise's general hint), with a hint."""
    assert result.status == "failed", result.report
    assert not result
    assert result.mistake == mistake, result.report
    assert 0 <= result.n_passed < result.n_cases
    assert result.failed_case is not None
    assert "Hint: " in result.report


def wrong(exercise_id: str, mistake: str | None = None):
    """Label a learner's wrong answer: the check of ``exercise_id`` must reject it and match it
    to the mistake named ``mistake`` (``None``: to none, the general hint)."""
    def label(fn):
        fn.__dict__.setdefault("wrong_for", []).append((exercise_id, mistake))
        return fn
    return label


def right(exercise_id: str):
    """Label a correct answer written differently from the reference: it must pass every case."""
    def label(fn):
        fn.__dict__.setdefault("right_for", []).append(exercise_id)
        return fn
    return label


def labelled(module, attr: str) -> list:
    """``(label, fn)`` for every function defined in ``module`` that carries ``attr``, in the
    order the module defines them."""
    return [(label, fn) for fn in vars(module).values()
            if callable(fn) and getattr(fn, "__module__", None) == module.__name__
            for label in getattr(fn, attr, ())]


def assert_caught(exercise_id, fn, mistake, capsys):
    """Run the check as a learner does (printed report): it fails, names the mistake, prints the
    mistake's hint (or the exercise's when ``mistake`` is None) and the first failing case."""
    result = checks.run(exercise_id, fn)
    assert_failed(result, mistake)
    out = capsys.readouterr().out
    ex = checks.EXERCISES[exercise_id]
    hint = next(m.hint for m in ex.mistakes if m.name == mistake) if mistake else ex.hint
    assert flat(f"Hint: {hint}") in flat(out)  # printed wrapped to REPORT_WIDTH columns
    assert f"First failure: case {result.failed_case}" in flat(out)
    assert max(len(line) for line in out.splitlines()) <= checks.core.REPORT_WIDTH, out
    return result


def assert_passes(exercise_id, fn):
    """A correct answer passes every case."""
    result = checks.run(exercise_id, fn, verbose=False)
    assert result, result.report
    assert result.n_passed == result.n_cases


def assert_two_named_wrong_answers(chapter, expected_ids, realistic):
    """The chapter registers exactly ``expected_ids``, and each has at least two hand-written wrong
    answers matched to named mistakes."""
    ids = sorted(e.id for e in checks.EXERCISES.values() if e.chapter == chapter)
    assert ids == expected_ids
    for exercise_id in ids:
        named = {m for e, _, m in realistic if e == exercise_id} - {None}
        assert len(named) >= 2, exercise_id


# -- transformers' modelling modules, imported without fla ---------------------------------------

def import_without_fla(name: str):
    """:func:`tinyk3.util.import_without_fla` (transformers' module ``name`` with fla and
    causal_conv1d hidden: with fla installed, transformers binds its Triton kernels on import, which
    fail on CPU), skipping the test if ``transformers`` lacks it."""
    try:
        return util.import_without_fla(name)
    except ImportError as e:  # pragma: no cover - an older transformers
        pytest.skip(f"transformers has no {name}: {e}")

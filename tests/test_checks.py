"""tinyk3.checks, the autograder: references pass, known mistakes are recognised, realistic
learner bugs get a useful report, and nothing the learner does makes the checker raise.

The first part runs over the whole registry (new exercises are covered automatically); the
second part is written by hand, the way learners actually get these exercises wrong, and is
deliberately independent of the registered Mistake functions.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_failed, flat, right, run, wrong
from tinyk3 import checks
from tinyk3.checks import CheckResult

EXERCISE_IDS = sorted(checks.EXERCISES)
MISTAKES = [(eid, m.name) for eid in EXERCISE_IDS for m in checks.EXERCISES[eid].mistakes]
STATUSES = ("passed", "failed", "error", "not attempted")


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _reference_output(exercise_id, case_index=0):
    ex = checks.EXERCISES[exercise_id]
    case = ex.cases()[case_index]
    return ex.reference(*case.args, **case.kwargs)


# == the registry ==============================================================================


def test_registry_holds_the_course_exercises():
    expected = {"gpt2.causal_attention", "gpt2.param_count", "gpt2.top_k_logits",
                "kv_cache.attend_with_cache", "kv_cache.cache_bytes"}
    assert expected <= set(EXERCISE_IDS)


def test_each_chapters_exercises_live_in_its_module():
    """checks/chNN_topic.py registers exactly the exercises whose chapter is NN."""
    import re
    from pathlib import Path

    folder = Path(checks.__file__).parent
    modules = sorted(p for p in folder.glob("*.py") if p.stem not in ("__init__", "core"))
    by_module = {}
    for path in modules:
        match = re.fullmatch(r"ch(\d\d)_\w+", path.stem)
        assert match, f"checks/{path.name} is not named after its chapter (chNN_topic.py)"
        ids = re.findall(r'^    id="([^"]+)"', path.read_text(), re.MULTILINE)
        assert ids, f"checks/{path.name} registers no exercise"
        by_module[path.stem] = ids
        for exercise_id in ids:
            assert checks.EXERCISES[exercise_id].chapter == int(match.group(1)), exercise_id
    assert sorted(i for ids in by_module.values() for i in ids) == sorted(EXERCISE_IDS)


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_exercise_metadata(exercise_id):
    ex = checks.EXERCISES[exercise_id]
    assert ex.id == exercise_id
    assert ex.title and ex.signature and ex.hint
    assert ex.chapter >= 1
    assert re.fullmatch(r"[a-z0-9_]+\.[a-z0-9_]+", exercise_id)  # "module.function"
    names = [m.name for m in ex.mistakes]
    assert len(names) == len(set(names)), "mistake names must be unique"
    assert all(m.hint for m in ex.mistakes)


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_reference_passes(exercise_id, capsys):
    ex = checks.EXERCISES[exercise_id]
    result = checks.run(exercise_id, ex.reference)
    assert result
    assert result.status == "passed"
    assert result.n_passed == result.n_cases >= 4
    assert result.failed_case is None and result.mistake is None
    assert result.max_abs_error == 0.0
    out = capsys.readouterr().out
    assert out == checks.core.wrap_report(result.report) + "\n"
    assert out.startswith("✔") and f"passed {result.n_cases}/{result.n_cases}" in out


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_cases_are_deterministic_and_labelled(exercise_id):
    ex = checks.EXERCISES[exercise_id]
    first, second = ex.cases(), ex.cases()
    assert len(first) == len(second) >= 4
    for a, b in zip(first, second):
        assert _equal(a.args, b.args) and _equal(a.kwargs, b.kwargs)
        assert a.label == b.label and a.label  # every case says what is special about it
    # the cases are not all the same
    assert len({repr([checks.core._describe(x) for x in c.args]) + c.label for c in first}) > 1


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_at_least_two_mistakes(exercise_id):
    assert len(checks.EXERCISES[exercise_id].mistakes) >= 2


@pytest.mark.parametrize("exercise_id,name", MISTAKES, ids=[f"{e}:{n}" for e, n in MISTAKES])
def test_each_registered_mistake_is_recognised(exercise_id, name, capsys):
    mistake = next(m for m in checks.EXERCISES[exercise_id].mistakes if m.name == name)
    result = checks.run(exercise_id, mistake.fn)
    assert_failed(result, mistake=name)
    report = capsys.readouterr().out
    assert flat(f"Hint: {mistake.hint}") in flat(report)  # printed wrapped to 88 columns
    assert f"case {result.failed_case}" in flat(report)
    assert report.startswith("✘")
    width = checks.core.REPORT_WIDTH
    assert all(len(line) <= width for line in report.splitlines()), (
        f"a printed line is wider than {width} columns:\n{report}")


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_run_is_repeatable(exercise_id):
    ex = checks.EXERCISES[exercise_id]
    fn = ex.mistakes[0].fn
    a, b = run(exercise_id, fn), run(exercise_id, fn)
    assert (a.status, a.report, a.failed_case, a.mistake) == (b.status, b.report, b.failed_case,
                                                              b.mistake)


# == learner faults, for every exercise: reported, never raised ==================================


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_stub_is_not_attempted(exercise_id, capsys):
    def stub(*args, **kwargs):
        raise NotImplementedError("write me")

    result = checks.run(exercise_id, stub)
    assert result.status == "not attempted" and not result
    assert result.n_passed == 0
    out = flat(capsys.readouterr().out)  # printed wrapped to 88 columns
    assert "not attempted" in out and checks.EXERCISES[exercise_id].signature in out


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_other_exception_is_an_error_with_its_name(exercise_id, capsys):
    def crashes(*args, **kwargs):
        return 1 / 0

    result = checks.run(exercise_id, crashes)
    assert result.status == "error" and not result
    assert result.failed_case == 1
    out = flat(capsys.readouterr().out)
    assert "ZeroDivisionError" in out and "division by zero" in out
    assert f"case 1/{result.n_cases}" in out
    assert "`return 1 / 0`" in out  # the learner's own line is quoted


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_exception_on_a_later_case(exercise_id):
    """Every case is run: the cases after the crash still count, and the crash is located."""
    ex = checks.EXERCISES[exercise_id]
    cases = ex.cases()
    calls = []

    def third_call_crashes(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise IndexError("index 9 is out of bounds")
        return ex.reference(*args, **kwargs)

    result = run(exercise_id, third_call_crashes)
    assert len(calls) == len(cases)  # not stopped at the exception
    assert result.status == "error" and not result
    assert (result.failed_case, result.n_passed) == (3, len(cases) - 1)
    assert result.mistake is None
    lines = result.report.splitlines()
    assert lines[0].endswith(f": {len(cases) - 1}/{len(cases)} cases passed.")
    assert lines[1].startswith(f"   On case 3/{len(cases)} ({cases[2].label}) your function "
                               "raised IndexError: index 9 is out of bounds (in ")
    assert lines[1].endswith("`raise IndexError(\"index 9 is out of bounds\")`)")
    assert lines[2] == "   inputs " + checks.core._describe_inputs(cases[2], ex.reference)
    assert lines[3] == f"   Hint: {ex.hint}"
    assert "First failure" not in result.report  # no value was wrong


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_not_implemented_on_a_later_case_is_an_exception(exercise_id):
    """Only a NotImplementedError on case 1 means 'not attempted'; later it is a crash."""
    ex = checks.EXERCISES[exercise_id]
    calls = []

    def gives_up_on_case_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise NotImplementedError("batches later")
        return ex.reference(*args, **kwargs)

    result = run(exercise_id, gives_up_on_case_2)
    assert result.status == "error" and not result
    assert (result.failed_case, result.n_passed) == (2, result.n_cases - 1)
    assert f"On case 2/{result.n_cases}" in result.report
    assert "raised NotImplementedError: batches later" in result.report
    assert "not attempted" not in result.report


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_exception_on_the_last_case_after_a_known_mistake_reports_both(exercise_id):
    """A registered mistake that also crashes on the last case: the value failure, its mistake
    and hint are reported (status failed), and so is the crash."""
    ex = checks.EXERCISES[exercise_id]
    mistake = ex.mistakes[0]
    cases = ex.cases()
    calls = []

    def wrong_then_crashes(*args, **kwargs):
        calls.append(1)
        if len(calls) == len(cases):
            raise KeyError("last")
        return mistake.fn(*args, **kwargs)

    # which of the cases before the crash the mistake gets right (by luck, e.g. T_new = 1)
    ok = [checks.core._compare(ex.reference(*c.args, **c.kwargs), mistake.fn(*c.args, **c.kwargs),
                               ex.atol, ex.rtol).ok for c in cases[:-1]]
    first_wrong = ok.index(False) + 1
    result = run(exercise_id, wrong_then_crashes)
    assert result.status == "failed" and not result
    assert result.failed_case == first_wrong < len(cases)
    assert result.n_passed == sum(ok)
    assert result.mistake == mistake.name
    report, n = result.report, len(cases)
    assert f"   First failure: case {first_wrong}/{n} ({cases[first_wrong - 1].label})" in report
    assert f"   On case {n}/{n} ({cases[-1].label}) your function raised KeyError: 'last'" in (
        report)
    assert report.endswith(f"   Hint: {mistake.hint}")


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_exception_before_the_first_value_failure(exercise_id):
    """Crash on case 1, wrong values afterwards: status failed (a value is wrong), and
    failed_case is the crash's case, the smaller of the two."""
    ex = checks.EXERCISES[exercise_id]
    calls = []

    def crashes_then_wrong(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("first call")
        return None

    result = run(exercise_id, crashes_then_wrong)
    assert result.status == "failed" and not result
    assert (result.failed_case, result.n_passed) == (1, 0)
    n = result.n_cases
    lines = result.report.splitlines()
    assert lines[0].endswith(f": 0/{n} cases passed.")
    assert lines[1].startswith(f"   First failure: case 2/{n}")
    assert lines[2] == "   your function returned None: did you forget a `return`?"
    assert lines[3].startswith(f"   On case 1/{n}") and "raised ValueError: first call" in lines[3]
    assert lines[-1] == f"   Hint: {ex.hint}"


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_returning_none(exercise_id, capsys):
    result = checks.run(exercise_id, lambda *a, **k: None)
    assert_failed(result)
    assert result.n_passed == 0 and result.failed_case == 1
    assert "returned None: did you forget a `return`?" in flat(capsys.readouterr().out)


@pytest.mark.parametrize("not_a_function", [None, 42, "causal_attention", torch.zeros(3)],
                         ids=["None", "int", "str", "tensor"])


@pytest.mark.parametrize("exercise_id", EXERCISE_IDS)
def test_not_callable(exercise_id, not_a_function, capsys):
    result = checks.run(exercise_id, not_a_function)
    assert result.status == "error" and not result
    out = flat(capsys.readouterr().out)
    assert "expected a function" in out and checks.EXERCISES[exercise_id].signature in out


@pytest.mark.parametrize("typo,suggestion", [
    ("gpt2.causal_atention", "gpt2.causal_attention"),
    ("gpt2.param_counts", "gpt2.param_count"),
    ("kv_cache.cache_byte", "kv_cache.cache_bytes"),
    ("kv_cache.attend_with_cach", "kv_cache.attend_with_cache"),
])


def test_unknown_exercise_suggests_close_match(typo, suggestion, capsys):
    result = checks.run(typo, lambda *a: None)
    assert result.status == "error" and not result
    out = flat(capsys.readouterr().out)
    assert repr(typo) in out and f"Did you mean {suggestion!r}" in out


def test_unknown_exercise_without_close_match():
    result = run("chapter9.flux_capacitor", lambda *a: None)
    assert result.status == "error"
    assert "no exercise called" in result.report and "Did you mean" not in result.report


# -- value mismatches in tensor-returning exercises --------------------------------------------

TENSOR_EXERCISES = [e for e in EXERCISE_IDS if isinstance(_reference_output(e), torch.Tensor)]
INT_EXERCISES = [e for e in EXERCISE_IDS
                 if isinstance(_reference_output(e), int)
                 and not isinstance(_reference_output(e), bool)]


def _shifted(exercise_id, delta):
    ref = checks.EXERCISES[exercise_id].reference
    return lambda *a, **k: ref(*a, **k) + delta


@pytest.mark.parametrize("exercise_id", TENSOR_EXERCISES)
def test_within_tolerance_passes(exercise_id):
    ex = checks.EXERCISES[exercise_id]
    result = run(exercise_id, _shifted(exercise_id, 0.2 * ex.atol))
    assert result, result.report
    assert 0 < result.max_abs_error <= ex.atol
    assert "max abs error" in result.report


@pytest.mark.parametrize("exercise_id", TENSOR_EXERCISES)
def test_value_mismatch_reports_distance(exercise_id, capsys):
    result = checks.run(exercise_id, _shifted(exercise_id, 0.01))
    assert_failed(result)
    assert result.failed_case == 1 and result.n_passed == 0
    assert result.max_abs_error == pytest.approx(0.01, rel=1e-3)
    out = flat(capsys.readouterr().out)
    assert "case 1" in out and "max abs error 0.01" in out and "tolerance" in out
    assert flat(f"Hint: {checks.EXERCISES[exercise_id].hint}") in flat(out)


@pytest.mark.parametrize("exercise_id", TENSOR_EXERCISES)
def test_wrong_shape(exercise_id):
    ref = checks.EXERCISES[exercise_id].reference
    result = run(exercise_id, lambda *a: ref(*a)[..., :1])
    assert_failed(result)
    assert "wrong shape: expected [" in result.report


@pytest.mark.parametrize("exercise_id", TENSOR_EXERCISES)
def test_wrong_dtype(exercise_id):
    ref = checks.EXERCISES[exercise_id].reference
    result = run(exercise_id, lambda *a: ref(*a).to(torch.float16))
    assert_failed(result)
    assert "wrong dtype: expected torch.float" in result.report and "float16" in result.report


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("exercise_id", TENSOR_EXERCISES)
def test_nan_or_inf_in_output(exercise_id, bad):
    ex = checks.EXERCISES[exercise_id]

    def poisoned(*a):
        out = ex.reference(*a).clone()
        first_finite = int(torch.isfinite(out).flatten().nonzero()[0])
        out.view(-1)[first_finite] = bad
        return out

    result = run(exercise_id, poisoned)
    assert_failed(result)
    assert result.failed_case == 1
    expected = _reference_output(exercise_id)
    where = tuple(int(i) for i in torch.nonzero(torch.isfinite(expected))[0])
    n_bad = int((~torch.isfinite(expected)).sum())
    if n_bad == 0:  # e.g. attention: the output should be all finite
        reason = (f"output has {int(math.isnan(bad))} NaN and {int(math.isinf(bad))} inf values "
                  f"(first at {where})")
    else:  # top-k: -inf is expected, but not there
        reason = (f"expected {n_bad} non-finite entries (inf or NaN), yours has {n_bad + 1}; "
                  f"first difference at {where}: expected {expected[where].item():.4g}, "
                  f"got {bad}")
    assert result.report.splitlines()[2] == f"   {reason}"  # the line after "First failure"


def test_nan_rows_are_counted():
    """A whole NaN row (e.g. a fully masked row) is counted, with the first position."""

    def last_row_nan(q, k, v):
        out = checks.EXERCISES["gpt2.causal_attention"].reference(q, k, v).clone()
        out[..., -1, :] = float("nan")
        return out

    result = run("gpt2.causal_attention", last_row_nan)
    assert_failed(result)
    assert "output has 16 NaN and 0 inf values (first at (0, 0, 4, 0))" in result.report  # H·D


@pytest.mark.parametrize("exercise_id", TENSOR_EXERCISES)
def test_tuple_instead_of_tensor(exercise_id):
    ref = checks.EXERCISES[exercise_id].reference
    result = run(exercise_id, lambda *a: (ref(*a), None))
    assert_failed(result)
    assert "expected a tensor [" in result.report and "got tuple of 2" in result.report


@pytest.mark.parametrize("exercise_id", TENSOR_EXERCISES)
def test_list_and_numpy_instead_of_tensor(exercise_id):
    ref = checks.EXERCISES[exercise_id].reference
    for convert, name in ((lambda t: t.tolist(), "list"), (lambda t: t.numpy(), "ndarray")):
        result = run(exercise_id, lambda *a, convert=convert: convert(ref(*a)))
        assert_failed(result)
        assert f"got {name}" in result.report


@pytest.mark.parametrize("exercise_id", TENSOR_EXERCISES)
def test_output_requiring_grad_is_fine(exercise_id):
    ref = checks.EXERCISES[exercise_id].reference
    assert run(exercise_id, lambda *a: ref(*a).clone().requires_grad_())


# -- int-returning exercises -------------------------------------------------------------------


@pytest.mark.parametrize("exercise_id", INT_EXERCISES)
def test_int_exercises_accept_equal_float_and_0d_tensor(exercise_id):
    ref = checks.EXERCISES[exercise_id].reference
    assert run(exercise_id, lambda *a: float(ref(*a)))
    assert run(exercise_id, lambda *a: torch.tensor(ref(*a)))


@pytest.mark.parametrize("exercise_id", INT_EXERCISES)
def test_int_exercises_report_the_difference(exercise_id):
    ref = checks.EXERCISES[exercise_id].reference
    result = run(exercise_id, lambda *a: ref(*a) + 1000)
    assert_failed(result)
    assert "(off by +1,000)" in result.report
    expected = ref(*checks.EXERCISES[exercise_id].cases()[0].args)
    assert f"expected {expected:,}" in result.report


@pytest.mark.parametrize("answer,phrase", [
    (lambda *a: "a lot", "expected an int, got str"),
    (lambda *a: True, "expected an int, got True"),
    (lambda *a: float("nan"), "got nan"),
    (lambda *a: float("inf"), "got inf"),
    (lambda *a: [1, 2], "expected an int, got list"),
], ids=["str", "bool", "nan", "inf", "list"])


@pytest.mark.parametrize("exercise_id", INT_EXERCISES)
def test_int_exercises_wrong_types(exercise_id, answer, phrase):
    result = run(exercise_id, answer)
    assert_failed(result)
    assert phrase in result.report


@pytest.mark.parametrize("exercise_id", INT_EXERCISES)
def test_int_exercises_accept_numpy_integers(exercise_id):
    """A learner who writes np.prod([...]) returns np.int64: accepted, and compared."""
    ref = checks.EXERCISES[exercise_id].reference
    assert run(exercise_id, lambda *a: np.int64(ref(*a)))
    assert run(exercise_id, lambda *a: np.float64(ref(*a)))
    assert run(exercise_id, lambda *a: np.array(ref(*a)))  # 0-d array
    result = run(exercise_id, lambda *a: np.int64(ref(*a) + 1000))
    assert_failed(result)
    assert "(off by +1,000)" in result.report
    result = run(exercise_id, lambda *a: np.array([ref(*a)]))  # 1-d: not a number
    assert_failed(result)
    assert "expected an int, got ndarray" in result.report


# -- status and truthiness ---------------------------------------------------------------------


@pytest.mark.parametrize("status", STATUSES)
def test_only_passed_is_truthy(status):
    assert bool(CheckResult("x", status, 3, 3)) is (status == "passed")
    assert repr(CheckResult("x", status, 1, 3)) == f"<CheckResult x: {status} 1/3>"


def test_non_passing_results_from_run_are_falsy():
    ex = "gpt2.param_count"
    results = [
        run(ex, checks.EXERCISES[ex].mistakes[0].fn),  # failed
        run(ex, lambda *a: 1 / 0),  # error
        run(ex, 7),  # error: not callable
        run("nope", lambda *a: 0),  # error: unknown exercise
        run(ex, lambda *a: (_ for _ in ()).throw(NotImplementedError)),  # not attempted
    ]
    assert [r.status for r in results] == ["failed", "error", "error", "error", "not attempted"]
    assert not any(results)


def test_verbose_false_prints_nothing(capsys):
    run("gpt2.param_count", lambda *a: 0)
    assert capsys.readouterr().out == ""


# -- in-place mutation of the inputs -------------------------------------------------------------


def test_learner_mutating_inputs_cannot_affect_reference_or_later_cases():
    """The learner scales q in place (a common 'optimisation') and zeroes k and v afterwards:
    the answer is right, and the reference and later cases must not see the damage."""
    seen = []

    def in_place(q, k, v):
        seen.append(q.clone())
        q.mul_(1 / math.sqrt(q.shape[-1]))
        T = q.shape[-2]
        s = (q @ k.transpose(-1, -2)).masked_fill(
            torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out = s.softmax(-1) @ v
        k.zero_()
        v.fill_(float("nan"))
        return out

    result = run("gpt2.causal_attention", in_place)
    assert result, result.report
    cases = checks.EXERCISES["gpt2.causal_attention"].cases()
    assert len(seen) == len(cases)
    for got, case in zip(seen, cases):
        assert torch.equal(got, case.args[0])  # each call saw the pristine case


def test_mutation_does_not_confuse_mistake_matching():
    """Unscaled scores, and the inputs wrecked after use: still recognised as `no_scale`."""

    def unscaled_then_wrecks(q, k, v):
        T = q.shape[-2]
        s = (q @ k.transpose(-1, -2)).masked_fill(
            torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out = s.softmax(-1) @ v
        for t in (q, k, v):
            t.mul_(-7.0)
        return out

    assert_failed(run("gpt2.causal_attention", unscaled_then_wrecks), mistake="no_scale")


def test_in_place_masked_fill_on_the_logits_passes():
    def in_place_top_k(logits, k):
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits[logits < kth] = float("-inf")  # learners often write it this way
        return logits

    assert run("gpt2.top_k_logits", in_place_top_k)


# == realistic learner answers, written by hand =================================================
# Each is how a learner would actually write it; the expected mistake is the registered name
# the checker should recognise, or None where no registered mistake explains the bug (then the
# report must still fail with the exercise's general hint).

# -- gpt2.causal_attention ----------------------------------------------------------------------


@wrong("gpt2.causal_attention", "no_scale")
def att_forgets_scale(q, k, v):
    T = q.size(-2)
    scores = q @ k.transpose(-2, -1)
    mask = torch.tril(torch.ones(T, T))
    scores = scores.masked_fill(mask == 0, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


@wrong("gpt2.causal_attention", "zeros_not_inf")
def att_tril_zeros_instead_of_minus_inf(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = torch.tril(scores)  # zeros above the diagonal: e^0 still gets weight
    return F.softmax(scores, dim=-1) @ v


@wrong("gpt2.causal_attention", "scale_by_d")
def att_divides_by_d(q, k, v):
    d_k = q.shape[-1]
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / d_k
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


@wrong("gpt2.causal_attention", "strict_mask")
def att_triu_forgets_diagonal_1(q, k, v):
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool))  # forgot diagonal=1
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


@wrong("gpt2.causal_attention", "no_mask")
def att_sdpa_without_is_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


@wrong("gpt2.causal_attention", "softmax_dim")
def att_softmax_over_queries(q, k, v):
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.tril(torch.ones(T, T)) == 0, float("-inf"))
    return scores.softmax(dim=-2) @ v


@wrong("gpt2.causal_attention", "inverted_mask")
def att_inverted_mask(q, k, v):
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.tril(torch.ones(T, T)).bool()  # True where allowed... then filled
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


def att_loop_into_float32_buffer(q, k, v):
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, D)  # float32 whatever the inputs
    for i in range(T):
        w = (q[:, :, i : i + 1] @ k[:, :, : i + 1].transpose(-1, -2) / math.sqrt(D)).softmax(-1)
        out[:, :, i : i + 1] = w @ v[:, :, : i + 1]
    return out


def att_fixed_size_mask(q, k, v):
    T = q.shape[-2]
    mask = torch.tril(torch.ones(32, 32))  # "block_size" from the lesson, hard-coded
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(mask[:T, :T] == 0, float("-inf"))
    return scores.softmax(-1) @ v


def att_returns_weights_too(q, k, v):
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    att = scores.masked_fill(torch.tril(torch.ones(T, T)) == 0, float("-inf")).softmax(-1)
    return att @ v, att


# Correct answers written differently from the reference: these must pass.
@right("gpt2.causal_attention")
def att_ok_additive_mask(q, k, v):
    T = q.shape[-2]
    mask = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + mask, dim=-1) @ v


@right("gpt2.causal_attention")
def att_ok_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@right("gpt2.causal_attention")
def att_ok_einsum(q, k, v):
    T = q.shape[-2]
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    s = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), s, -torch.inf)
    return torch.einsum("bhij,bhjd->bhid", s.softmax(-1), v)


# -- gpt2.param_count ---------------------------------------------------------------------------


@wrong("gpt2.param_count", "untied_head")
def pc_counts_lm_head(vocab_size, block_size, n_layer, n_embd):
    C = n_embd
    embeddings = vocab_size * C + block_size * C
    layer_norms = 2 * 2 * C
    attn = (C * 3 * C + 3 * C) + (C * C + C)
    mlp = (C * 4 * C + 4 * C) + (4 * C * C + C)
    per_block = layer_norms + attn + mlp
    lm_head = vocab_size * C
    return embeddings + n_layer * per_block + 2 * C + lm_head


@wrong("gpt2.param_count", "no_positions")
def pc_forgets_positions(vocab_size, block_size, n_layer, n_embd):
    C = n_embd
    return vocab_size * C + n_layer * (12 * C * C + 13 * C) + 2 * C


@wrong("gpt2.param_count", "no_biases")
def pc_forgets_linear_biases(vocab_size, block_size, n_layer, n_embd):
    C = n_embd
    attn = C * 3 * C + C * C
    mlp = C * 4 * C + 4 * C * C
    ln = 2 * (2 * C)
    return (vocab_size + block_size) * C + n_layer * (attn + mlp + ln) + 2 * C


@wrong("gpt2.param_count", "rule_of_thumb")
def pc_rule_of_thumb_12LC2(vocab_size, block_size, n_layer, n_embd):
    return 12 * n_layer * n_embd**2


@wrong("gpt2.param_count")
def pc_rule_of_thumb_plus_embeddings(vocab_size, block_size, n_layer, n_embd):
    return vocab_size * n_embd + block_size * n_embd + 12 * n_layer * n_embd**2


@wrong("gpt2.param_count", "no_final_ln")
def pc_forgets_final_layernorm(vocab_size, block_size, n_layer, n_embd):
    C = n_embd
    return (vocab_size + block_size) * C + n_layer * (12 * C * C + 13 * C)


@wrong("gpt2.param_count", "mlp_width")
def pc_mlp_hidden_is_c(vocab_size, block_size, n_layer, n_embd):
    C = n_embd
    per_block = 4 * C + (3 * C * C + 3 * C) + (C * C + C) + (C * C + C) + (C * C + C)
    return (vocab_size + block_size) * C + n_layer * per_block + 2 * C


@right("gpt2.param_count")
def pc_ok_by_modules(vocab_size, block_size, n_layer, n_embd):
    def linear(i, o):
        return i * o + o

    def layer_norm(n):
        return 2 * n

    C = n_embd
    block = (layer_norm(C) + linear(C, 3 * C) + linear(C, C) + layer_norm(C)
             + linear(C, 4 * C) + linear(4 * C, C))
    return vocab_size * C + block_size * C + n_layer * block + layer_norm(C)


# -- gpt2.top_k_logits --------------------------------------------------------------------------


@wrong("gpt2.top_k_logits", "zero_not_inf")
def tk_zeros_instead_of_minus_inf(logits, k):
    kth = torch.topk(logits, k, dim=-1).values[:, -1].unsqueeze(-1)
    return torch.where(logits >= kth, logits, torch.zeros_like(logits))


@wrong("gpt2.top_k_logits", "values_only")
def tk_returns_topk_values(logits, k):
    values, indices = torch.topk(logits, k)
    return values


@wrong("gpt2.top_k_logits", "global_k")
def tk_top_k_over_the_batch(logits, k):
    kth = torch.topk(logits.flatten(), k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


@wrong("gpt2.top_k_logits")
def tk_less_or_equal(logits, k):
    kth = torch.topk(logits, k).values[:, -1:]
    return logits.masked_fill(logits <= kth, float("-inf"))  # also drops the k-th itself


def tk_no_keepdim(logits, k):
    kth = torch.topk(logits, k).values[:, k - 1]  # [B], broadcasts against the vocab axis
    return logits.masked_fill(logits < kth, float("-inf"))


@wrong("gpt2.top_k_logits")
def tk_big_negative_not_inf(logits, k):
    kth = torch.topk(logits, k).values[:, -1:]
    return logits.masked_fill(logits < kth, -1e9)


def tk_off_by_one_index(logits, k):
    kth = torch.sort(logits, dim=-1, descending=True).values[:, k : k + 1]  # k-th is index k-1
    return logits.masked_fill(logits < kth, float("-inf"))


@right("gpt2.top_k_logits")
def tk_ok_sort(logits, k):
    sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)
    out = logits.clone()
    out[logits < sorted_logits[:, [k - 1]]] = -float("inf")
    return out


@right("gpt2.top_k_logits")
def tk_ok_scatter(logits, k):
    _, idx = logits.topk(k, dim=-1)
    out = torch.full_like(logits, float("-inf"))
    return out.scatter(-1, idx, logits.gather(-1, idx))


# -- kv_cache.attend_with_cache -----------------------------------------------------------------


@wrong("kv_cache.attend_with_cache", "top_left_mask")
def kv_sdpa_is_causal(q_new, k_cache, v_cache, k_new, v_new):
    k = torch.cat([k_cache, k_new], dim=2)
    v = torch.cat([v_cache, v_new], dim=2)
    return F.scaled_dot_product_attention(q_new, k, v, is_causal=True)  # top-left when Tq < Tk


@wrong("kv_cache.attend_with_cache", "no_mask")
def kv_no_mask(q_new, k_cache, v_cache, k_new, v_new):
    k = torch.cat([k_cache, k_new], dim=2)
    v = torch.cat([v_cache, v_new], dim=2)
    att = (q_new @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    return att.softmax(dim=-1) @ v  # right for one new token; a block sees its future


@wrong("kv_cache.attend_with_cache", "top_left_mask")
def kv_tril_square_mask(q_new, k_cache, v_cache, k_new, v_new):
    k = torch.cat([k_cache, k_new], dim=2)
    v = torch.cat([v_cache, v_new], dim=2)
    Tq, Tk = q_new.shape[-2], k.shape[-2]
    att = (q_new @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    att = att.masked_fill(torch.tril(torch.ones(Tq, Tk)) == 0, float("-inf"))
    return att.softmax(dim=-1) @ v


@wrong("kv_cache.attend_with_cache", "new_only")
def kv_ignores_cache(q_new, k_cache, v_cache, k_new, v_new):
    return F.scaled_dot_product_attention(q_new, k_new, v_new, is_causal=True)


@wrong("kv_cache.attend_with_cache", "no_scale")
def kv_forgets_scale(q_new, k_cache, v_cache, k_new, v_new):
    k = torch.cat([k_cache, k_new], dim=2)
    v = torch.cat([v_cache, v_new], dim=2)
    Tq, Tk = q_new.shape[-2], k.shape[-2]
    att = q_new @ k.transpose(-2, -1)
    att = att.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq), float("-inf"))
    return att.softmax(-1) @ v


@wrong("kv_cache.attend_with_cache")
def kv_new_before_cached(q_new, k_cache, v_cache, k_new, v_new):
    k = torch.cat([k_new, k_cache], dim=2)  # wrong order
    v = torch.cat([v_new, v_cache], dim=2)
    Tq, Tk = q_new.shape[-2], k.shape[-2]
    mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
    return F.scaled_dot_product_attention(q_new, k, v, attn_mask=mask)


@right("kv_cache.attend_with_cache")
def kv_ok_explicit_mask(q_new, k_cache, v_cache, k_new, v_new):
    T_past = k_cache.shape[2]
    k = torch.cat([k_cache, k_new], dim=2)
    v = torch.cat([v_cache, v_new], dim=2)
    Tq, Tk = q_new.shape[2], k.shape[2]
    mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=T_past)
    return F.scaled_dot_product_attention(q_new, k, v, attn_mask=mask)


@right("kv_cache.attend_with_cache")
def kv_ok_two_parts(q_new, k_cache, v_cache, k_new, v_new):
    """Scores against the cache (all visible) and against the new keys (causal), one softmax."""
    d = q_new.shape[-1]
    Tn = q_new.shape[-2]
    s_old = q_new @ k_cache.transpose(-1, -2) / math.sqrt(d)
    s_new = q_new @ k_new.transpose(-1, -2) / math.sqrt(d)
    s_new = s_new.masked_fill(torch.ones(Tn, Tn, dtype=torch.bool).triu(1), float("-inf"))
    w = torch.cat([s_old, s_new], dim=-1).softmax(-1)
    return w[..., : k_cache.shape[2]] @ v_cache + w[..., k_cache.shape[2] :] @ v_new


# -- kv_cache.cache_bytes -----------------------------------------------------------------------


@wrong("kv_cache.cache_bytes", "keys_only")
def cb_keys_only(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value):
    return n_layer * n_head * head_dim * seq_len * batch_size * bytes_per_value


@wrong("kv_cache.cache_bytes", "one_layer")
def cb_forgets_layers(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value):
    return 2 * n_head * head_dim * seq_len * batch_size * bytes_per_value


@wrong("kv_cache.cache_bytes", "one_head")
def cb_head_dim_as_width(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value):
    d_model = head_dim  # confuses the head size with the model width
    return 2 * n_layer * d_model * seq_len * batch_size * bytes_per_value


@wrong("kv_cache.cache_bytes", "no_batch")
def cb_forgets_batch(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value):
    return 2 * n_layer * n_head * head_dim * seq_len * bytes_per_value


@wrong("kv_cache.cache_bytes", "bits")
def cb_bits_not_bytes(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value):
    return 2 * n_layer * n_head * head_dim * seq_len * batch_size * bytes_per_value * 8


@wrong("kv_cache.cache_bytes")
def cb_in_gib(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value):
    return 2 * n_layer * n_head * head_dim * seq_len * batch_size * bytes_per_value / 2**30


@right("kv_cache.cache_bytes")
def cb_ok_float_arithmetic(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value):
    per_token = 2.0 * n_layer * n_head * head_dim * bytes_per_value
    return per_token * seq_len * batch_size


@right("kv_cache.cache_bytes")
def cb_ok_math_prod(n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value):
    return math.prod([2, n_layer, n_head, head_dim, seq_len, batch_size, bytes_per_value])


# Chapters 1 and 2's learner answers (tests/test_learner_answers.py runs them)


def test_float32_buffer_fails_only_the_float64_case():
    result = run("gpt2.causal_attention", att_loop_into_float32_buffer)
    assert_failed(result)
    assert result.n_passed == result.n_cases - 1 == result.failed_case - 1
    assert "float64 inputs: keep the dtype" in result.report
    assert "wrong dtype: expected torch.float64, got torch.float32" in result.report


def test_hard_coded_mask_size_is_an_error_on_the_long_case():
    result = run("gpt2.causal_attention", att_fixed_size_mask)
    assert result.status == "error" and not result
    # only T=64 > 32 crashes; the float64 case after it is still run and passes
    assert (result.failed_case, result.n_passed, result.n_cases) == (5, 5, 6)
    assert "On case 5/6 (B=1, H=1, T=64, D=32) your function raised RuntimeError" in (
        result.report)
    assert "`scores = scores.masked_fill(mask[:T, :T] == 0, float(\"-inf\"))`" in result.report
    assert "inputs q=tensor [1, 1, 64, 32] float32" in result.report


def test_returning_weights_too_is_a_tuple_failure():
    result = run("gpt2.causal_attention", att_returns_weights_too)
    assert_failed(result)
    assert result.failed_case == 1 and result.n_passed == 0
    assert "got tuple of 2: (tensor [1, 2, 5, 8] float32, tensor [1, 2, 5, 5] float32)" in (
        result.report)


def test_top_k_without_keepdim_crashes_with_a_broadcast_error():
    result = run("gpt2.top_k_logits", tk_no_keepdim)
    assert result.status == "error" and result.mistake is None
    # B=1 (cases 1 and 5) broadcasts by luck; the first crash is reported, not the others
    assert (result.n_passed, result.failed_case) == (2, 2)
    assert "On case 2/5 (B=2, V=10, k=3) your function raised RuntimeError" in result.report
    assert "On case 3/5" not in result.report and "First failure" not in result.report


def test_big_negative_instead_of_minus_inf_names_both_counts():
    result = run("gpt2.top_k_logits", tk_big_negative_not_inf)
    assert_failed(result)  # general hint: no registered mistake
    assert (result.failed_case, result.max_abs_error) == (1, math.inf)
    assert ("expected 9 non-finite entries (inf or NaN), yours has 0; first difference at "
            "(0, 0): expected -inf, got -1e+09") in result.report
    assert "not 0, not a large negative number" in result.report


def test_exception_after_a_value_failure_keeps_the_first_failure():
    """An off-by-one top-k (`sort(...).values[:, k:k+1]`) is wrong on cases 1-4 and raises on
    case 5 (k = V, an empty slice): both are reported, with the off_by_one hint."""
    result = run("gpt2.top_k_logits", tk_off_by_one_index)
    assert result.status == "failed" and not result
    assert (result.failed_case, result.n_passed) == (1, 0)
    assert result.mistake == "off_by_one"
    lines = result.report.splitlines()
    assert lines[0].endswith(": 0/5 cases passed.")
    assert lines[1] == ("   First failure: case 1/5 (B=1, V=10, k=1), inputs "
                        "logits=tensor [1, 10] float32, k=1")
    assert lines[2].startswith("   expected 9 non-finite entries (inf or NaN), yours has 8;")
    assert lines[3].startswith("   On case 5/5 (B=1, V=7, k=7) your function raised "
                               "RuntimeError: ")
    assert "`return logits.masked_fill(logits < kth, float(\"-inf\"))`" in lines[3]
    assert lines[4] == "   inputs logits=tensor [1, 7] float32, k=7"
    hint = next(m.hint for m in checks.EXERCISES["gpt2.top_k_logits"].mistakes
                if m.name == "off_by_one")
    assert lines[5] == f"   Hint: {hint}" and len(lines) == 6

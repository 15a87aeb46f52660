"""Chapter 18's exercises (reading the closing comparison), answered the way learners get them
wrong and right.

The wrong answers are written independently of the registered Mistake functions; the
references are tied to independent computations: the Pareto front to a brute-force comparison
of every pair with numpy, the context budget to a search over lengths and to a model's real
cache (``tinyk3.compare``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from helpers import right, run, wrong
from tinyk3 import checks, compare
from tinyk3.models import LM

# -- compare.pareto_front -------------------------------------------------------------------------


@wrong("compare.pareto_front", "strict_everywhere")
def pf_any_better(names, costs):
    """Removes a row only when another row is strictly better on every cost."""
    keep = []
    for i, c in enumerate(costs):
        if not any(all(a < b for a, b in zip(o, c)) for j, o in enumerate(costs) if j != i):
            keep.append(names[i])
    return keep


@wrong("compare.pareto_front", "ties_dominate")
def pf_le_everywhere(names, costs):
    out = []
    for i, c in enumerate(costs):
        beaten = any(all(a <= b for a, b in zip(costs[j], c)) for j in range(len(costs)) if j != i)
        if not beaten:
            out.append(names[i])
    return out


@wrong("compare.pareto_front", "higher_is_better")
def pf_maximise(names, costs):
    arr = np.array(costs, dtype=float)
    keep = []
    for i in range(len(arr)):
        dom = (arr >= arr[i]).all(1) & (arr > arr[i]).any(1)
        if not dom.any():
            keep.append(names[i])
    return keep


@wrong("compare.pareto_front", "best_per_cost")
def pf_column_winners(names, costs):
    arr = np.array(costs, dtype=float)
    winners = set(arr.argmin(0).tolist())
    return [n for i, n in enumerate(names) if i in winners]


@right("compare.pareto_front")
def pf_ok_numpy(names, costs):
    arr = np.array(costs, dtype=float)
    keep = []
    for i in range(len(arr)):
        dom = (arr <= arr[i]).all(1) & (arr < arr[i]).any(1)
        if not dom.any():
            keep.append(names[i])
    return keep


@right("compare.pareto_front")
def pf_ok_sorted(names, costs):
    """Sort by the costs, then test each row only against the rows before it and the ties."""
    order = sorted(range(len(costs)), key=lambda i: tuple(costs[i]))
    kept = set()
    for pos, i in enumerate(order):
        if not any(all(a <= b for a, b in zip(costs[j], costs[i])) and costs[j] != costs[i]
                   for j in order[:pos]):
            kept.add(i)
    return [n for i, n in enumerate(names) if i in kept]


# -- compare.tokens_in_budget ---------------------------------------------------------------------


@wrong("compare.tokens_in_budget", "ignores_fixed")
def tb_no_fixed(budget, fixed, per, limit):
    if per == 0:
        return limit
    return min(limit, budget // per)


@wrong("compare.tokens_in_budget", "rounds_up")
def tb_ceil(budget, fixed, per, limit):
    if fixed > budget:
        return 0
    if per == 0:
        return limit
    return min(limit, math.ceil((budget - fixed) / per))


@wrong("compare.tokens_in_budget", "negative")
def tb_negative(budget, fixed, per, limit):
    if per == 0:
        return limit if fixed <= budget else 0
    return min(limit, (budget - fixed) // per)


@wrong("compare.tokens_in_budget", "no_limit")
def tb_unbounded(budget, fixed, per, limit):
    if fixed > budget:
        return 0
    return limit if per == 0 else (budget - fixed) // per


def tb_divides_by_zero(budget, fixed, per, limit):
    return max(0, min(limit, (budget - fixed) // per))


@right("compare.tokens_in_budget")
def tb_ok_search(budget, fixed, per, limit):
    if fixed > budget:
        return 0
    if per == 0:
        return limit
    lo, hi = 0, limit  # the largest T in [0, limit] with fixed + T·per <= budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fixed + mid * per <= budget else (lo, mid - 1)
    return lo


@right("compare.tokens_in_budget")
def tb_ok_float(budget, fixed, per, limit):
    if budget < fixed:
        return 0
    return limit if not per else int(min(limit, math.floor((budget - fixed) / per)))


def test_division_by_zero_and_nan_are_reported_not_raised():
    result = run("compare.tokens_in_budget", tb_divides_by_zero)
    assert result.status == "error" and "ZeroDivisionError" in result.report
    result = run("compare.tokens_in_budget", lambda *a: float("nan"))
    assert result.status == "failed" and "nan" in result.report
    result = run("compare.pareto_front", lambda names, costs: [float("nan")])
    assert result.status == "failed"


def test_the_front_reference_equals_brute_force_on_random_tables():
    g = torch.Generator().manual_seed(0)
    ref = checks.EXERCISES["compare.pareto_front"].reference
    sizes = 0
    for n, m in [(1, 1), (5, 2), (12, 3), (30, 2), (20, 4)]:
        for _ in range(10):
            costs = torch.randint(0, 5, (n, m), generator=g).tolist()
            names = [f"r{i}" for i in range(n)]
            front = ref(names, costs)
            assert front == pf_ok_numpy(names, costs)
            assert front, "a finite table always has a front"
            sizes += len(front)
    assert sizes < 5 * 10 * 20  # the front is not everything: the cases can fail a keep-all


def test_the_budget_reference_matches_a_real_cache():
    """At the returned length the measured cache fits the budget, one token more does not."""
    torch.manual_seed(0)
    ref = checks.EXERCISES["compare.tokens_in_budget"].reference
    for name in ("softmax + conv", "KDA + MLA"):
        model = LM(compare.tiny_config(name, vocab_size=32, d_model=16, n_head=2))
        growth = compare.cache_growth(model, (8, 16))
        budget = int(growth.fixed + 37.5 * growth.per_token)
        T = ref(budget, growth.fixed, growth.per_token, 10_000)
        assert T == 37
        assert compare.prefill(model, T).nbytes() <= budget < compare.prefill(model, T + 1).nbytes()

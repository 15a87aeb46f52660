"""Chapter 18 exercises: reading the closing comparison. Which mechanisms no other one beats on
every measure (the Pareto front), and the longest context whose decoding state fits a memory
budget."""

from __future__ import annotations

import torch

from .core import Case, Exercise, Mistake, register

# -- compare.pareto_front -------------------------------------------------------------------------


def _dominates(a, b) -> bool:
    """``a`` is at least as good as ``b`` on every cost and better on one (costs: lower is
    better)."""
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


def pareto_front(names, costs):
    """Reference: the names, in their given order, of the rows that no other row dominates.

    ``costs[i]`` is a sequence of numbers for ``names[i]``, every one of them *lower is better*
    (negate a measure where higher is better). Row ``j`` dominates row ``i`` when it is at
    least as good on every cost and strictly better on at least one; two identical rows do not
    dominate each other, so both stay."""
    rows = [tuple(float(x) for x in c) for c in costs]
    return [n for n, c in zip(names, rows)
            if not any(_dominates(other, c) for other in rows)]


def _front_cases(gen) -> list[Case]:
    def case(names, costs, label):
        return Case((list(names), [list(c) for c in costs]),
                    label=f"{len(names)} rows of {len(costs[0])} costs: {label}")

    def random_rows(n, m):
        x = torch.randint(0, 6, (n, m), generator=gen).tolist()  # small ints: ties happen
        return [f"m{i}" for i in range(n)], x

    letters = list("ABCDE")
    return [
        case(letters[:3], [[1, 3], [2, 2], [3, 1]], "a trade-off: nobody is dominated"),
        case(letters[:3], [[1, 1], [2, 2], [0, 3]], "B is worse than A on both"),
        case(letters[:4], [[1, 2], [1, 2], [2, 3], [0, 5]],
             "A and B identical: neither dominates the other"),
        case(letters[:3], [[1, 2], [1, 3], [2, 2]], "ties on one cost: B and C are dominated"),
        case(letters[:1], [[4.0, 1.0, 2.0]], "one row"),
        case(letters[:5], [[0.5, 9, 1], [0.4, 9, 1], [0.6, 1, 1], [0.4, 9, 2], [9, 9, 0]],
             "three costs, floats"),
        case(*random_rows(8, 2), "random, 2 costs"),
        case(*random_rows(10, 3), "random, 3 costs"),
    ]


def _mistake_front(kind):
    def fn(names, costs):
        rows = [tuple(float(x) for x in c) for c in costs]
        if kind == "strict_everywhere":  # dominated only if strictly worse on every cost
            dom = lambda a, b: all(x < y for x, y in zip(a, b))  # noqa: E731
        elif kind == "ties_dominate":  # ≤ everywhere, nothing strict: twins remove each other
            dom = lambda a, b: all(x <= y for x, y in zip(a, b))  # noqa: E731
            return [n for i, (n, c) in enumerate(zip(names, rows))
                    if not any(dom(o, c) for j, o in enumerate(rows) if j != i)]
        elif kind == "higher_is_better":
            dom = lambda a, b: _dominates(b, a)  # noqa: E731
        elif kind == "best_per_cost":  # the winners of each column
            best = {min(range(len(rows)), key=lambda i: rows[i][k]) for k in range(len(rows[0]))}
            return [n for i, n in enumerate(names) if i in best]
        else:
            raise ValueError(kind)
        return [n for n, c in zip(names, rows) if not any(dom(o, c) for o in rows)]

    return fn


register(Exercise(
    id="compare.pareto_front",
    title="the mechanisms no other one beats on every measure",
    signature="pareto_front(names: list, costs: list of lists, lower is better) -> list of names",
    reference=pareto_front,
    make_cases=_front_cases,
    chapter=18,
    mistakes=[
        Mistake("strict_everywhere", _mistake_front("strict_everywhere"),
                "you removed a row only when another is strictly better on every cost: a row "
                "that ties on one cost and loses on another is dominated too (at least as good "
                "everywhere, strictly better somewhere)."),
        Mistake("ties_dominate", _mistake_front("ties_dominate"),
                "rows that tie with another on every cost disappeared: 'at least as good "
                "everywhere' is not enough, the other row must also be strictly better on one "
                "cost. Two identical rows both stay."),
        Mistake("higher_is_better", _mistake_front("higher_is_better"),
                "you kept the rows that are worst: every cost here is lower-is-better."),
        Mistake("best_per_cost", _mistake_front("best_per_cost"),
                "you kept the best row of each cost: the front also holds every compromise that "
                "no single row beats on all costs at once."),
    ],
    hint="keep names[i] unless some row j has costs[j][k] <= costs[i][k] for every k and < for "
         "at least one k; keep the input order.",
))


# -- compare.tokens_in_budget ---------------------------------------------------------------------


def tokens_in_budget(budget_bytes, fixed_bytes, bytes_per_token, max_context):
    """Reference: the longest context ``T`` (an int, at most ``max_context``) at which a
    decoding state of ``fixed_bytes + T · bytes_per_token`` fits in ``budget_bytes``; 0 when
    not even the fixed part fits. A state that does not grow (``bytes_per_token == 0``) fits at
    every length up to ``max_context``."""
    if fixed_bytes > budget_bytes:
        return 0
    if bytes_per_token == 0:
        return int(max_context)
    return int(min(max_context, (budget_bytes - fixed_bytes) // bytes_per_token))


def _budget_cases(gen) -> list[Case]:
    del gen

    def case(budget, fixed, per, limit, label):
        return Case((budget, fixed, per, limit),
                    label=f"budget {budget:,} B, fixed {fixed:,} B, {per:,} B per token, "
                          f"context limit {limit:,}: {label}")

    return [
        case(10_000, 1_000, 100, 1_000_000, "a growing cache"),
        case(10_050, 1_000, 100, 1_000_000, "the budget is not a multiple: round down"),
        case(5_000, 20_992, 0, 4_096, "a fixed state larger than the budget"),
        case(1 << 20, 20_992, 0, 4_096, "a fixed state: every length up to the limit"),
        case(1 << 30, 10_496, 128, 4_096, "the limit binds"),
        case(999, 0, 1_000, 100, "not even one token"),
        case(1_000, 2_000, 10, 100, "a growing cache whose fixed part is already too large"),
        case(141 * 10**9, 465 * 10**6, 27_648, 1_048_576,
             "K3-sized: 465 MB of KDA states, 27,648 B of MLA cache per token, 141 GB"),
    ]


def _mistake_budget(kind):
    def fn(budget, fixed, per, limit):
        if kind == "ignores_fixed":
            fixed = 0
        if fixed > budget and kind != "negative":
            return 0
        if per == 0:
            return int(limit)
        if kind == "rounds_up":
            t = -(-(budget - fixed) // per)
        else:
            t = (budget - fixed) // per
        return int(t) if kind == "no_limit" else int(min(limit, t))

    return fn


register(Exercise(
    id="compare.tokens_in_budget",
    title="the longest context whose decoding state fits",
    signature="tokens_in_budget(budget_bytes, fixed_bytes, bytes_per_token, max_context) -> int",
    reference=tokens_in_budget,
    make_cases=_budget_cases,
    chapter=18,
    mistakes=[
        Mistake("ignores_fixed", _mistake_budget("ignores_fixed"),
                "you left out the fixed part: the recurrent layers' states and the "
                "convolution windows take fixed_bytes before the first token of cache."),
        Mistake("rounds_up", _mistake_budget("rounds_up"),
                "you rounded up: a context of T tokens must fit entirely, so T is the floor of "
                "(budget − fixed) / bytes_per_token."),
        Mistake("negative", _mistake_budget("negative"),
                "when the fixed part alone exceeds the budget, no context fits: return 0, not a "
                "negative length."),
        Mistake("no_limit", _mistake_budget("no_limit"),
                "the model's context limit caps the answer: a large budget does not make a "
                "model read past max_context."),
    ],
    hint="0 if fixed_bytes > budget_bytes; max_context if bytes_per_token == 0; otherwise "
         "min(max_context, (budget_bytes − fixed_bytes) // bytes_per_token).",
))

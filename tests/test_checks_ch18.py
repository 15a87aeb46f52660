"""Chapter 18's exercises (reading the closing comparison), answered the way learners get them
wrong and right.

The wrong answers are written independently of the registered Mistake functions; the
references are tied to independent computations: the cache bytes to what every mechanism's
cache measures, the context budget to a search over lengths and to a model's real cache
(``tinyk3.compare``); ``compare.pareto_front``, which the chapter uses, to a brute-force
comparison of every pair with numpy.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from helpers import right, run, wrong
from tinyk3 import checks, compare
from tinyk3.models import LM

# -- compare.cache_bytes ---------------------------------------------------------------------------


@wrong("compare.cache_bytes", "keys_only")
def cb_keys(cfg, nbytes):
    per = {"softmax": cfg.n_embd}
    total = 0
    for spec in cfg.layer_mixers:
        if spec.kind == "mla":
            total += spec.kv_lora_rank + spec.qk_rope_head_dim
        else:
            total += per.get(spec.kind, 0)
    return total * nbytes


@wrong("compare.cache_bytes", "one_head")
def cb_one_head(cfg, nbytes):
    total = 0
    for spec in cfg.layer_mixers:
        if spec.kind == "softmax":
            total += 2 * (cfg.n_embd // spec.n_head)  # one head's key and value
        elif spec.kind == "mla":
            total += spec.kv_lora_rank + spec.qk_rope_head_dim
    return nbytes * total


@wrong("compare.cache_bytes", "mla_as_mha")
def cb_mla_expanded(cfg, nbytes):
    total = 0
    for spec in cfg.layer_mixers:
        if spec.kind == "softmax":
            total += 2 * cfg.n_embd
        elif spec.kind == "mla":  # every head's key (nope + rope) and value
            total += spec.n_head * (spec.qk_nope_head_dim + spec.qk_rope_head_dim
                                    + spec.v_head_dim)
    return nbytes * total


@wrong("compare.cache_bytes", "latent_only")
def cb_latent(cfg, nbytes):
    return nbytes * sum(2 * cfg.n_embd if s.kind == "softmax" else
                        s.kv_lora_rank if s.kind == "mla" else 0 for s in cfg.layer_mixers)


@wrong("compare.cache_bytes", "rope_if_rotated")
def cb_rotated_only(cfg, nbytes):
    total = 0
    for spec in cfg.layer_mixers:
        if spec.kind == "softmax":
            total += 2 * cfg.n_embd
        elif spec.kind == "mla":
            total += spec.kv_lora_rank + (spec.qk_rope_head_dim if spec.use_rope else 0)
    return nbytes * total


@wrong("compare.cache_bytes", "values")
def cb_numbers(cfg, nbytes):
    return sum(2 * cfg.n_embd if s.kind == "softmax" else
               s.kv_lora_rank + s.qk_rope_head_dim if s.kind == "mla" else 0
               for s in cfg.layer_mixers)


@right("compare.cache_bytes")
def cb_ok_kinds(cfg, nbytes):
    per_kind = {"softmax": lambda s: 2 * cfg.n_embd,
                "mla": lambda s: s.kv_lora_rank + s.qk_rope_head_dim}
    return nbytes * sum(per_kind.get(s.kind, lambda s: 0)(s) for s in cfg.layer_mixers)


@right("compare.cache_bytes")
def cb_ok_heads(cfg, nbytes):
    """Head by head: each softmax head keeps a key and a value of n_embd / n_head."""
    total = 0
    for spec in cfg.layer_mixers:
        if spec.kind == "softmax":
            total += spec.n_head * 2 * (cfg.n_embd // spec.n_head)
        elif spec.kind == "mla":
            total += spec.kv_lora_rank + spec.qk_rope_head_dim
    return total * nbytes


def test_the_cache_reference_is_what_every_mechanisms_cache_measures():
    """The formula against the bytes a real cache holds (float32), for every row at two
    sizes, and the presets against the numbers chapters 13 and 17 print."""
    ref = checks.EXERCISES["compare.cache_bytes"].reference
    for name in compare.MECHANISMS:
        for d, h in ((16, 2), (32, 4)):
            torch.manual_seed(0)
            model = LM(compare.tiny_config(name, vocab_size=32, d_model=d, n_head=h))
            assert ref(model.config, 4) == compare.cache_growth(model, (8, 24)).per_token, name
    from tinyk3.models import presets

    assert ref(presets.gpt2_small(), 2) == 36_864  # 12 · 2 · 768 · 2 B
    assert ref(presets.deepseek_v3(), 2) == 61 * 576 * 2  # 61 layers of 512 + 64
    assert ref(presets.kimi_k3(), 2) == 27_648  # 24 MLA layers of 576, the KDA layers none


def brute_force_front(names, costs):
    arr = np.array(costs, dtype=float)
    keep = []
    for i in range(len(arr)):
        dom = (arr <= arr[i]).all(1) & (arr < arr[i]).any(1)
        if not dom.any():
            keep.append(names[i])
    return keep


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
    result = run("compare.cache_bytes", lambda cfg, nbytes: float("nan"))
    assert result.status == "failed"


def test_the_front_equals_brute_force_on_random_tables():
    g = torch.Generator().manual_seed(0)
    ref = compare.pareto_front
    sizes = 0
    for n, m in [(1, 1), (5, 2), (12, 3), (30, 2), (20, 4)]:
        for _ in range(10):
            costs = torch.randint(0, 5, (n, m), generator=g).tolist()
            names = [f"r{i}" for i in range(n)]
            front = ref(names, costs)
            assert front == brute_force_front(names, costs)
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

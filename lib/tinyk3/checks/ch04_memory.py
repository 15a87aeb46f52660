"""Chapter 4 exercises: write an associative memory, score its recall, predict its crosstalk."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import memory
from .core import Case, Exercise, Mistake, register

# -- memory.write_memory -------------------------------------------------------------------------


def write_memory(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``S = Σ_j k_jᵀ v_j`` for ``keys [N, Dk]``, ``values [N, Dv]`` (reference)."""
    return memory.write(keys, values)


def _write_cases(g: torch.Generator) -> list[Case]:
    cases = []
    for N, Dk, Dv, label in [
        (5, 8, 8, "N=5 pairs, Dk=Dv=8"),
        (12, 6, 10, "Dk < Dv: the state is [Dk, Dv]"),
        (20, 16, 4, "Dk > Dv, more pairs than Dv"),
        (1, 4, 4, "a single pair: S is one outer product"),
        (40, 8, 8, "more pairs than dimensions"),
    ]:
        keys = torch.randn(N, Dk, generator=g)
        cases.append(Case((keys, torch.randn(N, Dv, generator=g)), label=label))
    keys = torch.randn(7, 5, generator=g, dtype=torch.float64)
    cases.append(Case((keys, torch.randn(7, 3, generator=g, dtype=torch.float64)),
                      label="float64 inputs: keep the dtype"))
    return cases


register(Exercise(
    id="memory.write_memory",
    title="write an associative memory",
    signature="write_memory(keys [N, Dk], values [N, Dv]) -> S [Dk, Dv]",
    reference=write_memory,
    make_cases=_write_cases,
    chapter=4,
    mistakes=[
        Mistake("transposed", lambda k, v: v.T @ k,
                "your state is the transpose, Σ v_jᵀ k_j of shape [Dv, Dk] (the papers' layout). "
                "In this course a key reads the state from the left, k S, so S = Σ k_jᵀ v_j = Kᵀ V "
                "is [Dk, Dv]."),
        Mistake("mean", lambda k, v: k.T @ v / k.shape[0],
                "you averaged the outer products; the memory is their sum (dividing by N shrinks "
                "every read-out by N)."),
        Mistake("last_pair_only", lambda k, v: torch.outer(k[-1], v[-1]),
                "your state holds only the last pair: in the loop, S = outer(k_j, v_j) replaces "
                "the state instead of adding to it (S = S + outer(k_j, v_j))."),
        Mistake("outer_of_sums", lambda k, v: torch.outer(k.sum(0), v.sum(0)),
                "you took the outer product of the summed keys and the summed values, "
                "(Σ_i k_i)ᵀ(Σ_j v_j), which also adds every cross pair k_iᵀ v_j with i ≠ j. "
                "Pair each key with its own value first, then sum: Σ_j k_jᵀ v_j."),
    ],
    hint="S[a, b] = Σ_j keys[j, a] · values[j, b]: one matrix product, keys.T @ values.",
))

# -- memory.recall_accuracy ----------------------------------------------------------------------


def _accuracy(S, keys, values, *, against="values", dim=-1, cosine=True, count=False):
    reads = keys @ S  # [N, Dv]
    cands = keys if against == "keys" else values
    if cosine:
        sim = F.normalize(reads, dim=-1) @ F.normalize(cands, dim=-1).T
    else:
        sim = reads @ cands.T
    hits = (sim.argmax(dim=dim) == torch.arange(keys.shape[0])).sum().item()
    return hits if count else hits / keys.shape[0]


def _accuracy_cases(g: torch.Generator) -> list[Case]:
    def pairs(N, Dk, Dv, spread, dtype=torch.float32):
        keys = memory.random_unit_keys(N, Dk, generator=g, dtype=dtype)
        norms = torch.exp(spread * torch.randn(N, 1, generator=g, dtype=dtype))  # value sizes
        return keys, torch.randn(N, Dv, generator=g, dtype=dtype) * norms

    cases = []
    k, v = pairs(32, 16, 16, 0.5)
    cases.append(Case((memory.write(k, v), k, v), label="N=32 random unit keys in D=16: crosstalk"))
    k = memory.orthonormal_keys(6, 8, generator=g)
    v = torch.randn(6, 8, generator=g)
    cases.append(Case((memory.write(k, v), k, v), label="orthonormal keys: exact recall"))
    k, v = pairs(20, 8, 12, 0.3)
    cases.append(Case((memory.write(k, v), k, v), label="Dk=8, Dv=12"))
    k, v = pairs(24, 16, 16, 1.0)
    cases.append(Case((memory.write(k, v), k, v), label="values of very different sizes"))
    k, v = pairs(16, 32, 16, 0.3)
    cases.append(Case((memory.write(k[:8], v[:8]), k, v),
                      label="only the first 8 of 16 pairs were written into S"))
    k, v = pairs(40, 16, 16, 0.5, torch.float64)
    cases.append(Case((memory.write(k, v), k, v), label="float64, N=40 in D=16"))
    return cases


register(Exercise(
    id="memory.recall_accuracy",
    title="recall accuracy of a memory",
    signature="recall_accuracy(S [Dk, Dv], keys [N, Dk], values [N, Dv]) -> float",
    reference=memory.recall_accuracy,
    make_cases=_accuracy_cases,
    chapter=4,
    mistakes=[
        Mistake("wrong_axis", lambda S, k, v: _accuracy(S, k, v, dim=0),
                "you took the argmax over the reads (dim 0): for each stored value, which read-out "
                "is closest. The question is the other way round: for each read-out k_i S, which "
                "stored value is closest? Take the argmax over the values (the last axis)."),
        Mistake("dot_not_cosine", lambda S, k, v: _accuracy(S, k, v, cosine=False),
                "you compared by the dot product r_i·v_j, which favours large values: a value with "
                "a big norm wins for many reads. Use cosine similarity (divide by ‖v_j‖)."),
        Mistake("against_keys", lambda S, k, v: _accuracy(S, k, v, against="keys"),
                "you compared the read-outs with the keys; a read-out is a value-space vector "
                "and must be compared with the stored values."),
        Mistake("rewrites_state", lambda S, k, v: memory.recall_accuracy(memory.write(k, v), k, v),
                "you rebuilt the state from keys and values instead of reading the S you were "
                "given (it may hold other pairs, or only some of these)."),
        Mistake("count_not_fraction", lambda S, k, v: _accuracy(S, k, v, count=True),
                "you returned the number of correct recalls; return the fraction (divide by N)."),
    ],
    hint="reads = keys @ S; cosine similarity of each read with every value ([N, N]); for each "
         "read (row), is the argmax at its own index? Return the fraction as a float.",
))

# -- memory.crosstalk_std ------------------------------------------------------------------------


def _gram_off(k):
    g = k @ k.T
    return g.masked_fill(torch.eye(k.shape[0], dtype=torch.bool), 0.0)


def _crosstalk_cases(g: torch.Generator) -> list[Case]:
    cases = [
        Case((memory.random_unit_keys(8, 16, generator=g),), label="8 random unit keys in D=16"),
        Case((memory.random_unit_keys(40, 16, generator=g),), label="40 random unit keys in D=16"),
        Case((torch.randn(12, 6, generator=g),), label="keys not of unit length"),
        Case((F.normalize(F.elu(torch.randn(10, 16, generator=g)) + 1, dim=-1),),
             label="ELU+1 keys: all dot products positive"),
        Case((memory.orthonormal_keys(5, 8, generator=g),), label="orthonormal keys: no crosstalk"),
        Case((torch.randn(1, 4, generator=g),), label="a single key"),
        Case((memory.random_unit_keys(20, 8, generator=g, dtype=torch.float64),),
             label="float64 keys"),
    ]
    return cases


register(Exercise(
    id="memory.crosstalk_std",
    title="crosstalk of each key",
    signature="crosstalk_std(keys [N, Dk]) -> [N]",
    reference=memory.crosstalk_std,
    make_cases=_crosstalk_cases,
    chapter=4,
    atol=1e-5,
    mistakes=[
        Mistake("with_diagonal", lambda k: (k @ k.T).pow(2).sum(-1).sqrt(),
                "you included j = i: (k_i·k_i)² is the signal, not crosstalk. Zero the diagonal "
                "of the Gram matrix before summing."),
        Mistake("no_sqrt", lambda k: _gram_off(k).pow(2).sum(-1),
                "you returned the variance Σ_{j≠i} (k_i·k_j)²; the standard deviation is its "
                "square root."),
        Mistake("stds_added", lambda k: _gram_off(k).abs().sum(-1),
                "you added the sizes |k_i·k_j| of the terms; standard deviations of independent "
                "terms do not add, variances do: √(Σ_{j≠i} (k_i·k_j)²)."),
        Mistake("random_key_formula",
                lambda k: torch.full(k.shape[:1], math.sqrt((k.shape[0] - 1) / k.shape[1]),
                                     dtype=k.dtype),
                "√((N−1)/D) is the average for random unit keys; here compute each key's own "
                "crosstalk from the given keys' dot products."),
    ],
    hint="Gram matrix G = keys @ keys.T; zero its diagonal; per row, the square root of the sum "
         "of squares.",
))

"""Chapter 3 exercises: causal linear attention (parallel form, normalised), and the length at
which a KV cache outgrows the linear-attention state.

The inputs are features: ``q`` and ``k`` here already are ``φ(q)`` and ``φ(k)`` (ELU+1), as
in :mod:`tinyk3.ops.linear_attention`.
"""

from __future__ import annotations

import math

import torch

from ..attention import causal_attention
from ..ops import feature_maps
from ..ops import linear_attention as la
from .core import Case, Exercise, Mistake, register

EPS = 1e-6  # the normaliser's guard, as in tinyk3.ops.linear_attention

# (B, H, T, Dk, Dv, dtype, what is special)
_SHAPES = [
    (1, 2, 6, 8, 8, torch.float32, ""),
    (1, 1, 1, 4, 4, torch.float32, "one token: causal and non-causal agree here"),
    (2, 3, 16, 4, 6, torch.float32, "Dk < Dv"),
    (2, 1, 9, 8, 3, torch.float32, "Dk > Dv"),
    (1, 2, 33, 16, 16, torch.float64, "float64 inputs: keep the dtype"),
]


def _feature_cases(g: torch.Generator) -> list[Case]:
    """q, k are ELU+1 features of Gaussian inputs (positive); v is Gaussian."""
    cases = []
    for B, H, T, Dk, Dv, dtype, note in _SHAPES:
        q, k = (feature_maps.elu_plus_one(torch.randn(B, H, T, Dk, generator=g, dtype=dtype))
                for _ in range(2))
        v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
        label = f"B={B}, H={H}, T={T}, Dk={Dk}, Dv={Dv}" + (f"; {note}" if note else "")
        cases.append(Case((q, k, v), label=label))
    return cases


def _causal(T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()  # True where key j <= query i


# -- linear_attention.parallel ------------------------------------------------------------------

def linear_attention_parallel(q, k, v):
    """Reference: ``o = (q kᵀ ⊙ M) v``, M the causal mask, no normaliser."""
    return la.parallel(q, k, v)[0]


def _par_no_mask(q, k, v):
    return q @ (k.transpose(-1, -2) @ v)  # the state of ALL tokens, read by every query


def _par_softmax(q, k, v):
    return causal_attention(q, k, v)  # chapter 1's softmax attention


def _par_softmax_unscaled(q, k, v):
    s = (q @ k.transpose(-1, -2)).masked_fill(~_causal(q.shape[-2]), float("-inf"))
    return s.softmax(-1) @ v


def _par_minus_inf(q, k, v):
    s = (q @ k.transpose(-1, -2)).masked_fill(~_causal(q.shape[-2]), float("-inf"))
    return s @ v  # no softmax to turn -inf into 0: inf and NaN


def _par_strict(q, k, v):
    return ((q @ k.transpose(-1, -2)).tril(-1)) @ v


def _par_scaled(q, k, v):
    return ((q @ k.transpose(-1, -2)).tril() / math.sqrt(q.shape[-1])) @ v


register(Exercise(
    id="linear_attention.parallel",
    title="causal linear attention, parallel form",
    signature="linear_attention_parallel(q, k, v) -> o [B, H, T, Dv]",
    reference=linear_attention_parallel,
    make_cases=_feature_cases,
    chapter=3,
    mistakes=[
        Mistake("no_mask", _par_no_mask,
                "your output is q (kᵀ v) over the whole sequence: every token reads a state that "
                "already holds the tokens after it (the post's prefill has this bug). Right for a "
                "single token only; keep the causal mask: (q kᵀ ⊙ M) v with M = tril."),
        Mistake("softmax", _par_softmax,
                "your output is softmax attention (chapter 1). Linear attention has no softmax "
                "and no 1/√D: the scores q·kᵀ of the features are used as they are."),
        Mistake("softmax_unscaled", _par_softmax_unscaled,
                "your output is a softmax over the masked scores. Linear attention uses the "
                "feature scores q·kᵀ directly: zero the future ones and multiply by v."),
        Mistake("minus_inf_no_softmax", _par_minus_inf,
                "you filled the future scores with -inf, as for a softmax; with no softmax after "
                "it, -inf times v gives inf and NaN. Set them to 0 (`.tril()` or masked_fill 0)."),
        Mistake("strict_mask", _par_strict,
                "token t does not see itself: your mask removes the diagonal (keep j <= t: "
                "`tril()`, diagonal 0), or your loop reads S before adding k_tᵀ v_t to it."),
        Mistake("scaled", _par_scaled,
                "you divided the scores by √D. That scale belongs to softmax attention; here the "
                "scores are plain dot products of the features."),
    ],
    hint="scores = q @ kᵀ, keep j <= t (`.tril()`), then @ v. No softmax, no scale.",
))


# -- linear_attention.normalized ----------------------------------------------------------------

def linear_attention_normalized(q, k, v):
    """Reference: ``o_t = q_t S_t / (q_t · z_t + eps)``, ``S_t = Σ_{j≤t} k_jᵀ v_j``, ``z_t = Σ_{j≤t} k_j``."""
    return la.recurrent(q, k, v, normalize=True, eps=EPS)[0]


def _norm_parts(q, k, v):
    """Causal numerator (q kᵀ ⊙ M) v and the masked scores."""
    s = (q @ k.transpose(-1, -2)).tril()
    return s @ v, s


def _norm_no_normaliser(q, k, v):
    return _norm_parts(q, k, v)[0]


def _norm_non_causal_z(q, k, v):
    num, _ = _norm_parts(q, k, v)
    z_all = k.sum(dim=2, keepdim=True)  # Σ over ALL tokens  [B, H, 1, Dk]
    return num / ((q * z_all).sum(-1, keepdim=True) + EPS)


def _norm_non_causal(q, k, v):
    z_all = k.sum(dim=2, keepdim=True)
    return (q @ (k.transpose(-1, -2) @ v)) / ((q * z_all).sum(-1, keepdim=True) + EPS)


def _norm_k_not_q(q, k, v):
    num, _ = _norm_parts(q, k, v)
    z = k.cumsum(dim=2)  # z_t  [B, H, T, Dk]
    return num / ((k * z).sum(-1, keepdim=True) + EPS)


def _norm_read_before_write(q, k, v):
    s = (q @ k.transpose(-1, -2)).tril(-1)  # o_t reads S_{t-1}, z_{t-1}
    return (s @ v) / (s.sum(-1, keepdim=True) + EPS)


def _norm_column_sums(q, k, v):
    _, s = _norm_parts(q, k, v)
    return (s / (s.sum(-2, keepdim=True) + EPS)) @ v  # each column (key) sums to 1


register(Exercise(
    id="linear_attention.normalized",
    title="causal linear attention with the normaliser",
    signature="linear_attention_normalized(q, k, v) -> o [B, H, T, Dv]",
    reference=linear_attention_normalized,
    make_cases=_feature_cases,
    chapter=3,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("no_normaliser", _norm_no_normaliser,
                "your output is the unnormalised sum q_t S_t. Divide it by q_t · z_t, where "
                "z_t = k_0 + ... + k_t is the running sum of the (feature) keys."),
        Mistake("non_causal_normaliser", _norm_non_causal_z,
                "your numerator is causal but your normaliser uses z over ALL tokens. Position t "
                "must divide by q_t · z_t with z_t = Σ_{j≤t} k_j (a running sum, e.g. cumsum)."),
        Mistake("non_causal", _norm_non_causal,
                "both your numerator and normaliser include every token: q_t (Kᵀ V) / q_t·Σk. "
                "That is the post's prefill bug; sum only over j <= t (a mask, cumsum or a loop)."),
        Mistake("k_dot_z", _norm_k_not_q,
                "you divide by k_t · z_t; the normaliser is the query's total score, q_t · z_t "
                "(the sum over j <= t of q_t · k_j)."),
        Mistake("read_before_write", _norm_read_before_write,
                "token t reads the state before adding its own key and value (S_{t-1}, z_{t-1}), "
                "so it never sees itself. Update S and z first, then read."),
        Mistake("column_sums", _norm_column_sums,
                "you normalised the masked scores over the queries (dim=-2); each query's "
                "weights must sum to 1 over the keys, its own row (dim=-1)."),
    ],
    hint="o_t = q_t S_t / (q_t · z_t), S_t = Σ_{j≤t} k_jᵀ v_j, z_t = Σ_{j≤t} k_j: a token loop, or "
         "the masked scores (q kᵀ).tril() @ v divided by their row sums.",
))


# -- linear_attention.crossover_length ----------------------------------------------------------

def crossover_length(head_dim):
    """Smallest t with 2·t·D > D·D + D: a KV cache of t tokens holds more numbers than (S, z)."""
    D = int(head_dim)
    return (D + 1) // 2 + 1


def _crossover_cases(g: torch.Generator) -> list[Case]:
    dims = [64, 128, 3, 1, 127, 100]
    dims += [int(torch.randint(2, 1025, (1,), generator=g)) for _ in range(2)]
    return [Case((D,), label=f"head_dim={D}" + (" (odd)" if D % 2 else "")) for D in dims]


register(Exercise(
    id="linear_attention.crossover_length",
    title="where a KV cache outgrows the state",
    signature="crossover_length(head_dim) -> int",
    reference=crossover_length,
    make_cases=_crossover_cases,
    chapter=3,
    mistakes=[
        Mistake("equal_not_more", lambda D: (D + 2) // 2,
                "your answer is one token short when head_dim is odd: either you stopped where the "
                "two sizes are equal (>= instead of >), or you left out the normaliser z (D "
                "numbers). The state holds D·D + D numbers and must be strictly exceeded."),
        Mistake("keys_only", lambda D: D + 2,
                "you counted only the cached keys (t·D); the cache holds keys and values, 2·t·D."),
        Mistake("not_rounded", lambda D: (D + 1) / 2,
                "you solved 2·t·D = D·D + D for t; the answer is a whole number of tokens, the "
                "smallest t that makes the cache strictly larger."),
        Mistake("rounded_down", lambda D: (D + 1) // 2,
                "at your t the cache is still no larger than the state: round (D + 1)/2 up to "
                "the next whole token that strictly exceeds it."),
    ],
    hint="find the smallest whole t with 2·t·D > D·D + D.",
))

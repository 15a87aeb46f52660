"""Chapter 3 exercises (tinyk3.checks.ch03_linear_attention): realistic learner answers, written by
hand the way learners write them (loops, einsum, cumsum), independent of the registered
Mistake functions. Wrong ones must fail with the expected mistake's hint (or the general hint
where no registered mistake explains them); right ones, in several styles, must pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from helpers import right, run, wrong
from tinyk3 import checks

# -- linear_attention.parallel: (q kᵀ ⊙ M) v, no normaliser ------------------------------------


@wrong("linear_attention.parallel", "no_mask")
def par_post_style_state(q, k, v):
    """Fold every token into one state, then read it: the post's prefill."""
    S = torch.einsum("bhtk,bhtv->bhkv", k, v)
    return torch.einsum("bhtk,bhkv->bhtv", q, S)


@wrong("linear_attention.parallel", "minus_inf_no_softmax")
def par_minus_inf_fill(q, k, v):
    T = q.shape[2]
    mask = torch.tril(torch.ones(T, T))
    scores = q @ k.mT
    scores = scores.masked_fill(mask == 0, float("-inf"))  # copied from softmax attention
    return scores @ v


@wrong("linear_attention.parallel", "softmax")
def par_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@wrong("linear_attention.parallel", "strict_mask")
def par_loop_reads_before_writing(q, k, v):
    B, H, T, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(T):
        outs.append(q[:, :, t : t + 1] @ S)  # read first ...
        S = S + k[:, :, t : t + 1].mT @ v[:, :, t : t + 1]  # ... then write
    return torch.cat(outs, dim=2)


@wrong("linear_attention.parallel", "softmax_unscaled")
def par_exp_normalised(q, k, v):
    T = q.shape[-2]
    w = torch.exp(q @ k.transpose(-2, -1)) * torch.tril(torch.ones(T, T, dtype=q.dtype))
    return (w / w.sum(-1, keepdim=True)) @ v


@wrong("linear_attention.parallel", "scaled")
def par_scaled_like_attention(q, k, v):
    d = q.size(-1)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    return torch.tril(att) @ v


@wrong("linear_attention.parallel")
def par_upper_triangle(q, k, v):
    return torch.triu(q @ k.transpose(-2, -1)) @ v  # the future instead of the past


@right("linear_attention.parallel")
def par_ok_loop(q, k, v):
    B, H, T, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(T):
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2)


@right("linear_attention.parallel")
def par_ok_cumsum(q, k, v):
    S = (k.unsqueeze(-1) * v.unsqueeze(-2)).cumsum(dim=2)  # every S_t  [B, H, T, Dk, Dv]
    return (q.unsqueeze(-2) @ S).squeeze(-2)


@right("linear_attention.parallel")
def par_ok_mask_multiply(q, k, v):
    T = q.shape[2]
    M = torch.ones(T, T, dtype=q.dtype).tril()
    return ((q @ k.transpose(-1, -2)) * M) @ v


# -- linear_attention.normalized: q_t S_t / (q_t · z_t) -----------------------------------------


@wrong("linear_attention.normalized", "non_causal_normaliser")
def norm_z_over_all_tokens(q, k, v):
    B, H, T, Dk = q.shape
    z = k.sum(dim=2)  # computed once, up front
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(T):
        S = S + k[:, :, t].unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        num = torch.einsum("bhk,bhkv->bhv", q[:, :, t], S)
        outs.append(num / ((q[:, :, t] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=2)


@wrong("linear_attention.normalized", "column_sums")
def norm_weights_over_wrong_dim(q, k, v):
    a = torch.tril(q @ k.transpose(-2, -1))
    a = a / a.sum(dim=-2, keepdim=True)
    return a @ v


@wrong("linear_attention.normalized", "k_dot_z")
def norm_divides_by_k_dot_z(q, k, v):
    B, H, T, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=q.dtype)
    z = torch.zeros(B, H, Dk, dtype=q.dtype)
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, :, t], k[:, :, t], v[:, :, t]
        S = S + k_t[..., :, None] * v_t[..., None, :]
        z = z + k_t
        outs.append((q_t[..., None, :] @ S)[..., 0, :] / ((k_t * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=2)


@wrong("linear_attention.normalized", "non_causal")
def norm_post_style(q, k, v):
    S = k.transpose(-1, -2) @ v  # [B, H, Dk, Dv]
    z = k.sum(dim=2, keepdim=True).transpose(-1, -2)  # [B, H, Dk, 1]
    return (q @ S) / (q @ z)


@wrong("linear_attention.normalized", "read_before_write")
def norm_reads_before_writing(q, k, v):
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    z = q.new_zeros(B, H, Dk)
    outs = []
    for t in range(T):
        q_t = q[:, :, t]
        o_t = torch.einsum("bhk,bhkv->bhv", q_t, S) / ((q_t * z).sum(-1, keepdim=True) + 1e-6)
        outs.append(o_t)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])
        z = z + k[:, :, t]
    return torch.stack(outs, dim=2)


@wrong("linear_attention.normalized", "no_normaliser")
def norm_forgets_to_divide(q, k, v):
    return (q @ k.mT).tril() @ v


@right("linear_attention.normalized")
def norm_ok_loop(q, k, v):
    B, H, T, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=q.dtype)
    z = torch.zeros(B, H, Dk, dtype=q.dtype)
    outs = []
    for t in range(T):
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]
        z = z + k[:, :, t]
        num = (q[:, :, t, None, :] @ S).squeeze(-2)
        outs.append(num / ((q[:, :, t] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=2)


@right("linear_attention.normalized")
def norm_ok_vectorised_cumsum(q, k, v):
    num = (q @ k.transpose(-1, -2)).tril() @ v
    den = (q * k.cumsum(dim=2)).sum(-1, keepdim=True)
    return num / (den + 1e-6)


@right("linear_attention.normalized")
def norm_ok_without_eps(q, k, v):
    """No eps: differs from the reference by a relative 1e-6/(q·z), inside the tolerance."""
    a = (q @ k.transpose(-1, -2)).tril()
    return (a / a.sum(-1, keepdim=True)) @ v


# -- linear_attention.crossover_length -----------------------------------------------------------


@wrong("linear_attention.crossover_length", "equal_not_more")
def co_ceil_of_equality(D):
    return math.ceil((D * D + D) / (2 * D))  # the equality point, not "more than"


@wrong("linear_attention.crossover_length", "equal_not_more")
def co_forgets_z(D):
    return D // 2 + 1  # 2·t·D > D·D: the D numbers of z left out


@wrong("linear_attention.crossover_length", "keys_only")
def co_keys_only_loop(D):
    t = 0
    while t * D <= D * D + D:  # only the keys are counted
        t += 1
    return t


@wrong("linear_attention.crossover_length", "not_rounded")
def co_unrounded(D):
    return (D * D + D) / (2 * D)


@wrong("linear_attention.crossover_length", "rounded_down")
def co_floor(D):
    return int((D + 1) / 2)


@wrong("linear_attention.crossover_length")
def co_keys_only_at_equality(D):
    t = 1
    while t * D < D * D + D:  # keys only, and stops at equality
        t += 1
    return t


@right("linear_attention.crossover_length")
def co_ok_loop(D):
    t = 1
    while 2 * t * D <= D * D + D:
        t += 1
    return t


@right("linear_attention.crossover_length")
def co_ok_formula(D):
    return math.floor((D + 1) / 2) + 1


CH3 = ("linear_attention.parallel", "linear_attention.normalized",
       "linear_attention.crossover_length")


def test_chapter_3_exercises_are_registered():
    for exercise_id in CH3:
        assert checks.EXERCISES[exercise_id].chapter == 3


def test_the_post_style_prefill_is_right_only_for_the_single_token_case():
    """q (Kᵀ V) without a mask equals the causal form for T = 1 and nowhere else."""
    result = run("linear_attention.parallel", par_post_style_state)
    cases = checks.EXERCISES["linear_attention.parallel"].cases()
    single = [i for i, c in enumerate(cases) if c.args[0].shape[2] == 1]
    assert result.n_passed == len(single) == 1
    assert result.failed_case == 1


def test_minus_inf_without_softmax_reports_the_nan():
    result = run("linear_attention.parallel", par_minus_inf_fill)
    assert "NaN" in result.report and "inf" in result.report


def test_float64_is_kept():
    """A loop that accumulates into a float32 buffer fails the float64 case only."""

    def float32_buffer(q, k, v):
        B, H, T, Dk = q.shape
        S = torch.zeros(B, H, Dk, v.shape[-1])  # float32 whatever the inputs
        outs = []
        for t in range(T):
            S = S + k[:, :, t, :, None].float() * v[:, :, t, None, :].float()
            outs.append((q[:, :, t, None, :].float() @ S).squeeze(-2))
        return torch.stack(outs, dim=2)

    result = run("linear_attention.parallel", float32_buffer)
    assert result.status == "failed" and result.n_passed == result.n_cases - 1
    assert "wrong dtype: expected torch.float64, got torch.float32" in result.report
    assert "float64 inputs: keep the dtype" in result.report

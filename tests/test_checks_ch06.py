"""Chapter 6 exercises (tinyk3.checks.ch06_chunked): realistic learner answers, written by hand the
way learners write them (chunk loops, padding and reshapes, cumsum), independent of the
registered Mistake functions. Wrong ones must fail with the expected mistake's hint; right
ones, in several styles, must pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from helpers import right, run, wrong
from tinyk3 import checks

# -- chunked.linear_attention ----------------------------------------------------------------------


@wrong("chunked.linear_attention", "drops_remainder")
def la_post_style_range(q, k, v, chunk_size):
    """The post's loop: range(t // C) chunks."""
    b, h, t, d = q.shape
    C = chunk_size
    S = torch.zeros(b, h, d, v.shape[-1], dtype=q.dtype)
    outs = []
    for i in range(t // C):
        q_c = q[:, :, i * C : (i + 1) * C]
        k_c = k[:, :, i * C : (i + 1) * C]
        v_c = v[:, :, i * C : (i + 1) * C]
        o_prev = q_c @ S
        attn = (q_c @ k_c.transpose(-1, -2)).tril()
        outs.append(o_prev + attn @ v_c)
        S = S + k_c.transpose(-1, -2) @ v_c
    return torch.cat(outs, dim=2) if outs else v[:, :, :0]


@wrong("chunked.linear_attention", "read_after_write")
def la_update_then_read(q, k, v, chunk_size):
    B, H, T, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=v.dtype)
    outs = []
    for s in range(0, T, chunk_size):
        qc, kc, vc = q[:, :, s : s + chunk_size], k[:, :, s : s + chunk_size], v[:, :, s : s + chunk_size]
        S = S + torch.einsum("bhck,bhcv->bhkv", kc, vc)  # state first ...
        intra = torch.einsum("bhik,bhjk->bhij", qc, kc).tril() @ vc
        outs.append(torch.einsum("bhck,bhkv->bhcv", qc, S) + intra)  # ... then read it
    return torch.cat(outs, dim=2)


@wrong("chunked.linear_attention", "read_after_write")
def la_inclusive_cumsum(q, k, v, chunk_size):
    """Vectorised, but every chunk starts from a state that already holds itself."""
    B, H, T, D = q.shape
    C = chunk_size
    pad = (C - T % C) % C
    qp, kp, vp = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    N = qp.shape[2] // C
    qc, kc, vc = (x.reshape(B, H, N, C, -1) for x in (qp, kp, vp))
    states = (kc.transpose(-1, -2) @ vc).cumsum(dim=2)  # inclusive: S_{c+1}, not S_c
    o = qc @ states + (qc @ kc.transpose(-1, -2)).tril() @ vc
    return o.reshape(B, H, N * C, -1)[:, :, :T]


@wrong("chunked.linear_attention", "no_inter_chunk")
def la_blocks_only(q, k, v, chunk_size):
    """Masked attention inside each chunk, nothing carried across."""
    outs = []
    for qc, kc, vc in zip(q.split(chunk_size, dim=2), k.split(chunk_size, dim=2), v.split(chunk_size, dim=2)):
        n = qc.shape[2]
        mask = torch.tril(torch.ones(n, n, dtype=q.dtype))
        outs.append(((qc @ kc.mT) * mask) @ vc)
    return torch.cat(outs, dim=2)


@wrong("chunked.linear_attention", "no_mask")
def la_forgot_mask(q, k, v, chunk_size):
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for qc, kc, vc in zip(q.split(chunk_size, 2), k.split(chunk_size, 2), v.split(chunk_size, 2)):
        outs.append(qc @ S + (qc @ kc.mT) @ vc)
        S = S + kc.mT @ vc
    return torch.cat(outs, 2)


@wrong("chunked.linear_attention", "previous_chunk_only")
def la_overwrites_state(q, k, v, chunk_size):
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for qc, kc, vc in zip(q.split(chunk_size, 2), k.split(chunk_size, 2), v.split(chunk_size, 2)):
        outs.append(qc @ S + (qc @ kc.mT).tril() @ vc)
        S = kc.mT @ vc  # forgot the S + ...
    return torch.cat(outs, 2)


@right("chunked.linear_attention")
def la_ok_loop(q, k, v, chunk_size):
    B, H, T, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=q.dtype)
    outs = []
    for i in range(math.ceil(T / chunk_size)):
        sl = slice(i * chunk_size, (i + 1) * chunk_size)
        qc, kc, vc = q[:, :, sl], k[:, :, sl], v[:, :, sl]
        outs.append(qc @ S + torch.tril(qc @ kc.transpose(-2, -1)) @ vc)
        S = S + kc.transpose(-2, -1) @ vc
    return torch.cat(outs, dim=2)


@right("chunked.linear_attention")
def la_ok_vectorised(q, k, v, chunk_size):
    B, H, T, D = q.shape
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    qc, kc, vc = (F.pad(x, (0, 0, 0, pad)).reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    kv = kc.transpose(-1, -2) @ vc  # [B, H, N, Dk, Dv]
    states = kv.cumsum(dim=2) - kv  # exclusive prefix sum
    o = qc @ states + (qc @ kc.transpose(-1, -2)).tril() @ vc
    return o.reshape(B, H, N * C, -1)[:, :, :T]


@right("chunked.linear_attention")
def la_ok_per_token_then_blocks(q, k, v, chunk_size):
    """Einsum over chunk indices, with the chunk states from a shifted cumsum."""
    B, H, T, D = q.shape
    C = chunk_size
    pad = (-T) % C
    qc, kc, vc = (torch.cat([x, x.new_zeros(B, H, pad, x.shape[-1])], 2).unflatten(2, (-1, C))
                  for x in (q, k, v))
    kv = torch.einsum("bhnck,bhncv->bhnkv", kc, vc)
    states = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1]], dim=2).cumsum(dim=2)
    scores = torch.einsum("bhnik,bhnjk->bhnij", qc, kc)
    mask = torch.ones(C, C, dtype=torch.bool).tril()
    o = torch.einsum("bhnck,bhnkv->bhncv", qc, states) + scores.masked_fill(~mask, 0) @ vc
    return o.flatten(2, 3)[:, :, :T]


# -- chunked.flops -----------------------------------------------------------------------------


@wrong("chunked.flops", "multiply_adds")
def fl_posts_formula(T, D, C):
    return 2 * T * D**2 + 2 * T * C * D


@wrong("chunked.flops", "closed_form_unpadded")
def fl_facts_formula(T, D, C):
    return 4 * T * D**2 + 4 * T * C * D


@wrong("chunked.flops", "floor_chunks")
def fl_floor_loop(T, D, C):
    n = T // C
    per_chunk = 2 * C * D * D + 2 * D * C * D + 2 * C * D * C + 2 * C * C * D
    return n * per_chunk


@wrong("chunked.flops", "one_state_product")
def fl_reads_state_only(T, D, C):
    chunks = math.ceil(T / C)
    return chunks * (2 * C * D * D) + chunks * (2 * C * C * D + 2 * C * C * D)


@wrong("chunked.flops", "c_squared_per_token")
def fl_blocks_per_token(T, D, C):
    state = 4 * T * D * D
    blocks = T * (2 * C * C * D) * 2
    return state + blocks


@wrong("chunked.flops", "exact_last_chunk")
def fl_true_lengths(T, D, C):
    total = 0
    for start in range(0, T, C):
        n = min(C, T - start)
        total += 2 * n * D * D * 2 + 2 * n * n * D * 2
    return total


@right("chunked.flops")
def fl_ok_ceil(T, D, C):
    return math.ceil(T / C) * (4 * C * D * D + 4 * C * C * D)


@right("chunked.flops")
def fl_ok_loop(T, D, C):
    total = 0
    for _ in range(0, T, C):
        total += 2 * C * D * D  # Q_c S
        total += 2 * D * C * D  # K_cᵀ V_c
        total += 2 * C * D * C  # Q_c K_cᵀ
        total += 2 * C * C * D  # (…) V_c
    return total


CH6 = ("chunked.linear_attention", "chunked.flops")


def test_chapter_6_exercises_are_registered():
    for exercise_id in CH6:
        assert checks.EXERCISES[exercise_id].chapter == 6


def test_the_posts_loop_is_right_when_c_divides_t_and_short_otherwise():
    result = run("chunked.linear_attention", la_post_style_range)
    cases = checks.EXERCISES["chunked.linear_attention"].cases()
    divides = [c.args[0].shape[2] % c.args[3] == 0 for c in cases]
    assert result.n_passed == sum(divides)
    assert result.failed_case == divides.index(False) + 1
    assert "wrong shape" in result.report

"""Chapter 9's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import math

import pytest
import torch

from learner_answers import assert_caught, assert_passes, assert_two_named_wrong_answers
from tinyk3 import checks

# -- kernel.tile_offsets --------------------------------------------------------------------------


def to_no_row_mask(i_bh, i_c, T, D, C, BD):
    """Masks the padding columns, forgets that the last chunk can be short."""
    rows = torch.arange(i_c * C, i_c * C + C)
    cols = torch.arange(BD)
    offsets = i_bh * T * D + rows[:, None] * D + cols[None, :]
    mask = (cols < D).expand(C, BD)
    return offsets, mask


def to_row_stride_T(i_bh, i_c, T, D, C, BD):
    """Steps from token to token by T (confusing the sequence length with the row length)."""
    t = i_c * C + torch.arange(C)
    d = torch.arange(BD)
    offsets = i_bh * T * D + t.unsqueeze(1) * T + d.unsqueeze(0)
    mask = (t.unsqueeze(1) < T) & (d.unsqueeze(0) < D)
    return offsets, mask


def to_head_stride_like_beta(i_bh, i_c, T, D, C, BD):
    """Copies the head offset from β's load (beta + i_bh * T + o_t)."""
    t, d = torch.meshgrid(i_c * C + torch.arange(C), torch.arange(BD), indexing="ij")
    return i_bh * T + t * D + d, (t < T) & (d < D)


def to_le(i_bh, i_c, T, D, C, BD):
    """`t <= T`: one token too many in the last chunk."""
    t = torch.arange(C) + i_c * C
    d = torch.arange(BD)
    return (i_bh * T + t[:, None]) * D + d, (t[:, None] <= T) & (d < D)


def to_column_major(i_bh, i_c, T, D, C, BD):
    """Thinks of a head as D columns of T tokens."""
    t = (i_c * C + torch.arange(C))[:, None]
    d = torch.arange(BD)[None, :]
    return i_bh * T * D + t + d * T, (t < T) & (d < D)


def to_int32(i_bh, i_c, T, D, C, BD):
    """Right numbers, but int32 (GPU kernels overflow that way past 2³¹ elements)."""
    offsets, mask = checks.EXERCISES["kernel.tile_offsets"].reference(i_bh, i_c, T, D, C, BD)
    return offsets.to(torch.int32), mask


def to_ok_meshgrid(i_bh, i_c, T, D, C, BD):
    t, d = torch.meshgrid(torch.arange(i_c * C, (i_c + 1) * C), torch.arange(BD), indexing="ij")
    return i_bh * T * D + t * D + d, (t <= T - 1) & (d <= D - 1)


def to_ok_numpy_style(i_bh, i_c, T, D, C, BD):
    """Builds the row starts first, then adds the columns (as a pointer + offsets)."""
    start = i_bh * T * D + i_c * C * D
    offsets = start + D * torch.arange(C).view(C, 1) + torch.arange(BD).view(1, BD)
    n_valid = min(C, T - i_c * C)  # tokens of this chunk inside the sequence
    mask = torch.zeros(C, BD, dtype=torch.bool)
    mask[:n_valid, :D] = True
    return offsets, mask


# -- kernel.state_pass_block ----------------------------------------------------------------------


def _learner_pass(w, u, k, s0, chunk_size, i_v, BV, *, bug=None):
    T, Dv = u.shape
    lo = i_v * BV
    hi = min(lo + BV, Dv)
    S = s0[:, :BV].clone() if bug == "s0_first_columns" else s0[:, lo:hi].clone()
    n_chunks = T // chunk_size if bug == "floor" else math.ceil(T / chunk_size)
    states, u_new = [], []
    for c in range(n_chunks):
        W_c = w[c * chunk_size:(c + 1) * chunk_size]
        U_c = u[c * chunk_size:(c + 1) * chunk_size, lo:hi]
        K_c = k[c * chunk_size:(c + 1) * chunk_size]
        if bug != "store_late":
            states.append(S.clone())
        delta = U_c if bug == "no_WS" else U_c - W_c @ S
        u_new.append(delta)
        S = S + K_c.T @ (U_c if bug == "update_with_U" else delta)
        if bug == "store_late":
            states.append(S.clone())
    return torch.stack(states), torch.cat(u_new), S


def sp_store_late(w, u, k, s0, chunk_size, i_v, BV):
    return _learner_pass(w, u, k, s0, chunk_size, i_v, BV, bug="store_late")


def sp_no_WS(w, u, k, s0, chunk_size, i_v, BV):
    return _learner_pass(w, u, k, s0, chunk_size, i_v, BV, bug="no_WS")


def sp_s0_first_columns(w, u, k, s0, chunk_size, i_v, BV):
    return _learner_pass(w, u, k, s0, chunk_size, i_v, BV, bug="s0_first_columns")


def sp_update_with_U(w, u, k, s0, chunk_size, i_v, BV):
    return _learner_pass(w, u, k, s0, chunk_size, i_v, BV, bug="update_with_U")


def sp_floor(w, u, k, s0, chunk_size, i_v, BV):
    return _learner_pass(w, u, k, s0, chunk_size, i_v, BV, bug="floor")


def sp_states_list_of_S_plus_one(w, u, k, s0, chunk_size, i_v, BV):
    """Writes the states with S_0 prepended and never drops the final one: N + 1 states."""
    states, u_new, S = _learner_pass(w, u, k, s0, chunk_size, i_v, BV)
    return torch.cat([states, S[None]]), u_new, S


def sp_ok_all_columns_then_slice(w, u, k, s0, chunk_size, i_v, BV):
    """Runs the pass on every column and keeps the block's: the columns never mix."""
    states, u_new, S = _learner_pass(w, u, k, s0, chunk_size, 0, u.shape[1])
    cols = slice(i_v * BV, min(u.shape[1], (i_v + 1) * BV))
    return states[..., cols], u_new[:, cols], S[:, cols]


def sp_ok_padded(w, u, k, s0, chunk_size, i_v, BV):
    """Pads T to a multiple of C with zero rows (as the kernel's masked loads do), crops U'."""
    T = u.shape[0]
    pad = -T % chunk_size
    wp, up, kp = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (w, u, k))
    states, u_new, S = _learner_pass(wp, up, kp, s0, chunk_size, i_v, BV)
    return states, u_new[:T], S


def sp_ok_einsum(w, u, k, s0, chunk_size, i_v, BV):
    cols = slice(i_v * BV, (i_v + 1) * BV)  # slicing past Dv is fine in PyTorch
    S = s0[:, cols]
    states, du = [], []
    for r0 in range(0, u.shape[0], chunk_size):
        r = slice(r0, r0 + chunk_size)
        states.append(S)
        d = u[r, cols] - torch.einsum("ck,kv->cv", w[r], S)
        du.append(d)
        S = S + torch.einsum("ck,cv->kv", k[r], d)
    return torch.stack(states), torch.cat(du), S


REALISTIC = [
    ("kernel.tile_offsets", to_no_row_mask, "no_row_mask"),
    ("kernel.tile_offsets", to_row_stride_T, "row_stride_T"),
    ("kernel.tile_offsets", to_head_stride_like_beta, "head_stride_T"),
    ("kernel.tile_offsets", to_le, "row_le_T"),
    ("kernel.tile_offsets", to_column_major, "transposed_strides"),
    ("kernel.tile_offsets", to_int32, None),
    ("kernel.state_pass_block", sp_store_late, "stores_next_state"),
    ("kernel.state_pass_block", sp_no_WS, "no_minus_WS"),
    ("kernel.state_pass_block", sp_s0_first_columns, "block_from_column_0"),
    ("kernel.state_pass_block", sp_update_with_U, "state_with_u"),
    ("kernel.state_pass_block", sp_floor, "floor_chunks"),
    ("kernel.state_pass_block", sp_states_list_of_S_plus_one, None),
]

CORRECT = [
    ("kernel.tile_offsets", to_ok_meshgrid),
    ("kernel.tile_offsets", to_ok_numpy_style),
    ("kernel.state_pass_block", sp_ok_all_columns_then_slice),
    ("kernel.state_pass_block", sp_ok_padded),
    ("kernel.state_pass_block", sp_ok_einsum),
    ("kernel.state_pass_block", _learner_pass),
]


@pytest.mark.parametrize("exercise_id,fn,mistake", REALISTIC,
                         ids=[f"{e}:{f.__name__}" for e, f, _ in REALISTIC])
def test_realistic_wrong_answer_is_caught(exercise_id, fn, mistake, capsys):
    assert_caught(exercise_id, fn, mistake, capsys)


def test_every_chapter_9_exercise_has_two_hand_written_wrong_answers():
    assert_two_named_wrong_answers(9, ["kernel.state_pass_block", "kernel.tile_offsets"], REALISTIC)


@pytest.mark.parametrize("exercise_id,fn", CORRECT, ids=[f"{e}:{i}" for i, (e, _) in enumerate(CORRECT)])
def test_realistic_correct_answer_passes(exercise_id, fn):
    assert_passes(exercise_id, fn)


def test_tile_cases_expose_partial_chunks_padding_and_other_heads():
    cases = [c.args for c in checks.EXERCISES["kernel.tile_offsets"].cases()]
    assert any((i_c + 1) * C > T and i_bh > 0 for i_bh, i_c, T, D, C, BD in cases)  # reads the next head
    assert any(BD > D for *_, D, C, BD in cases)
    assert any(i_bh > 0 and i_c > 0 for i_bh, i_c, *_ in cases)


def test_state_pass_cases_expose_later_blocks_partial_blocks_and_chunks():
    cases = [c.args for c in checks.EXERCISES["kernel.state_pass_block"].cases()]
    assert any(i_v > 0 and s0.abs().sum() > 0 for w, u, k, s0, C, i_v, BV in cases)
    assert any(min(u.shape[1], (i_v + 1) * BV) - i_v * BV < BV for w, u, k, s0, C, i_v, BV in cases)
    assert any(u.shape[0] % C for w, u, k, s0, C, i_v, BV in cases)
    assert any(u.dtype == torch.float64 for w, u, *_ in cases)


def test_the_blocks_of_a_state_pass_make_up_the_whole_pass():
    """What the chapter claims: the columns of S evolve independently, so running every block and
    concatenating equals one program holding all columns."""
    w, u, k, s0, C, _, _ = checks.EXERCISES["kernel.state_pass_block"].cases()[2].args
    ref = checks.EXERCISES["kernel.state_pass_block"].reference
    whole = ref(w, u, k, s0, C, 0, u.shape[1])
    blocks = [ref(w, u, k, s0, C, i, 8) for i in range(-(-u.shape[1] // 8))]
    for j, part in enumerate(whole):
        joined = torch.cat([b[j] for b in blocks], dim=-1)
        assert (joined - part).abs().max() <= 1e-6

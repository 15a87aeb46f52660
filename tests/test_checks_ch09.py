"""Chapter 9's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import flat, right, wrong
from tinyk3 import checks

# The output-stage exercise runs Triton kernels: rerun with Triton hidden by `make unit-no-triton`.
pytestmark = pytest.mark.triton

# -- kernel.tile_offsets --------------------------------------------------------------------------


@wrong("kernel.tile_offsets", "no_row_mask")
def to_no_row_mask(i_bh, i_c, T, D, C, BD):
    """Masks the padding columns, forgets that the last chunk can be short."""
    rows = torch.arange(i_c * C, i_c * C + C)
    cols = torch.arange(BD)
    offsets = i_bh * T * D + rows[:, None] * D + cols[None, :]
    mask = (cols < D).expand(C, BD)
    return offsets, mask


@wrong("kernel.tile_offsets", "row_stride_T")
def to_row_stride_T(i_bh, i_c, T, D, C, BD):
    """Steps from token to token by T (confusing the sequence length with the row length)."""
    t = i_c * C + torch.arange(C)
    d = torch.arange(BD)
    offsets = i_bh * T * D + t.unsqueeze(1) * T + d.unsqueeze(0)
    mask = (t.unsqueeze(1) < T) & (d.unsqueeze(0) < D)
    return offsets, mask


@wrong("kernel.tile_offsets", "head_stride_T")
def to_head_stride_like_beta(i_bh, i_c, T, D, C, BD):
    """Copies the head offset from β's load (beta + i_bh * T + o_t)."""
    t, d = torch.meshgrid(i_c * C + torch.arange(C), torch.arange(BD), indexing="ij")
    return i_bh * T + t * D + d, (t < T) & (d < D)


@wrong("kernel.tile_offsets", "row_le_T")
def to_le(i_bh, i_c, T, D, C, BD):
    """`t <= T`: one token too many in the last chunk."""
    t = torch.arange(C) + i_c * C
    d = torch.arange(BD)
    return (i_bh * T + t[:, None]) * D + d, (t[:, None] <= T) & (d < D)


@wrong("kernel.tile_offsets", "transposed_strides")
def to_column_major(i_bh, i_c, T, D, C, BD):
    """Thinks of a head as D columns of T tokens."""
    t = (i_c * C + torch.arange(C))[:, None]
    d = torch.arange(BD)[None, :]
    return i_bh * T * D + t + d * T, (t < T) & (d < D)


@wrong("kernel.tile_offsets")
def to_int32(i_bh, i_c, T, D, C, BD):
    """Right numbers, but int32 (GPU kernels overflow that way past 2³¹ elements)."""
    offsets, mask = checks.EXERCISES["kernel.tile_offsets"].reference(i_bh, i_c, T, D, C, BD)
    return offsets.to(torch.int32), mask


@right("kernel.tile_offsets")
def to_ok_meshgrid(i_bh, i_c, T, D, C, BD):
    t, d = torch.meshgrid(torch.arange(i_c * C, (i_c + 1) * C), torch.arange(BD), indexing="ij")
    return i_bh * T * D + t * D + d, (t <= T - 1) & (d <= D - 1)


@right("kernel.tile_offsets")
def to_ok_numpy_style(i_bh, i_c, T, D, C, BD):
    """Builds the row starts first, then adds the columns (as a pointer + offsets)."""
    start = i_bh * T * D + i_c * C * D
    offsets = start + D * torch.arange(C).view(C, 1) + torch.arange(BD).view(1, BD)
    n_valid = min(C, T - i_c * C)  # tokens of this chunk inside the sequence
    mask = torch.zeros(C, BD, dtype=torch.bool)
    mask[:n_valid, :D] = True
    return offsets, mask


# -- kernel.state_pass_block ----------------------------------------------------------------------


@right("kernel.state_pass_block")
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


@wrong("kernel.state_pass_block", "stores_next_state")
def sp_store_late(w, u, k, s0, chunk_size, i_v, BV):
    return _learner_pass(w, u, k, s0, chunk_size, i_v, BV, bug="store_late")


@wrong("kernel.state_pass_block", "no_minus_WS")
def sp_no_WS(w, u, k, s0, chunk_size, i_v, BV):
    return _learner_pass(w, u, k, s0, chunk_size, i_v, BV, bug="no_WS")


@wrong("kernel.state_pass_block", "block_from_column_0")
def sp_s0_first_columns(w, u, k, s0, chunk_size, i_v, BV):
    return _learner_pass(w, u, k, s0, chunk_size, i_v, BV, bug="s0_first_columns")


@wrong("kernel.state_pass_block", "state_with_u")
def sp_update_with_U(w, u, k, s0, chunk_size, i_v, BV):
    return _learner_pass(w, u, k, s0, chunk_size, i_v, BV, bug="update_with_U")


@wrong("kernel.state_pass_block", "floor_chunks")
def sp_floor(w, u, k, s0, chunk_size, i_v, BV):
    return _learner_pass(w, u, k, s0, chunk_size, i_v, BV, bug="floor")


@wrong("kernel.state_pass_block")
def sp_states_list_of_S_plus_one(w, u, k, s0, chunk_size, i_v, BV):
    """Writes the states with S_0 prepended and never drops the final one: N + 1 states."""
    states, u_new, S = _learner_pass(w, u, k, s0, chunk_size, i_v, BV)
    return torch.cat([states, S[None]]), u_new, S


@right("kernel.state_pass_block")
def sp_ok_all_columns_then_slice(w, u, k, s0, chunk_size, i_v, BV):
    """Runs the pass on every column and keeps the block's: the columns never mix."""
    states, u_new, S = _learner_pass(w, u, k, s0, chunk_size, 0, u.shape[1])
    cols = slice(i_v * BV, min(u.shape[1], (i_v + 1) * BV))
    return states[..., cols], u_new[:, cols], S[:, cols]


@right("kernel.state_pass_block")
def sp_ok_padded(w, u, k, s0, chunk_size, i_v, BV):
    """Pads T to a multiple of C with zero rows (as the kernel's masked loads do), crops U'."""
    T = u.shape[0]
    pad = -T % chunk_size
    wp, up, kp = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (w, u, k))
    states, u_new, S = _learner_pass(wp, up, kp, s0, chunk_size, i_v, BV)
    return states, u_new[:T], S


@right("kernel.state_pass_block")
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


# kernel.output_stage's wrong answers are Triton kernels, caught by the tests further down
NAMED_ELSEWHERE = {"kernel.output_stage": ("no_causal_mask", "strict_mask")}


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


# -- kernel.output_stage: Triton kernels, run under the interpreter --------------------------------
# Written as a learner would, each with one bug; ``body`` holds everything but the bug.

from tinyk3.checks import ch09_kernel as ck  # noqa: E402
from tinyk3.kernels import AVAILABLE as TRITON  # noqa: E402

if TRITON:
    import triton.language as tl

needs_triton = pytest.mark.skipif(not TRITON, reason="Triton is not installed")


def _out_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, BUG: tl.constexpr):
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    rows = tl.arange(0, BC)
    t = i_c * BC + rows
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    keep_t = t < T
    qk_mask = keep_t[:, None] & (dk[None, :] < Dk)
    tv_mask = keep_t[:, None] & (dv[None, :] < Dv)
    Q = tl.load(q + i_bh * T * Dk + t[:, None] * Dk + dk[None, :], mask=qk_mask, other=0.0)
    K = tl.load(k + i_bh * T * Dk + t[:, None] * Dk + dk[None, :], mask=qk_mask, other=0.0)
    chunk = i_bh * NT + i_c
    if BUG == "state_without_chunk":
        chunk = i_bh * NT
    if BUG == "state_one_back":
        chunk = i_bh * NT + i_c - 1
    S = tl.load(states + chunk * Dk * Dv + dk[:, None] * Dv + dv[None, :],
                mask=(dk[:, None] < Dk) & (dv[None, :] < Dv), other=0.0)
    p_u = u_new + i_bh * T * Dv + t[:, None] * Dv + dv[None, :]
    if BUG == "u_no_mask":
        U = tl.load(p_u)
    else:
        U = tl.load(p_u, mask=tv_mask, other=0.0)
    A = tl.dot(Q, tl.trans(K), input_precision="ieee")
    if BUG == "strict":
        A = tl.where(rows[:, None] > rows[None, :], A, 0.0)
    elif BUG != "no_causal":
        A = tl.where(rows[:, None] >= rows[None, :], A, 0.0)
    out = tl.dot(Q, S, input_precision="ieee") + tl.dot(A, U, input_precision="ieee")
    if BUG == "nan":
        out = out / (out - out)
    p_o = o + i_bh * T * Dv + t[:, None] * Dv + dv[None, :]
    if BUG == "store_no_mask":
        tl.store(p_o, out)
    else:
        tl.store(p_o, out, mask=tv_mask)


# one module-level kernel per bug: the interpreter re-reads a kernel's source by its name
def kernel_no_causal(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr):
    _out_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC, BK, BV, "no_causal")


def kernel_strict(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr):
    _out_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC, BK, BV, "strict")


def kernel_state_without_chunk(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, BK: tl.constexpr,
                              BV: tl.constexpr):
    _out_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC, BK, BV, "state_without_chunk")


def kernel_state_one_back(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr):
    _out_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC, BK, BV, "state_one_back")


def kernel_u_no_mask(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr):
    _out_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC, BK, BV, "u_no_mask")


def kernel_nan(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr):
    _out_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC, BK, BV, "nan")


def kernel_store_no_mask(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr):
    _out_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC, BK, BV, "store_no_mask")


def kernel_none(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr):
    _out_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC, BK, BV, "none")


def _with_bug(bug):
    return globals()[f"kernel_{bug}"]


def ok_int64_and_float_mask(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr):
    """Correct, written differently: int64 head index, the causal mask as a 0/1 factor."""
    i_c = tl.program_id(0)
    i_bh = tl.cast(tl.program_id(1), tl.int64)
    o_i = tl.arange(0, BC)
    o_t = i_c * BC + o_i
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_q = (o_t[:, None] < T) & (o_k[None, :] < Dk)
    m_o = (o_t[:, None] < T) & (o_v[None, :] < Dv)
    b_q = tl.load(q + (i_bh * T + o_t[:, None]) * Dk + o_k[None, :], mask=m_q, other=0.0)
    b_k = tl.load(k + (i_bh * T + o_t[:, None]) * Dk + o_k[None, :], mask=m_q, other=0.0)
    b_s = tl.load(states + ((i_bh * NT + i_c) * Dk + o_k[:, None]) * Dv + o_v[None, :],
                  mask=(o_k[:, None] < Dk) & (o_v[None, :] < Dv), other=0.0)
    b_u = tl.load(u_new + (i_bh * T + o_t[:, None]) * Dv + o_v[None, :], mask=m_o, other=0.0)
    causal = tl.where(o_i[:, None] >= o_i[None, :], 1.0, 0.0)
    scores = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * causal
    b_o = tl.dot(b_q, b_s, input_precision="ieee")
    b_o += tl.dot(scores, b_u, input_precision="ieee")
    tl.store(o + (i_bh * T + o_t[:, None]) * Dv + o_v[None, :], b_o, mask=m_o)


def compile_error_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr):
    """A tile reshaped to a shape with another number of elements: Triton refuses it."""
    o_t = tl.program_id(0) * BC + tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    b_q = tl.load(q + o_t[:, None] * Dk + o_k[None, :], mask=o_t[:, None] < T, other=0.0)
    b_q = tl.reshape(b_q, (BC, 2 * BK))
    tl.store(o + o_t[:, None] * Dv + o_k[None, :], b_q, mask=o_t[:, None] < T)


@needs_triton
@pytest.mark.parametrize("bug,mistake", [
    ("no_causal", "no_causal_mask"),
    ("strict", "strict_mask"),
    ("state_without_chunk", "first_state_every_chunk"),
    ("state_one_back", "previous_chunk_state"),
    ("u_no_mask", "u_new_without_row_mask"),
])


def test_output_kernel_wrong_answer_is_caught(bug, mistake, capsys):
    result = ck.check_output_kernel(_with_bug(bug))
    assert result.status == "failed" and result.mistake == mistake, result.report
    out = flat(capsys.readouterr().out)
    hint = next(m.hint for m in checks.EXERCISES["kernel.output_stage"].mistakes if m.name == mistake)
    assert flat(f"Hint: {hint}") in out and f"First failure: case {result.failed_case}" in out


@needs_triton
def test_output_kernel_store_without_mask_is_reported():
    result = ck.check_output_kernel(_with_bug("store_no_mask"), verbose=False)
    assert result.status == "error" and not result
    assert "stored" in result.report and "outside o" in result.report
    assert "Hint: " in result.report


@needs_triton
def test_output_kernel_nan_is_reported_not_raised():
    result = ck.check_output_kernel(_with_bug("nan"), verbose=False)
    assert result.status == "failed" and "NaN" in result.report, result.report


@needs_triton
def test_output_kernel_compile_error_is_reported_not_raised():
    result = ck.check_output_kernel(compile_error_kernel, verbose=False)
    assert result.status == "error" and result.n_passed == 0, result.report
    assert "your function raised" in result.report


@needs_triton
@pytest.mark.parametrize("kernel", [ck.output_kernel_solution, ok_int64_and_float_mask,
                                    _with_bug("none")], ids=["solution", "int64-float-mask", "body"])


def test_output_kernel_correct_answers_pass(kernel):
    result = ck.check_output_kernel(kernel, verbose=False)
    assert result and result.n_passed == result.n_cases == 5, result.report


@needs_triton
def test_output_kernel_accepts_a_jitted_function():
    import triton

    assert ck.check_output_kernel(triton.jit(ck.output_kernel_solution), verbose=False)


def test_output_kernel_check_without_triton_says_how_to_install():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None
        from tinyk3.checks import ch09_kernel as ck
        r = ck.check_output_kernel(lambda *a: None)
        assert r.status == "error" and not r, r
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "needs Triton" in proc.stdout and "pip install triton" in proc.stdout


def test_output_stage_mistakes_differ_from_the_reference():
    """Every registered mistake gives another output than the reference on some case (else the
    check could not tell them apart)."""
    ex = checks.EXERCISES["kernel.output_stage"]
    for m in ex.mistakes:
        diffs = [(m.fn(*c.args) - ex.reference(*c.args)).abs().nan_to_num(1e9).max().item()
                 for c in ex.cases()]
        assert max(diffs) > 1e-2, m.name


def stub_kernel(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    raise NotImplementedError


@needs_triton
def test_output_kernel_stub_is_not_attempted():
    result = ck.check_output_kernel(stub_kernel, verbose=False)
    assert result.status == "not attempted", result.report

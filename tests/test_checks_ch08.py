"""Chapter 8's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from helpers import right, wrong
from tinyk3 import checks
from tinyk3.ops import wy

# -- chunkwise.delta_rule -------------------------------------------------------------------------


def _learner_loop(q, k, v, beta, chunk_size, *, bug=None):
    """A learner's chunk loop, written the obvious way; `bug` names the one thing done wrong."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    S = torch.zeros(B, H, Dk, Dv, dtype=q.dtype)
    outputs = []
    n_chunks = T // chunk_size if bug == "floor" else math.ceil(T / chunk_size)
    for i in range(n_chunks):
        sl = slice(i * chunk_size, (i + 1) * chunk_size)
        q_c, k_c, v_c, b_c = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        T_c = wy.ut_transform(k_c, b_c)
        if bug == "T_transposed":
            T_c = T_c.transpose(-1, -2)
        w, u = T_c @ k_c, T_c @ v_c
        if bug != "forgot_minus_WS":
            u = u - w @ S  # the true deltas, given the state
        attn = q_c @ k_c.transpose(-1, -2)
        if bug == "strict":
            attn = torch.tril(attn, diagonal=-1)
        elif bug != "no_mask":
            attn = torch.tril(attn)
        if bug == "update_first":
            S = S + k_c.transpose(-1, -2) @ u
            outputs.append(q_c @ S + attn @ u)
        else:
            outputs.append(q_c @ S + attn @ u)
            S = S + k_c.transpose(-1, -2) @ (T_c @ v_c if bug == "state_from_U" else u)
    return torch.cat(outputs, dim=2), S


@wrong("chunkwise.delta_rule", "u_not_u_prime")
def cw_forgot_minus_WS(q, k, v, beta, chunk_size):
    return _learner_loop(q, k, v, beta, chunk_size, bug="forgot_minus_WS")


@wrong("chunkwise.delta_rule", "state_with_u")
def cw_state_from_U(q, k, v, beta, chunk_size):
    return _learner_loop(q, k, v, beta, chunk_size, bug="state_from_U")


@wrong("chunkwise.delta_rule", "read_after_write")
def cw_update_first(q, k, v, beta, chunk_size):
    return _learner_loop(q, k, v, beta, chunk_size, bug="update_first")


@wrong("chunkwise.delta_rule", "no_mask")
def cw_no_mask(q, k, v, beta, chunk_size):
    return _learner_loop(q, k, v, beta, chunk_size, bug="no_mask")


@wrong("chunkwise.delta_rule", "strict_mask")
def cw_strict_mask(q, k, v, beta, chunk_size):
    return _learner_loop(q, k, v, beta, chunk_size, bug="strict")


@wrong("chunkwise.delta_rule", "drops_remainder")
def cw_floor_chunks(q, k, v, beta, chunk_size):
    return _learner_loop(q, k, v, beta, chunk_size, bug="floor")


@wrong("chunkwise.delta_rule")
def cw_T_transposed(q, k, v, beta, chunk_size):
    return _learner_loop(q, k, v, beta, chunk_size, bug="T_transposed")


@wrong("chunkwise.delta_rule", "output_with_u")
def cw_deltas_only_in_state(q, k, v, beta, chunk_size):
    """Computes U' for the state but reads the chunk's block with the plain U = T V."""
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for s in range(0, T, chunk_size):
        qc, kc, vc = q[..., s:s + chunk_size, :], k[..., s:s + chunk_size, :], v[..., s:s + chunk_size, :]
        W, U = wy.wy_factors(kc, vc, beta[..., s:s + chunk_size])
        U_prime = U - W @ S
        outs.append(q[..., s:s + chunk_size, :] @ S + (qc @ kc.mT).tril() @ U)
        S = S + kc.mT @ U_prime
    return torch.cat(outs, dim=-2), S


@right("chunkwise.delta_rule")
def cw_ok_token_loop(q, k, v, beta, chunk_size):
    """Ignores the chunks and runs the recurrence: the same numbers."""
    B, H, T, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(T):
        k_t = k[:, :, t]
        u_t = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + k_t[..., :, None] * u_t[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2), S


@right("chunkwise.delta_rule")
def cw_ok_padded(q, k, v, beta, chunk_size):
    """Pads to a multiple of C (k = 0, β = 0 change nothing), runs whole chunks, crops."""
    T = q.shape[2]
    pad = -T % chunk_size
    qp, kp, vp = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    bp = F.pad(beta, (0, pad))
    o, S = _learner_loop(qp, kp, vp, bp, chunk_size)
    return o[:, :, :T], S


@right("chunkwise.delta_rule")
def cw_ok_recursion(q, k, v, beta, chunk_size):
    """W and U from the row recursion of chapter 7 instead of ut_transform."""
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for s in range(0, T, chunk_size):
        qc, kc, vc, bc = (x[:, :, s:s + chunk_size] for x in (q, k, v, beta))
        ws, us = [], []
        for r in range(kc.shape[2]):
            w, u = kc[:, :, r], vc[:, :, r]
            for i in range(r):
                dot = (kc[:, :, r] * kc[:, :, i]).sum(-1, keepdim=True)
                w, u = w - dot * ws[i], u - dot * us[i]
            ws.append(bc[:, :, r, None] * w)
            us.append(bc[:, :, r, None] * u)
        W, U = torch.stack(ws, 2), torch.stack(us, 2)
        U_new = U - W @ S
        outs.append(qc @ S + (qc @ kc.mT).tril() @ U_new)
        S = S + kc.mT @ U_new
    return torch.cat(outs, 2), S


# -- chunkwise.flops ------------------------------------------------------------------------------


@wrong("chunkwise.flops", "multiply_adds")
def fl_multiply_adds(T, D, C):
    n = math.ceil(T / C)
    return n * (C * C * D + C**3 / 6 + 2 * C * C * D + C * C * D + 3 * C * D * D + C * C * D)


@wrong("chunkwise.flops", "linear_attention_state")
def fl_two_state_products(T, D, C):
    n = math.ceil(T / C)
    gram, inverse, wy_, scores, block = 2 * C * C * D, C**3 / 3, 4 * C * C * D, 2 * C * C * D, 2 * C * C * D
    state = 2 * (2 * C * D * D)  # Q S and Kᵀ U' ... and forgot W S
    return n * (gram + inverse + wy_ + scores + block + state)


@wrong("chunkwise.flops", "floor_chunks")
def fl_floor(T, D, C):
    per_chunk = 10 * C * C * D + C**3 / 3 + 6 * C * D * D
    return (T // C) * per_chunk


@wrong("chunkwise.flops", "closed_form_unpadded")
def fl_closed_form(T, D, C):
    return 6 * T * D**2 + 10 * T * C * D + T * C**2 / 3


@wrong("chunkwise.flops", "no_inverse")
def fl_no_inverse(T, D, C):
    return math.ceil(T / C) * (10 * C * C * D + 6 * C * D * D)


@wrong("chunkwise.flops", "chapter_6_count")
def fl_linear_attention(T, D, C):
    return math.ceil(T / C) * (4 * C * D * D + 4 * C * C * D)


@wrong("chunkwise.flops")
def fl_dense_solve(T, D, C):
    """Counts the inverse as a dense solve with C right-hand sides (C³), not C³/3."""
    return math.ceil(T / C) * (10 * C * C * D + C**3 + 6 * C * D * D)


@right("chunkwise.flops")
def fl_ok_sum_of_products(T, D, C):
    def mm(m, k, n):
        return 2 * m * k * n

    per_chunk = (mm(C, D, C) + C**3 / 3 + mm(C, C, D) + mm(C, C, D) + mm(C, D, C)
                 + mm(C, D, D) + mm(C, D, D) + mm(D, C, D) + mm(C, C, D))
    return -(-T // C) * per_chunk


@right("chunkwise.flops")
def fl_ok_integer_inverse(T, D, C):
    """C³ // 3 instead of C³ / 3: off by less than one flop per chunk."""
    return math.ceil(T / C) * (10 * C * C * D + C**3 // 3 + 6 * C * D * D)


CORRECT = {  # answers made by a factory
    "chunkwise.delta_rule": (lambda q, k, v, beta, chunk_size: _learner_loop(q, k, v, beta, chunk_size),),
}


def test_the_cases_expose_the_remainder_and_the_limits():
    """A short last chunk, C = 1, C > T and a float64 case are all among the cases."""
    cases = checks.EXERCISES["chunkwise.delta_rule"].cases()
    Ts_Cs = [(c.args[0].shape[2], c.args[4]) for c in cases]
    assert any(T % C for T, C in Ts_Cs if C <= T)
    assert any(C == 1 for _, C in Ts_Cs) and any(C > T for T, C in Ts_Cs)
    assert any(c.args[0].dtype == torch.float64 for c in cases)


def test_dropping_the_remainder_passes_exactly_where_C_divides_T():
    cases = checks.EXERCISES["chunkwise.delta_rule"].cases()
    divides = sum(c.args[0].shape[2] % c.args[4] == 0 for c in cases)
    assert checks.run("chunkwise.delta_rule", cw_floor_chunks, verbose=False).n_passed == divides


def test_forgetting_the_deltas_is_right_for_one_chunk_from_an_empty_state():
    """With a single chunk and S_0 = 0, U' = U: the C > T case passes, the others fail."""
    cases = checks.EXERCISES["chunkwise.delta_rule"].cases()
    single = sum(c.args[4] >= c.args[0].shape[2] for c in cases)
    assert single >= 1
    assert checks.run("chunkwise.delta_rule", cw_forgot_minus_WS, verbose=False).n_passed == single

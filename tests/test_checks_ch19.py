"""Chapter 19's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants; and the
references themselves against autograd (so the checks grade against the truth)."""

from __future__ import annotations

import torch

from helpers import right, wrong
from tinyk3 import checks
from tinyk3.checks.ch19_backward import inverse_backward, token_step_backward
from tinyk3.ops import delta_rule

# -- backward.token_step ----------------------------------------------------------------------


def _learner_step(q, k, v, beta, S_prev, dS, do, *, bug=None):
    """A learner's adjoint step, written with outer products and matrix-vector products."""
    b = beta[..., None]
    v_old = (k[..., :, None] * S_prev).sum(-2)  # k_t S_{t−1}
    u = b * (v - v_old)
    S_t = S_prev + k[..., :, None] * u[..., None, :]
    if bug != "forget_output":
        dS = dS + q[..., :, None] * do[..., None, :]
    dq = (do[..., None, :] * (S_prev if bug == "dq_old_state" else S_t)).sum(-1)
    du = (k[..., :, None] * dS).sum(-2)
    dk = (dS * u[..., None, :]).sum(-1)
    if bug != "no_read_back":
        dk = dk - (S_prev * (b * du)[..., None, :]).sum(-1)
    dv = b * du
    dbeta = (du * (v if bug == "beta_v" else v - v_old)).sum(-1)
    dS_prev = dS if bug == "dS_unchanged" else dS - k[..., :, None] * (b * du)[..., None, :]
    return dq, dk, dv, dbeta, dS_prev


@wrong("backward.token_step", "no_output_term")
def ts_forgot_output(*a):
    return _learner_step(*a, bug="forget_output")


@wrong("backward.token_step", "dq_from_previous_state")
def ts_dq_old_state(*a):
    return _learner_step(*a, bug="dq_old_state")


@wrong("backward.token_step", "no_read_back_in_dk")
def ts_no_read_back(*a):
    return _learner_step(*a, bug="no_read_back")


@wrong("backward.token_step", "beta_times_v")
def ts_beta_v(*a):
    return _learner_step(*a, bug="beta_v")


@wrong("backward.token_step", "no_read_back_in_dS")
def ts_dS_unchanged(*a):
    return _learner_step(*a, bug="dS_unchanged")


@wrong("backward.token_step", None)
def ts_dv_without_beta(q, k, v, beta, S_prev, dS, do):
    dq, dk, dv, dbeta, dS_prev = _learner_step(q, k, v, beta, S_prev, dS, do)
    return dq, dk, dv / beta[..., None].clamp(min=1e-3), dbeta, dS_prev  # dv = du


@right("backward.token_step")
def ts_ok(*a):
    return _learner_step(*a)


@right("backward.token_step")
def ts_ok_autograd(q, k, v, beta, S_prev, dS, do):
    """Autograd on one step of the forward: a correct answer too (the chapter's check)."""
    xs = [x.clone().requires_grad_() for x in (q, k, v, beta, S_prev)]
    q_, k_, v_, b_, S_ = xs
    u = b_[..., None] * (v_ - torch.einsum("bhk,bhkv->bhv", k_, S_))
    S_t = S_ + k_[..., :, None] * u[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q_, S_t)
    grads = torch.autograd.grad((o * do).sum() + (S_t * dS).sum(), xs)
    return tuple(g.detach() for g in grads)


# -- backward.unit_lower_inverse ---------------------------------------------------------------


def _learner_inverse(L, dX, *, bug=None):
    I = torch.eye(L.shape[-1], dtype=L.dtype)  # noqa: E741 - the identity, as in the text
    X = torch.linalg.inv(I + L)
    if bug == "no_transpose":
        G = -X @ dX @ X
    elif bug == "plus":
        G = X.mT @ dX @ X.mT
    else:
        G = -X.mT @ dX @ X.mT
    if bug == "no_tril":
        return G
    return torch.tril(G, diagonal=0 if bug == "tril0" else -1)


@wrong("backward.unit_lower_inverse", "no_transposes")
def inv_no_transpose(L, dX):
    return _learner_inverse(L, dX, bug="no_transpose")


@wrong("backward.unit_lower_inverse", "no_mask")
def inv_no_tril(L, dX):
    return _learner_inverse(L, dX, bug="no_tril")


@wrong("backward.unit_lower_inverse", "diagonal_kept")
def inv_tril0(L, dX):
    return _learner_inverse(L, dX, bug="tril0")


@wrong("backward.unit_lower_inverse", "sign")
def inv_plus(L, dX):
    return _learner_inverse(L, dX, bug="plus")


@right("backward.unit_lower_inverse")
def inv_ok(L, dX):
    return _learner_inverse(L, dX)


@right("backward.unit_lower_inverse")
def inv_ok_autograd(L, dX):
    L_ = L.clone().requires_grad_()
    X = torch.linalg.inv(torch.eye(L.shape[-1], dtype=L.dtype) + L_.tril(-1))
    return torch.autograd.grad((X * dX).sum(), L_)[0]


# -- the references against autograd ----------------------------------------------------------


def test_references_equal_autograd():
    for ex in ("backward.token_step", "backward.unit_lower_inverse"):
        exercise = checks.EXERCISES[ex]
        for case in exercise.cases():
            args = [a.double() for a in case.args]
            ref = exercise.reference(*args)
            auto = ts_ok_autograd(*args) if ex == "backward.token_step" else inv_ok_autograd(*args)
            for a, b in zip(ref if isinstance(ref, tuple) else (ref,),
                            auto if isinstance(auto, tuple) else (auto,)):
                assert (a - b).abs().max() < 1e-10, (ex, case.label)


def test_token_step_is_the_step_of_recurrent_backward():
    """Iterating the reference step backward over a sequence gives the library's loop adjoint."""
    gen = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 2, 6, 4
    q, k, v, do = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for _ in range(4))
    beta = torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    states = [torch.zeros(B, H, D, D, dtype=torch.float64)]
    for t in range(T):
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k[:, :, t],
                                                                states[-1]))
        states.append(states[-1] + k[:, :, t, :, None] * u[:, :, None, :])
    dS = torch.zeros(B, H, D, D, dtype=torch.float64)
    dq = torch.zeros_like(q)
    for t in reversed(range(T)):
        dq[:, :, t], *_, dS = token_step_backward(q[:, :, t], k[:, :, t], v[:, :, t],
                                                  beta[:, :, t], states[t], dS, do[:, :, t])
    ref = delta_rule.recurrent_backward(q, k, v, beta, do)
    assert (dq - ref.dq).abs().max() < 1e-12
    assert inverse_backward is checks.EXERCISES["backward.unit_lower_inverse"].reference

"""Chapter 20's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants; and the
references against autograd and the library (so the checks grade against the truth)."""

from __future__ import annotations

import torch

from helpers import right, wrong
from tinyk3 import checks
from tinyk3.checks.ch20_gates_backward import gated_token_step_backward
from tinyk3.ops import gated_delta_rule

# -- backward.decay_mask ----------------------------------------------------------------------


def _learner_mask(g, dGamma, *, bug=None):
    """A learner's version: build Γ, weigh dΓ by it, split into rows and columns, undo the cumsum."""
    C = g.shape[-1]
    G = torch.cumsum(g, dim=-1)
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)
    if bug == "no_mask":
        Gamma = torch.exp(diff)
    else:
        Gamma = torch.exp(diff.masked_fill(~torch.ones(C, C, dtype=torch.bool).tril(), -torch.inf))
    W = dGamma * Gamma
    W = W - torch.diag_embed(torch.diagonal(W, dim1=-2, dim2=-1))  # the diagonal: Γ_ii = 1
    dG = W.sum(-1) if bug == "rows_only" else W.sum(-1) - W.sum(-2)
    if bug == "forward":
        return torch.cumsum(dG, -1)
    if bug == "dG":
        return dG
    return torch.flip(torch.cumsum(torch.flip(dG, [-1]), -1), [-1])


@wrong("backward.decay_mask", "forward_cumsum")
def dm_forward(g, dGamma):
    return _learner_mask(g, dGamma, bug="forward")


@wrong("backward.decay_mask", "no_cumsum")
def dm_dG(g, dGamma):
    return _learner_mask(g, dGamma, bug="dG")


@wrong("backward.decay_mask", "rows_only")
def dm_rows(g, dGamma):
    return _learner_mask(g, dGamma, bug="rows_only")


@wrong("backward.decay_mask", "upper_triangle")
def dm_no_mask(g, dGamma):
    return _learner_mask(g, dGamma, bug="no_mask")


@right("backward.decay_mask")
def dm_ok(g, dGamma):
    return _learner_mask(g, dGamma)


@right("backward.decay_mask")
def dm_ok_autograd(g, dGamma):
    g_ = g.clone().requires_grad_()
    Gamma = gated_delta_rule.decay_mask(g_.cumsum(-1))
    return torch.autograd.grad((Gamma * dGamma).sum(), g_)[0]


# -- backward.gated_token_step ----------------------------------------------------------------


def _learner_gstep(q, k, v, beta, g, S_prev, dS, do, *, bug=None):
    alpha = torch.exp(g)[..., None, None]
    S_dec = S_prev if bug == "no_forget_read" else alpha * S_prev
    v_old = (k[..., :, None] * S_dec).sum(-2)
    u = beta[..., None] * (v - v_old)
    S_t = alpha * S_prev + k[..., :, None] * u[..., None, :]
    dS = dS + q[..., :, None] * do[..., None, :]
    dq = (do[..., None, :] * S_t).sum(-1)
    du = (k[..., :, None] * dS).sum(-2)
    dk = (dS * u[..., None, :]).sum(-1) - (S_dec * (beta[..., None] * du)[..., None, :]).sum(-1)
    dv = beta[..., None] * du
    dbeta = (du * (v - v_old)).sum(-1)
    dS_dec = dS - k[..., :, None] * (beta[..., None] * du)[..., None, :]
    d_alpha = (dS_dec * S_prev).sum((-2, -1))
    dg = d_alpha if bug == "d_alpha" else d_alpha * torch.exp(g)
    dS_prev = dS_dec if bug == "no_decay" else alpha * dS_dec
    return dq, dk, dv, dbeta, dg, dS_prev


@wrong("backward.gated_token_step", "undecayed_dS_prev")
def gs_no_decay(*a):
    return _learner_gstep(*a, bug="no_decay")


@wrong("backward.gated_token_step", "d_alpha_not_dg")
def gs_d_alpha(*a):
    return _learner_gstep(*a, bug="d_alpha")


@wrong("backward.gated_token_step", "undecayed_read_back")
def gs_no_forget_read(*a):
    return _learner_gstep(*a, bug="no_forget_read")


@right("backward.gated_token_step")
def gs_ok(*a):
    return _learner_gstep(*a)


@right("backward.gated_token_step")
def gs_ok_autograd(q, k, v, beta, g, S_prev, dS, do):
    xs = [x.clone().requires_grad_() for x in (q, k, v, beta, g, S_prev)]
    q_, k_, v_, b_, g_, S_ = xs
    S_dec = g_.exp()[..., None, None] * S_
    u = b_[..., None] * (v_ - torch.einsum("bhk,bhkv->bhv", k_, S_dec))
    S_t = S_dec + k_[..., :, None] * u[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q_, S_t)
    grads = torch.autograd.grad((o * do).sum() + (S_t * dS).sum(), xs)
    return tuple(x.detach() for x in grads)


def test_references_equal_autograd():
    for ex, auto in (("backward.decay_mask", dm_ok_autograd),
                     ("backward.gated_token_step", gs_ok_autograd)):
        exercise = checks.EXERCISES[ex]
        for case in exercise.cases():
            args = [a.double() for a in case.args]
            ref, got = exercise.reference(*args), auto(*args)
            for a, b in zip(ref if isinstance(ref, tuple) else (ref,),
                            got if isinstance(got, tuple) else (got,)):
                assert (a - b).abs().max() < 1e-10, (ex, case.label)


def test_gated_token_step_is_the_step_of_recurrent_backward():
    gen = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 2, 6, 4
    q, k, v, do = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
                   for _ in range(4))
    beta = torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    states = [torch.zeros(B, H, D, D, dtype=torch.float64)]
    for t in range(T):
        S = g[:, :, t, None, None].exp() * states[-1]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k[:, :, t], S))
        states.append(S + k[:, :, t, :, None] * u[:, :, None, :])
    dS = torch.zeros(B, H, D, D, dtype=torch.float64)
    dg = torch.zeros_like(g)
    for t in reversed(range(T)):
        *_, dg[:, :, t], dS = gated_token_step_backward(
            q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], g[:, :, t], states[t], dS,
            do[:, :, t])
    ref = gated_delta_rule.recurrent_backward(q, k, v, beta, g, do)
    assert (dg - ref.dg).abs().max() < 1e-12

"""Chapter 11's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import torch

from helpers import assert_failed, right, run, wrong
from tinyk3 import checks
from tinyk3.ops import delta_rule, kda

# -- kda.step -------------------------------------------------------------------------------------


def _learner_step(S, k, v, beta, g, *, bug=None):
    """A learner's KDA step, written the obvious way; `bug` names the one thing done wrong."""
    alpha = g.exp()
    if bug == "columns":
        S_dec = S * alpha[:, :, None, :]  # the value axis
    elif bug == "no_exp":
        S_dec = S * g[..., None]
    else:
        S_dec = S * alpha[..., None]  # Diag(α) S
    read = S if bug in ("read_old", "after") else S_dec
    v_old = (k[..., None] * read).sum(-2)  # k S'   [B, H, Dv]
    u = beta[..., None] * (v - v_old)
    if bug == "after":
        return (S + k[..., None] * u[..., None, :]) * alpha[..., None]  # decay last
    return S_dec + k[..., None] * u[..., None, :]


@wrong("kda.step", "decay_columns")
def st_decay_columns(S, k, v, beta, g):
    return _learner_step(S, k, v, beta, g, bug="columns")


@wrong("kda.step", "decay_after_write")
def st_decay_after_write(S, k, v, beta, g):
    return _learner_step(S, k, v, beta, g, bug="after")


@wrong("kda.step", "error_before_decay")
def st_error_before_decay(S, k, v, beta, g):
    return _learner_step(S, k, v, beta, g, bug="read_old")


@wrong("kda.step", "no_exp")
def st_no_exp(S, k, v, beta, g):
    return _learner_step(S, k, v, beta, g, bug="no_exp")


@wrong("kda.step", "transition_order")
def st_matrix_after(S, k, v, beta, g):
    """Writes the transition as a matrix, but in the wrong order: Diag(α) (I − β kᵀk)."""
    Dk = k.shape[-1]
    eye = torch.eye(Dk, dtype=S.dtype)
    F_t = eye - beta[..., None, None] * k[..., :, None] * k[..., None, :]
    return torch.diag_embed(g.exp()) @ F_t @ S + beta[..., None, None] * k[..., :, None] * v[..., None, :]


@wrong("kda.step", "one_gate_per_head")
def st_scalar_gate(S, k, v, beta, g):
    """Chapter 10's step with the head's mean gate."""
    S = S * g.mean(-1).exp()[..., None, None]
    u = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, S))
    return S + torch.einsum("bhk,bhv->bhkv", k, u)


@right("kda.step")
def st_ok_matrix(S, k, v, beta, g):
    """The transition as a matrix, as the chapter writes it: (I − β kᵀk) Diag(α) S + β kᵀ v."""
    Dk = k.shape[-1]
    eye = torch.eye(Dk, dtype=S.dtype)
    F_t = eye - beta[..., None, None] * k[..., :, None] * k[..., None, :]
    return F_t @ torch.diag_embed(g.exp()) @ S + beta[..., None, None] * k[..., :, None] * v[..., None, :]


@right("kda.step")
def st_ok_lib(S, k, v, beta, g):
    """One token through the lib's token loop, from the given state."""
    args = (x[:, :, None] for x in (k, k, v, beta, g))
    _, S_new = kda.recurrent(*args, initial_state=S)
    return S_new.to(S.dtype)


# -- kda.chunk_scores -----------------------------------------------------------------------------


@wrong("kda.chunk_scores", "naive_factorisation")
def sc_naive(k, g):
    """exp(G_i − G_j) = exp(G_i) exp(−G_j), so A is one matrix product."""
    G = torch.cumsum(g, dim=2)
    return torch.tril((k * torch.exp(G)) @ (k * torch.exp(-G)).transpose(-1, -2), diagonal=-1)


@wrong("kda.chunk_scores")
def sc_naive_mask_multiplied(k, g):
    """The factorisation with the mask multiplied in: inf · 0 = NaN above the diagonal too."""
    G = torch.cumsum(g, dim=2)
    C = k.shape[2]
    mask = torch.tril(torch.ones(C, C, dtype=k.dtype), diagonal=-1)
    return ((k * torch.exp(G)) @ (k * torch.exp(-G)).transpose(-1, -2)) * mask


def _learner_pairwise(k, g, *, bug=None):
    G = g.cumsum(2)
    C = k.shape[2]
    diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # G_i − G_j   [B, H, C, C, Dk]
    if bug == "per_token":
        diff = g[:, :, :, None, :] - g[:, :, None, :, :]
    offset = 0 if bug == "diagonal" else -1
    keep = torch.ones(C, C, dtype=torch.bool).tril(offset)[..., None]
    if bug == "mask_after":
        E = diff.exp() * keep
    else:
        E = torch.where(keep, diff, float("-inf")).exp()
    return (k[:, :, :, None, :] * k[:, :, None, :, :] * E).sum(-1)


@wrong("kda.chunk_scores", "with_diagonal")
def sc_with_diagonal(k, g):
    return _learner_pairwise(k, g, bug="diagonal")


@wrong("kda.chunk_scores", "mask_after_exp")
def sc_mask_after_exp(k, g):
    return _learner_pairwise(k, g, bug="mask_after")


@wrong("kda.chunk_scores", "gates_not_summed")
def sc_per_token_gates(k, g):
    return _learner_pairwise(k, g, bug="per_token")


@wrong("kda.chunk_scores", "no_decay")
def sc_kk_only(k, g):
    return torch.tril(k @ k.mT, -1)


@right("kda.chunk_scores")
def sc_ok_pairwise(k, g):
    return _learner_pairwise(k, g)


@right("kda.chunk_scores")
def sc_ok_loop(k, g):
    """Row by row: for token i, the decay to every earlier token j, relative to G_i."""
    G = g.cumsum(2)
    C = k.shape[2]
    A = torch.zeros(*k.shape[:2], C, C, dtype=k.dtype)
    for i in range(1, C):
        decay = torch.exp(G[:, :, i : i + 1] - G[:, :, :i])  # ≤ 1   [B, H, i, Dk]
        A[:, :, i, :i] = (k[:, :, i : i + 1] * k[:, :, :i] * decay).sum(-1)
    return A


@right("kda.chunk_scores")
def sc_ok_lib_sub_chunks(k, g):
    """The lib's 16-token sub-chunks (kda.pair_scores) with a reference point each; short chunks
    padded with k = 0, g = 0 to a multiple of the sub-chunk."""
    B, H, C, Dk = k.shape
    s = kda.SUB_CHUNK if C >= kda.SUB_CHUNK else C
    pad = -C % s
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad))
    gp = torch.nn.functional.pad(g, (0, 0, 0, pad))
    n = (C + pad) // s
    sub = gp.reshape(B * H, n, s, Dk)
    L = sub.cumsum(2)
    r = torch.cat([torch.zeros_like(L[:, :1, -1:]), L[:, :-1, -1:].cumsum(1)], dim=1)
    X = kp.reshape(B * H, n, s, Dk)
    A = kda.pair_scores(X, X, L, r, strict=True)
    return A.reshape(B, H, C + pad, C + pad)[:, :, :C, :C]


# -- the lists --------------------------------------------------------------------------------------


CORRECT = {  # answers made by a factory
    "kda.step": (lambda S, k, v, beta, g: _learner_step(S, k, v, beta, g),),
}


def test_the_naive_factorisation_is_reported_as_non_finite_and_passes_the_mild_cases():
    """It holds at mild gates and at C = 16 (e^80 < float32's max); at C ≥ 32 with strong gates
    its output has NaN, and the report says so."""
    cases = checks.EXERCISES["kda.chunk_scores"].cases()
    result = run("kda.chunk_scores", sc_naive)
    assert_failed(result, "naive_factorisation")
    assert "NaN" in result.report
    failed = cases[result.failed_case - 1]
    assert failed.args[0].shape[2] >= 32 and failed.args[0].dtype == torch.float32
    mild = [c for c in cases if c.args[0].dtype == torch.float64 or c.args[0].shape[2] <= 16]
    assert result.n_passed == len(mild) >= 3
    # the mask multiplied in also gives NaN: reported as non-finite, with the general hint
    result = run("kda.chunk_scores", sc_naive_mask_multiplied)
    assert_failed(result, None)
    assert "NaN" in result.report


def test_the_cases_hold_strong_gates_and_both_dtypes():
    for eid in ("kda.step", "kda.chunk_scores"):
        cases = checks.EXERCISES[eid].cases()
        gates = [c.args[-1] for c in cases]
        assert min(float(g.min()) for g in gates) <= -4.5  # down to the lower bound −5
        assert all(float(g.max()) <= 0 for g in gates)
        assert {g.dtype for g in gates} == {torch.float32, torch.float64}
    steps = checks.EXERCISES["kda.step"].cases()
    assert any(c.args[1].shape[-1] != c.args[2].shape[-1] for c in steps)  # Dk ≠ Dv


def test_decaying_columns_fails_with_a_value_before_a_shape_error():
    """Dk = Dv comes first, so the columns mistake is caught by value (and named), and the
    cases with Dk ≠ Dv, where it cannot broadcast, are counted as raised."""
    result = run("kda.step", st_decay_columns)
    assert result.mistake == "decay_columns" and result.failed_case == 1


def test_the_step_reference_is_one_token_of_the_lib_loop_and_reduces_to_the_delta_rule():
    case = checks.EXERCISES["kda.step"].cases()[-1]  # float64
    S, k, v, beta, g = case.args
    ref = checks.EXERCISES["kda.step"].reference
    assert torch.allclose(ref(S, k, v, beta, g), st_ok_lib(S, k, v, beta, g), atol=1e-12)
    _, S_dr = delta_rule.recurrent(k[:, :, None], k[:, :, None], v[:, :, None], beta[:, :, None],
                                   initial_state=S)
    assert torch.allclose(ref(S, k, v, beta, torch.zeros_like(g)), S_dr, atol=1e-12)

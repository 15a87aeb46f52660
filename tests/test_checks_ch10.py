"""Chapter 10's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import right, run, wrong
from tinyk3 import checks
from tinyk3.ops import gated_delta_rule as gdr

# -- gated.step -----------------------------------------------------------------------------------


def _learner_step(S, k, v, beta, g, *, bug=None):
    """A learner's gated step, written the obvious way; `bug` names the one thing done wrong."""
    alpha = torch.exp(g)[:, :, None, None]  # [B, H, 1, 1]
    if bug == "log_as_factor":
        alpha = g[:, :, None, None]
    S_old = S
    if bug not in ("decay_last", "read_undecayed", "decay_read_only"):
        S = alpha * S
    read_from = S_old if bug == "read_undecayed" else S
    if bug == "decay_read_only":
        read_from = alpha * S
    v_old = torch.einsum("bhk,bhkv->bhv", k, read_from)
    u = beta[:, :, None] * (v - v_old)
    if bug == "read_undecayed":
        S = alpha * S_old
    S_new = S + torch.einsum("bhk,bhv->bhkv", k, u)
    if bug == "decay_last":
        S_new = alpha * S_new
    return S_new


@wrong("gated.step", "decay_after_write")
def st_decay_last(S, k, v, beta, g):
    return _learner_step(S, k, v, beta, g, bug="decay_last")


@wrong("gated.step", "error_before_forget")
def st_read_undecayed(S, k, v, beta, g):
    return _learner_step(S, k, v, beta, g, bug="read_undecayed")


@wrong("gated.step", "g_as_alpha")
def st_log_as_factor(S, k, v, beta, g):
    return _learner_step(S, k, v, beta, g, bug="log_as_factor")


@wrong("gated.step", "no_decay")
def st_forgot_gate(S, k, v, beta, g):
    """Chapter 5's step, pasted unchanged."""
    v_old = (k.unsqueeze(-2) @ S).squeeze(-2)
    return S + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - v_old)).unsqueeze(-2)


@wrong("gated.step")
def st_decay_read_only(S, k, v, beta, g):
    """Decays the state it reads, but writes into the undecayed state: no registered mistake."""
    return _learner_step(S, k, v, beta, g, bug="decay_read_only")


@right("gated.step")
def st_ok_transition(S, k, v, beta, g):
    """S_new = α (I − β kᵀ k) S + β kᵀ v, with the transition as a matrix."""
    Dk = k.shape[-1]
    eye = torch.eye(Dk, dtype=S.dtype)
    b = beta[..., None, None]
    Ft = eye - b * k.unsqueeze(-1) * k.unsqueeze(-2)  # I − β kᵀ k   [B, H, Dk, Dk]
    return torch.exp(g)[..., None, None] * (Ft @ S) + b * k.unsqueeze(-1) * v.unsqueeze(-2)


@right("gated.step")
def st_ok_lib_loop(S, k, v, beta, g):
    """One token of the lib's token loop, from the state S (q is not needed for the state)."""
    _, S_new = gdr.recurrent(k[:, :, None], k[:, :, None], v[:, :, None], beta[..., None],
                             g[..., None], initial_state=S)
    return S_new


# -- gated.decay_mask -----------------------------------------------------------------------------


@wrong("gated.decay_mask", "exclusive_cumsum")
def dm_exclusive(g):
    G = F.pad(g.cumsum(-1)[..., :-1], (1, 0))  # Σ_{s < i} g_s
    C = g.shape[-1]
    keep = torch.ones(C, C, dtype=torch.bool).tril()
    return torch.where(keep, G[..., :, None] - G[..., None, :], -torch.inf).exp()


@wrong("gated.decay_mask", "no_cumsum")
def dm_no_cumsum(g):
    C = g.shape[-1]
    keep = torch.ones(C, C, dtype=torch.bool).tril()
    return torch.where(keep, g[..., :, None] - g[..., None, :], -torch.inf).exp()


@wrong("gated.decay_mask", "no_mask")
def dm_no_mask(g):
    G = torch.cumsum(g, dim=-1)
    return torch.exp(G[..., :, None] - G[..., None, :])


@wrong("gated.decay_mask", "strict_mask")
def dm_strict(g):
    G = torch.cumsum(g, dim=-1)
    return torch.exp(G[..., :, None] - G[..., None, :]).tril(-1)


@wrong("gated.decay_mask", "reversed_difference")
def dm_reversed(g):
    G = torch.cumsum(g, dim=-1)
    C = g.shape[-1]
    keep = torch.ones(C, C, dtype=torch.bool).tril()
    return torch.where(keep, G[..., None, :] - G[..., :, None], -torch.inf).exp()


@wrong("gated.decay_mask", "mask_after_exp")
def dm_multiply_by_mask(g):
    """Chapter 8's habit, `scores * causal`, applied after the exponential."""
    G = torch.cumsum(g, dim=-1)
    C = g.shape[-1]
    causal = torch.ones(C, C, dtype=g.dtype).tril()
    return torch.exp(G[..., :, None] - G[..., None, :]) * causal


@wrong("gated.decay_mask", "ratio_of_products")
def dm_cumprod_ratio(g):
    gamma = torch.cumprod(torch.exp(g), dim=-1)  # γ_i
    return (gamma[..., :, None] / gamma[..., None, :]).tril()


@wrong("gated.decay_mask")
def dm_transposed(g):
    """Γ laid out with the writer as the row: the upper triangle. No registered mistake."""
    return gdr.decay_mask(g.cumsum(-1)).transpose(-1, -2)


@right("gated.decay_mask")
def dm_ok_loop(g):
    C = g.shape[-1]
    out = torch.zeros(*g.shape, C, dtype=g.dtype)
    for i in range(C):
        for j in range(i + 1):
            out[..., i, j] = torch.exp(g[..., j + 1 : i + 1].sum(-1))  # decays after j, up to i
    return out


@right("gated.decay_mask")
def dm_ok_tril_after_exp(g):
    """exp of all differences, then .tril(): tril selects (no inf · 0), so the values are right."""
    G = g.cumsum(-1)
    return torch.exp(G.unsqueeze(-1) - G.unsqueeze(-2)).tril()


@right("gated.decay_mask")
def dm_ok_masked_fill(g):
    G = g.cumsum(-1)
    C = g.shape[-1]
    above = torch.ones(C, C, dtype=torch.bool).triu(1)
    return (G[..., :, None] - G[..., None, :]).masked_fill(above, float("-inf")).exp()


CORRECT = {  # answers made by a factory
    "gated.step": (lambda S, k, v, beta, g: _learner_step(S, k, v, beta, g),),
}


@pytest.mark.parametrize("exercise_id", ["gated.step", "gated.decay_mask"])
def test_a_raising_learner_function_is_reported_not_raised(exercise_id):
    def crashes(*args):
        raise IndexError("index 16 is out of bounds for dimension 2 with size 16")

    result = run(exercise_id, crashes)
    assert result.status == "error" and not result
    assert result.failed_case == 1 and result.n_passed == 0
    assert "raised IndexError: index 16 is out of bounds" in result.report


@pytest.mark.parametrize("exercise_id", ["gated.step", "gated.decay_mask"])
def test_a_nan_answer_is_reported_not_raised(exercise_id):
    ex = checks.EXERCISES[exercise_id]

    def nan_everywhere(*args):
        return torch.full_like(ex.reference(*args), float("nan"))

    result = run(exercise_id, nan_everywhere)
    assert result.status == "failed" and result.n_passed == 0
    assert "NaN" in result.report and result.mistake is None


def test_the_strong_gate_case_is_where_the_overflow_mistakes_fail():
    """The exp-then-multiply and the ratio-of-products masks are right for mild gates and give NaN
    exactly on the float32 case with strong gates (where e^(−G) overflows)."""
    cases = checks.EXERCISES["gated.decay_mask"].cases()
    strong = [i for i, c in enumerate(cases) if c.args[0].min() < -10]
    assert len(strong) == 1 and cases[strong[0]].args[0].dtype == torch.float32
    for fn in (dm_multiply_by_mask, dm_cumprod_ratio):
        result = run("gated.decay_mask", fn)
        assert result.n_passed == len(cases) - 1 and result.failed_case == strong[0] + 1
        assert "NaN" in result.report
        assert torch.isnan(fn(*cases[strong[0]].args)).any()
    # and the reference is finite there, with Γ ≤ 1
    ref = checks.EXERCISES["gated.decay_mask"].reference(*cases[strong[0]].args)
    assert torch.isfinite(ref).all() and ref.max() <= 1


def test_the_cases_separate_the_step_mistakes():
    """g = 0 (no decay) is among the step cases, where forgetting the gate or decaying after the
    write agrees with the reference; every other case has g < 0, where they do not."""
    cases = checks.EXERCISES["gated.step"].cases()
    no_decay = [i for i, c in enumerate(cases) if (c.args[4] == 0).all()]
    assert len(no_decay) == 1
    assert all((c.args[4] < 0).all() for i, c in enumerate(cases) if i not in no_decay)
    assert run("gated.step", st_forgot_gate).n_passed == 1
    assert run("gated.step", st_decay_last).n_passed == 1

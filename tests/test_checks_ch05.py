"""Chapter 5's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers import assert_failed, right, wrong
from tinyk3 import checks
from tinyk3.ops import delta_rule

# -- delta_rule.step ----------------------------------------------------------------------------


@wrong("delta_rule.step", "no_erase")
def ds_adds_the_value(S, k, v, beta):
    write = beta[..., None] * v  # [B, H, Dv]
    return S + k.unsqueeze(-1) @ write.unsqueeze(-2)  # just a fast-weight write, no erase


@wrong("delta_rule.step", "sign_flipped")
def ds_minus(S, k, v, beta):
    v_old = (k.unsqueeze(-1) * S).sum(dim=-2)  # k S
    return S - torch.einsum("bhk,bhv->bhkv", k, beta.unsqueeze(-1) * (v - v_old))


@wrong("delta_rule.step", "beta_on_v_only")
def ds_beta_on_new_value(S, k, v, beta):
    v_old = (k.unsqueeze(-1) * S).sum(dim=-2)
    delta = beta.unsqueeze(-1) * v - v_old  # "write β v, erase the old value"
    return S + torch.einsum("bhk,bhv->bhkv", k, delta)


@wrong("delta_rule.step", "no_beta")
def ds_forgets_beta(S, k, v, beta):
    v_old = torch.einsum("bhk,bhkv->bhv", k, S)
    return S + torch.einsum("bhk,bhv->bhkv", k, v - v_old)


@wrong("delta_rule.step", "returns_update")
def ds_returns_delta(S, k, v, beta):
    v_old = torch.einsum("bhk,bhkv->bhv", k, S)
    return torch.einsum("bhk,bhv->bhkv", k, beta[..., None] * (v - v_old))


@wrong("delta_rule.step", "normalizes_key")
def ds_normalises(S, k, v, beta):
    k = F.normalize(k, dim=-1)  # "DeltaNet uses unit keys"
    v_old = torch.einsum("bhk,bhkv->bhv", k, S)
    return S + torch.einsum("bhk,bhv->bhkv", k, beta[..., None] * (v - v_old))


@wrong("delta_rule.step", "transposed_read")
def ds_papers_read(S, k, v, beta):
    v_old = (S @ k.unsqueeze(-1)).squeeze(-1)  # S k, as in the papers (only runs if Dk == Dv)
    return S + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - v_old)).unsqueeze(-2)


@wrong("delta_rule.step")
def ds_outer_the_wrong_way(S, k, v, beta):
    v_old = torch.einsum("bhk,bhkv->bhv", k, S)
    u = beta[..., None] * (v - v_old)
    return S + u.unsqueeze(-1) * k.unsqueeze(-2)  # uᵀ k: [Dv, Dk], runs only when Dk == Dv


@right("delta_rule.step")
def ds_ok_loop(S, k, v, beta):
    S = S.clone()
    B, H = beta.shape
    for b in range(B):
        for h in range(H):
            v_old = k[b, h] @ S[b, h]  # [Dv]
            S[b, h] = S[b, h] + torch.outer(k[b, h], beta[b, h] * (v[b, h] - v_old))
    return S


@right("delta_rule.step")
def ds_ok_matmul(S, k, v, beta):
    k_row = k.unsqueeze(-2)  # [B, H, 1, Dk]
    u = beta[..., None, None] * (v.unsqueeze(-2) - k_row @ S)  # [B, H, 1, Dv]
    return S + k_row.transpose(-1, -2) @ u


@right("delta_rule.step")
def ds_ok_projection_form(S, k, v, beta):
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    kk = k.unsqueeze(-1) * k.unsqueeze(-2)  # kᵀ k   [B, H, Dk, Dk]
    b = beta[..., None, None]
    return (eye - b * kk) @ S + b * (k.unsqueeze(-1) * v.unsqueeze(-2))


# -- delta_rule.loop -----------------------------------------------------------------------------


@wrong("delta_rule.loop", "state_read_once")
def dl_one_read_for_the_block(q, k, v, beta, initial_state):
    S = initial_state
    v_old = k @ S  # read the board at every key at once
    u = beta.unsqueeze(-1) * (v - v_old)
    S = S + k.transpose(-1, -2) @ u
    return q @ S, S


@wrong("delta_rule.loop", "output_before_update")
def dl_reads_before_writing(q, k, v, beta, initial_state):
    S, outs = initial_state, []
    for t in range(q.shape[2]):
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))  # read first
        v_old = torch.einsum("bhk,bhkv->bhv", k[:, :, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], beta[:, :, t, None] * (v[:, :, t] - v_old))
    return torch.stack(outs, dim=2), S


@wrong("delta_rule.loop", "additive")
def dl_linear_attention(q, k, v, beta, initial_state):
    S, outs = initial_state, []
    for t in range(q.shape[2]):
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], beta[:, :, t, None] * v[:, :, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2), S


@wrong("delta_rule.loop", "ignores_initial_state")
def dl_starts_from_zero(q, k, v, beta, initial_state):
    S = torch.zeros_like(initial_state)
    outs = []
    for t in range(q.shape[2]):
        v_old = torch.einsum("bhk,bhkv->bhv", k[:, :, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], beta[:, :, t, None] * (v[:, :, t] - v_old))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2), S


def dl_float32_state(q, k, v, beta, initial_state):
    S = initial_state.float()  # the state "in float32 for speed", whatever the inputs
    outs = []
    for t in range(q.shape[2]):
        k_t = k[:, :, t].float()
        v_old = torch.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, beta[:, :, t, None].float() * (v[:, :, t].float() - v_old))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t].float(), S).to(v.dtype))
    return torch.stack(outs, dim=2), S


@right("delta_rule.loop")
def dl_ok_loop(q, k, v, beta, initial_state):
    S, outs = initial_state.clone(), []
    for t in range(q.shape[2]):
        k_t = k[:, :, t].unsqueeze(-2)  # [B, H, 1, Dk]
        u = beta[:, :, t, None, None] * (v[:, :, t].unsqueeze(-2) - k_t @ S)  # [B, H, 1, Dv]
        S = S + k_t.transpose(-1, -2) @ u
        outs.append(q[:, :, t].unsqueeze(-2) @ S)  # [B, H, 1, Dv]
    return torch.cat(outs, dim=2), S


@right("delta_rule.loop")
def dl_ok_parallel(q, k, v, beta, initial_state):
    return delta_rule.parallel(q, k, v, beta, initial_state=initial_state)


def test_the_posts_block_update_passes_only_the_single_token_case():
    """Reading the state once is exact for one token (decoding) and wrong for every block."""
    result = checks.run("delta_rule.loop", dl_one_read_for_the_block, verbose=False)
    assert_failed(result, "state_read_once")
    cases = checks.EXERCISES["delta_rule.loop"].cases()
    assert [c.args[0].shape[2] for c in cases].count(1) == 1
    assert result.n_passed == 1 and result.failed_case == 1


def test_a_float32_state_fails_only_the_float64_case():
    result = checks.run("delta_rule.loop", dl_float32_state, verbose=False)
    assert_failed(result, None)
    assert result.n_passed == result.n_cases - 1 == result.failed_case - 1
    assert "wrong dtype: expected torch.float64, got torch.float32" in result.report


def test_the_papers_read_crashes_only_where_dk_differs_from_dv():
    """S k sums over Dv: it runs on square states (and is wrong there) and raises elsewhere."""
    result = checks.run("delta_rule.step", ds_papers_read, verbose=False)
    assert result.mistake == "transposed_read"
    assert "raised RuntimeError" in result.report

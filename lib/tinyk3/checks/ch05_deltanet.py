"""Chapter 5 exercises: one delta-rule step, and the delta rule over a block of tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import delta_rule
from .core import Case, Exercise, Mistake, register

# -- delta_rule.step -----------------------------------------------------------------------------


def delta_step(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``S + k^T β (v − k S)`` for one token (reference).

    ``S [B, H, Dk, Dv]``, ``k [B, H, Dk]``, ``v [B, H, Dv]``, ``beta [B, H]``; k is used as given
    (not normalised).
    """
    v_old = torch.einsum("bhk,bhkv->bhv", k, S)  # what S holds at k   [B, H, Dv]
    u = beta.unsqueeze(-1) * (v - v_old)  # the delta, scaled       [B, H, Dv]
    return S + k.unsqueeze(-1) * u.unsqueeze(-2)  # S + kᵀ u    [B, H, Dk, Dv]


def _read(k, S):
    return torch.einsum("bhk,bhkv->bhv", k, S)


def _outer(k, u):
    return k.unsqueeze(-1) * u.unsqueeze(-2)


def _step_cases(g: torch.Generator) -> list[Case]:
    def case(B, H, Dk, Dv, label, *, unit=False, beta=None, S_scale=1.0, dtype=torch.float32):
        S = S_scale * torch.randn(B, H, Dk, Dv, generator=g, dtype=dtype)
        k = torch.randn(B, H, Dk, generator=g, dtype=dtype)
        k = F.normalize(k, dim=-1) if unit else 0.5 * k
        v = torch.randn(B, H, Dv, generator=g, dtype=dtype)
        if beta is None:
            b = torch.rand(B, H, generator=g, dtype=dtype)
        else:
            b = torch.full((B, H), beta, dtype=dtype)
        return Case((S, k, v, b), label=label)

    return [
        case(2, 3, 8, 8, "B=2, H=3, Dk=Dv=8, a β per head, keys not of unit length"),
        case(1, 2, 6, 4, "Dk=6 > Dv=4: S is [Dk, Dv]"),
        case(2, 1, 4, 10, "Dk=4 < Dv=10"),
        case(3, 2, 16, 16, "unit keys and β = 1: the old value at k is replaced", unit=True, beta=1.0),
        case(1, 1, 5, 5, "β = 0: nothing is written", beta=0.0),
        case(2, 2, 8, 6, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="delta_rule.step",
    title="one delta-rule step",
    signature="delta_step(S [B, H, Dk, Dv], k [B, H, Dk], v [B, H, Dv], beta [B, H]) -> S_new [B, H, Dk, Dv]",
    reference=delta_step,
    make_cases=_step_cases,
    chapter=5,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("no_erase", lambda S, k, v, b: S + _outer(k, b.unsqueeze(-1) * v),
                "you wrote β v at k without first subtracting what S already holds there: that is "
                "the additive memory of chapter 4. Read v_old = k S first and write the difference: "
                "S + kᵀ β (v − k S)."),
        Mistake("sign_flipped", lambda S, k, v, b: S - _outer(k, b.unsqueeze(-1) * (v - _read(k, S))),
                "the update has the wrong sign: you subtracted kᵀ β (v − k S), which moves the read "
                "k S away from v. Add it: S_new = S + kᵀ β (v − k S)."),
        Mistake("beta_on_v_only", lambda S, k, v, b: S + _outer(k, b.unsqueeze(-1) * v - _read(k, S)),
                "β scales only the new value: you wrote kᵀ (β v − k S), which always erases the whole "
                "old value, whatever β is. β scales the difference: kᵀ β (v − k S)."),
        Mistake("no_beta", lambda S, k, v, b: S + _outer(k, v - _read(k, S)),
                "the write strength β is missing (your update is the one for β = 1): multiply the "
                "difference v − k S by β, one number per batch element and head."),
        Mistake("returns_update", lambda S, k, v, b: _outer(k, b.unsqueeze(-1) * (v - _read(k, S))),
                "you returned only the change kᵀ β (v − k S); return the new state, S plus that change."),
        Mistake("normalizes_key",
                lambda S, k, v, b: delta_step(S, F.normalize(k, dim=-1), v, b),
                "you normalised k inside the step. The step uses k as given; in DeltaNet the layer "
                "normalises q and k before the delta rule (some keys in these cases are not unit)."),
        Mistake("transposed_read",
                lambda S, k, v, b: S + _outer(k, b.unsqueeze(-1) * (v - torch.einsum("bhv,bhkv->bhk", k, S))),
                "you read the state as S k (the papers' layout), which sums over the wrong axis. In "
                "this course k is a row and reads from the left: v_old = k S, summing over Dk "
                "(torch.einsum('bhk,bhkv->bhv', k, S))."),
    ],
    hint="v_old = einsum('bhk,bhkv->bhv', k, S); u = beta[..., None] * (v - v_old); "
         "S_new = S + k[..., :, None] * u[..., None, :].",
))

# -- delta_rule.loop -----------------------------------------------------------------------------


def delta_rule_loop(q, k, v, beta, initial_state):
    """The delta rule over a block of tokens, from ``initial_state`` (reference).

    ``q, k [B, H, T, Dk]``, ``v [B, H, T, Dv]``, ``beta [B, H, T]``, ``initial_state
    [B, H, Dk, Dv]`` → ``(o [B, H, T, Dv], S_T [B, H, Dk, Dv])``.
    """
    return delta_rule.recurrent(q, k, v, beta, initial_state=initial_state)


def _loop(q, k, v, beta, S, *, read_before=False, additive=False):
    outs = []
    for t in range(q.shape[2]):
        q_t, k_t, v_t, b_t = q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t, None]
        o_before = _read(q_t, S)
        u = b_t * v_t if additive else b_t * (v_t - _read(k_t, S))
        S = S + _outer(k_t, u)
        outs.append(o_before if read_before else _read(q_t, S))
    return torch.stack(outs, dim=2), S


def _read_once(q, k, v, beta, S0):
    """The post's block update: every token's delta reads S0, then one write, then every read."""
    U = beta.unsqueeze(-1) * (v - k @ S0)  # [B, H, T, Dv]
    S = S0 + k.transpose(-1, -2) @ U  # [B, H, Dk, Dv]
    return q @ S, S


def _loop_cases(g: torch.Generator) -> list[Case]:
    def case(B, H, T, Dk, Dv, label, *, state=True, dtype=torch.float32):
        q = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1)
        k = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1)
        v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
        beta = torch.rand(B, H, T, generator=g, dtype=dtype)
        S0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=dtype)
        if not state:
            S0 = torch.zeros_like(S0)
        return Case((q, k, v, beta, S0), label=label)

    return [
        case(2, 2, 6, 8, 8, "a block of 6 tokens after a cached state"),
        case(1, 3, 10, 6, 4, "from a zero state, Dk=6 > Dv=4", state=False),
        case(2, 1, 1, 8, 8, "a single token (decoding): the block update is exact here"),
        case(1, 2, 12, 4, 8, "T=12 tokens with Dk=4: keys must overlap"),
        case(2, 2, 5, 8, 8, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="delta_rule.loop",
    title="the delta rule over a block of tokens",
    signature="delta_rule_loop(q, k [B, H, T, Dk], v [B, H, T, Dv], beta [B, H, T], "
              "initial_state [B, H, Dk, Dv]) -> (o [B, H, T, Dv], S_T [B, H, Dk, Dv])",
    reference=delta_rule_loop,
    make_cases=_loop_cases,
    chapter=5,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("state_read_once", _read_once,
                "every token's delta reads the state from before the block, k_t S_0, and every "
                "output reads the state after it (the post's listing): right for a single token, "
                "wrong for a block. Loop over the tokens: token t reads S_{t-1}, which holds "
                "tokens 1..t-1 of the block."),
        Mistake("output_before_update", lambda q, k, v, b, S: _loop(q, k, v, b, S, read_before=True),
                "you read o_t = q_t S_{t-1}, before token t's write; DeltaNet reads after it: "
                "o_t = q_t S_t (token t sees its own value)."),
        Mistake("additive", lambda q, k, v, b, S: _loop(q, k, v, b, S, additive=True),
                "your state only adds kᵀ β v: the erase term is missing. Subtract what the state holds "
                "at k_t first: S_t = S_{t-1} + k_tᵀ β_t (v_t − k_t S_{t-1})."),
        Mistake("ignores_initial_state",
                lambda q, k, v, b, S: delta_rule.recurrent(q, k, v, b),
                "you started from a zero state: continue from initial_state (the cached state the "
                "block follows)."),
    ],
    hint="S = initial_state; for each t: v_old = k_t S; S = S + k_tᵀ β_t (v_t − v_old); "
         "o_t = q_t S. Stack the o_t along dim 2 and return (o, S).",
))

"""Chapter 19 exercises: one step of the token loop's adjoint, and the gradient of a
unit-lower-triangular inverse (the UT transform's backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .core import Case, Exercise, Mistake, register

# -- backward.token_step ----------------------------------------------------------------------


def token_step_backward(q_t, k_t, v_t, beta_t, S_prev, dS, do_t):
    """Reference: one step ``t`` of the delta rule's adjoint, backward in time.

    The forward step: ``u_t = β_t (v_t − k_t S_{t−1})``, ``S_t = S_{t−1} + k_tᵀ u_t``,
    ``o_t = q_t S_t``. ``dS = ∂L/∂S_t`` through the later tokens only (``o_t`` not yet counted),
    ``do_t = ∂L/∂o_t``. Returns ``(dq_t, dk_t, dv_t, dβ_t, dS_{t−1})``. Shapes: ``q_t, k_t
    [B, H, Dk]``, ``v_t, do_t [B, H, Dv]``, ``beta_t [B, H]``, ``S_prev, dS [B, H, Dk, Dv]``.
    """
    return _step(q_t, k_t, v_t, beta_t, S_prev, dS, do_t)


def _step(q, k, v, beta, S_prev, dS, do, *, output=True, dq_from="S_t", read_back=True,
          state_read_back=True, delta_for_beta=True, sign=-1.0):
    """The adjoint step with one thing changed: each keyword switches on a typical mistake."""
    b = beta.unsqueeze(-1)  # [B, H, 1]
    v_old = torch.einsum("bhk,bhkv->bhv", k, S_prev)
    u = b * (v - v_old)
    S_t = S_prev + k.unsqueeze(-1) * u.unsqueeze(-2)
    if output:
        dS = dS + q.unsqueeze(-1) * do.unsqueeze(-2)  # through o_t = q_t S_t
    dq = torch.einsum("bhv,bhkv->bhk", do, S_t if dq_from == "S_t" else S_prev)
    du = torch.einsum("bhk,bhkv->bhv", k, dS)
    dk = torch.einsum("bhkv,bhv->bhk", dS, u)
    dv = b * du
    dbeta = (du * ((v - v_old) if delta_for_beta else v)).sum(-1)
    d_old = sign * b * du
    if read_back:
        dk = dk + torch.einsum("bhkv,bhv->bhk", S_prev, d_old)
    dS_prev = dS + k.unsqueeze(-1) * d_old.unsqueeze(-2) if state_read_back else dS
    return dq, dk, dv, dbeta, dS_prev


def _step_cases(g: torch.Generator) -> list[Case]:
    def case(B, H, Dk, Dv, label, dtype=torch.float32, beta=None):
        def r(*shape):
            return torch.randn(*shape, generator=g, dtype=dtype)

        b = torch.rand(B, H, generator=g, dtype=dtype) if beta is None else \
            torch.full((B, H), beta, dtype=dtype)
        args = (r(B, H, Dk), F.normalize(r(B, H, Dk), dim=-1), r(B, H, Dv), b,
                r(B, H, Dk, Dv), r(B, H, Dk, Dv), r(B, H, Dv))
        return Case(args, label=f"B={B}, H={H}, Dk={Dk}, Dv={Dv}: {label}")

    return [
        case(1, 1, 4, 4, "one head"),
        case(2, 3, 6, 5, "Dk ≠ Dv, several heads"),
        case(1, 2, 8, 3, "β = 1: the key's old value is replaced", beta=1.0),
        case(1, 1, 5, 7, "β = 0: the step writes nothing (dk, dv, dS through the write are 0)",
             beta=0.0),
        case(2, 2, 16, 16, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="backward.token_step",
    title="one step of the token loop's adjoint",
    signature="token_step_backward(q_t, k_t, v_t, beta_t, S_prev, dS, do_t) -> "
              "(dq_t, dk_t, dv_t, dbeta_t, dS_prev)",
    reference=token_step_backward,
    make_cases=_step_cases,
    chapter=19,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("no_output_term", lambda *a: _step(*a, output=False),
                "the output's own gradient is missing from dS: o_t = q_t S_t reads S_t, so before "
                "anything else add q_tᵀ do_t (an outer product [Dk, Dv]) to the dS the later "
                "tokens passed back."),
        Mistake("dq_from_previous_state", lambda *a: _step(*a, dq_from="S_prev"),
                "dq_t uses S_{t−1}, but o_t = q_t S_t reads the state after token t wrote: "
                "dq_t = do_t S_tᵀ, with S_t = S_{t−1} + k_tᵀ u_t."),
        Mistake("no_read_back_in_dk", lambda *a: _step(*a, read_back=False),
                "dk_t misses the read-back: k_t appears twice, in the write k_tᵀ u_t and in "
                "v_old = k_t S_{t−1}. The second adds S_{t−1} (−β_t du_t)ᵀ to dk_t."),
        Mistake("no_read_back_in_dS", lambda *a: _step(*a, state_read_back=False),
                "dS_{t−1} is just dS: the delta also reads S_{t−1} (v_old = k_t S_{t−1}), so "
                "dS_{t−1} = dS + k_tᵀ (−β_t du_t). Without it the gradient forgets that a write "
                "replaces what the key held."),
        Mistake("beta_times_v", lambda *a: _step(*a, delta_for_beta=False),
                "dβ_t multiplies du_t by v_t, but β_t scales the delta v_t − k_t S_{t−1}: "
                "dβ_t = du_t · (v_t − k_t S_{t−1})."),
        Mistake("sign_of_read_back", lambda *a: _step(*a, sign=1.0),
                "the read-back terms have the wrong sign: u_t = β_t (v_t − v_old) decreases "
                "with v_old, so d(v_old) = −β_t du_t."),
    ],
    hint="dS += q_tᵀ do_t; dq_t = do_t S_tᵀ (S_t = S_{t−1} + k_tᵀ u_t); du = k_t dS; "
         "dk_t = dS u_t − S_{t−1} β_t du; dv_t = β_t du; dβ_t = du · (v_t − k_t S_{t−1}); "
         "dS_{t−1} = dS − k_tᵀ β_t du.",
))


# -- backward.unit_lower_inverse ---------------------------------------------------------------


def inverse_backward(A_low, dX):
    """Reference: ``X = (I + A_<)⁻¹`` with ``A_<`` (``A_low``) strictly lower triangular
    ``[..., C, C]``; given ``dX = ∂loss/∂X``, return ``∂loss/∂A_< = tril(−Xᵀ dX Xᵀ, −1)`` (zero
    on and above the diagonal, where ``A_<`` has no entries)."""
    return _inverse(A_low, dX)


def _inverse(L, dX, *, transposes=True, mask=-1, sign=-1.0, one_sided=False):  # L: A_<
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand_as(L)
    X = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)
    Xt = X.transpose(-1, -2) if transposes else X
    G = sign * (Xt @ dX @ (X if one_sided else Xt))
    return G if mask is None else G.tril(mask)


def _inverse_cases(g: torch.Generator) -> list[Case]:
    def case(shape, label, dtype=torch.float32, scale=0.3):
        L = (scale * torch.randn(*shape, generator=g, dtype=dtype)).tril(-1)
        dX = torch.randn(*shape, generator=g, dtype=dtype)
        return Case((L, dX), label=f"shape {list(shape)}: {label}")

    return [
        case((4, 4), "one 4 × 4 matrix"),
        case((2, 3, 8, 8), "a batch of 8 × 8 (every chunk of every head)"),
        case((16, 16), "C = 16, larger entries", scale=1.0),
        case((1, 1), "C = 1: L is empty, so is dL"),
        case((3, 6, 6), "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="backward.unit_lower_inverse",
    title="the UT inverse's gradient",
    signature="inverse_backward(A_low [..., C, C], dX [..., C, C]) -> dA_low [..., C, C]",
    reference=inverse_backward,
    make_cases=_inverse_cases,
    chapter=19,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("no_transposes", lambda L, dX: _inverse(L, dX, transposes=False),
                "−X dX X is the matrix, not the gradient: for Y = A⁻¹, dY = −A⁻¹ dA A⁻¹ gives "
                "the gradient −A⁻ᵀ dY A⁻ᵀ (transposes on both sides), i.e. −Xᵀ dX Xᵀ."),
        Mistake("one_transpose", lambda L, dX: _inverse(L, dX, one_sided=True),
                "one transpose is missing: the gradient is −Xᵀ dX Xᵀ, with X transposed on both "
                "sides."),
        Mistake("no_mask", lambda L, dX: _inverse(L, dX, mask=None),
                "your gradient has entries on and above the diagonal: A_< is strictly lower "
                "triangular (the 1s of I are constants), so keep only tril(·, −1)."),
        Mistake("diagonal_kept", lambda L, dX: _inverse(L, dX, mask=0),
                "the diagonal is kept: the diagonal of I + A_< is the constant 1, A_< has none: "
                "use tril(·, −1)."),
        Mistake("sign", lambda L, dX: _inverse(L, dX, sign=1.0),
                "the sign is wrong: differentiating X (I + A_<) = I gives δX (I + A_<) + X δA_< = 0, "
                "so δX = −X δA_< X: the gradient carries a minus."),
    ],
    hint="X = torch.linalg.solve_triangular(I + A_low, I, upper=False); return "
         "(−Xᵀ @ dX @ Xᵀ).tril(−1).",
))

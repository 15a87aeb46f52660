"""Chapter 20 exercises: the gate's gradient through a chunk's decay mask, and one step of
Gated DeltaNet's adjoint."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .core import Case, Exercise, Mistake, register

# -- backward.decay_mask ----------------------------------------------------------------------


def decay_mask_backward(g, dGamma):
    """Reference: ``Γ_ij = e^{G_i − G_j}`` for ``j ≤ i`` (0 above), ``G_i = Σ_{s ≤ i} g_s``, for the
    log decays ``g [..., C]`` of one chunk. Given ``dGamma = ∂L/∂Γ`` ``[..., C, C]`` (its entries
    above the diagonal, where Γ is the constant 0, carry nothing), return ``∂L/∂g [..., C]``.
    """
    return _mask_backward(g, dGamma)


def _mask_backward(g, dGamma, *, reverse=True, columns=True, times_gamma=True, masked=True,
                   cumsum=True):
    G = g.cumsum(-1)
    diff = G[..., :, None] - G[..., None, :]  # G_i − G_j
    C = g.shape[-1]
    below = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)
    if masked:
        Gamma = torch.where(below, diff, torch.full_like(diff, -torch.inf)).exp()
    else:
        Gamma = diff.exp()
    Z = dGamma * Gamma if times_gamma else dGamma * (below if masked else 1)
    dG = Z.sum(-1) - (Z.sum(-2) if columns else 0)
    if not cumsum:
        return dG
    if reverse:
        return dG.flip(-1).cumsum(-1).flip(-1)  # dg_s = Σ_{i ≥ s} dG_i
    return dG.cumsum(-1)


def _mask_cases(g: torch.Generator) -> list[Case]:
    def case(shape, label, low=-1.0, dtype=torch.float32):
        C = shape[-1]
        logd = low * torch.rand(*shape, generator=g, dtype=dtype)
        dGamma = torch.randn(*shape, C, generator=g, dtype=dtype)
        return Case((logd, dGamma), label=f"g {list(shape)}: {label}")

    return [
        case((8,), "one chunk of 8"),
        case((2, 3, 16), "every chunk of every head, C = 16"),
        case((4,), "gates down to −5 per token", low=-5.0),
        case((1,), "C = 1: one token, no pair j < i, so dg = 0"),
        case((3, 12), "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="backward.decay_mask",
    title="the gate's gradient through Γ",
    signature="decay_mask_backward(g [..., C], dGamma [..., C, C]) -> dg [..., C]",
    reference=decay_mask_backward,
    make_cases=_mask_cases,
    chapter=20,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("forward_cumsum", lambda g, d: _mask_backward(g, d, reverse=False),
                "you summed dG forwards: G_i = Σ_{s ≤ i} g_s, so g_s enters every G_i with "
                "i ≥ s, and dg_s = Σ_{i ≥ s} dG_i, a cumulative sum from the END of the chunk "
                "(flip, cumsum, flip)."),
        Mistake("no_cumsum", lambda g, d: _mask_backward(g, d, cumsum=False),
                "you returned ∂L/∂G, the gradient with respect to the cumulative sums. The "
                "gates are g, and G_i = Σ_{s ≤ i} g_s: sum dG over i ≥ s."),
        Mistake("rows_only", lambda g, d: _mask_backward(g, d, columns=False),
                "only the rows' share: G_i enters Γ_ij with a + sign (row i) and Γ_ji with a − "
                "sign (column i), so dG_i = Σ_j Z_ij − Σ_j Z_ji with Z = dΓ ⊙ Γ."),
        Mistake("no_gamma", lambda g, d: _mask_backward(g, d, times_gamma=False),
                "the factor Γ is missing: ∂Γ_ij/∂G_i = Γ_ij (the derivative of e^x is e^x), so "
                "Z = dΓ ⊙ Γ, not dΓ."),
        Mistake("upper_triangle", lambda g, d: _mask_backward(g, d, masked=False),
                "your Γ has entries above the diagonal: Γ_ij is the constant 0 for j > i, so "
                "those entries of dΓ carry no gradient. Mask before the exponential."),
    ],
    hint="G = g.cumsum(−1); Γ = e^{G_i − G_j} on j < i (−inf elsewhere before exp); Z = dΓ ⊙ Γ; "
         "dG = Z.sum(−1) − Z.sum(−2); dg = dG.flip(−1).cumsum(−1).flip(−1).",
))


# -- backward.gated_token_step ----------------------------------------------------------------


def gated_token_step_backward(q_t, k_t, v_t, beta_t, g_t, S_prev, dS, do_t):
    """Reference: one step of Gated DeltaNet's adjoint. The forward step: ``S' = e^{g_t} S_{t−1}``,
    ``u_t = β_t (v_t − k_t S')``, ``S_t = S' + k_tᵀ u_t``, ``o_t = q_t S_t``; ``dS = ∂L/∂S_t``
    through the later tokens only, ``do_t = ∂L/∂o_t``. Returns ``(dq_t, dk_t, dv_t, dβ_t, dg_t,
    dS_{t−1})``; ``g_t`` and ``beta_t`` are ``[B, H]`` (one gate per head)."""
    return _gstep(q_t, k_t, v_t, beta_t, g_t, S_prev, dS, do_t)


def _gstep(q, k, v, beta, g, S_prev, dS, do, *, decay_dS=True, times_alpha=True,
           dg_state="S_prev", decayed_read=True, dg_after_correction=True):
    a = g.exp()[..., None, None]  # α_t  [B, H, 1, 1]
    b = beta.unsqueeze(-1)
    S_dec = a * S_prev if decayed_read else S_prev
    v_old = torch.einsum("bhk,bhkv->bhv", k, S_dec)
    u = b * (v - v_old)
    S_t = a * S_prev + k.unsqueeze(-1) * u.unsqueeze(-2)
    dS = dS + q.unsqueeze(-1) * do.unsqueeze(-2)
    dq = torch.einsum("bhv,bhkv->bhk", do, S_t)
    du = torch.einsum("bhk,bhkv->bhv", k, dS)
    d_old = -b * du
    dk = torch.einsum("bhkv,bhv->bhk", dS, u) + torch.einsum("bhkv,bhv->bhk", S_dec, d_old)
    dv = b * du
    dbeta = (du * (v - v_old)).sum(-1)
    dS_dec = dS + k.unsqueeze(-1) * d_old.unsqueeze(-2)
    state = {"S_prev": S_prev, "S_dec": a * S_prev}[dg_state]
    dalpha = ((dS_dec if dg_after_correction else dS) * state).sum((-1, -2))
    dg = dalpha * a[..., 0, 0] if times_alpha else dalpha
    dS_prev = a * dS_dec if decay_dS else dS_dec
    return dq, dk, dv, dbeta, dg, dS_prev


def _gstep_cases(g: torch.Generator) -> list[Case]:
    def case(B, H, Dk, Dv, label, low=-1.0, dtype=torch.float32):
        def r(*shape):
            return torch.randn(*shape, generator=g, dtype=dtype)

        args = (r(B, H, Dk), F.normalize(r(B, H, Dk), dim=-1), r(B, H, Dv),
                torch.rand(B, H, generator=g, dtype=dtype),
                low * torch.rand(B, H, generator=g, dtype=dtype),
                r(B, H, Dk, Dv), r(B, H, Dk, Dv), r(B, H, Dv))
        return Case(args, label=f"B={B}, H={H}, Dk={Dk}, Dv={Dv}: {label}")

    return [
        case(1, 1, 4, 4, "one head"),
        case(2, 3, 6, 5, "Dk ≠ Dv, several heads"),
        case(1, 2, 8, 8, "strong gates, down to −5", low=-5.0),
        case(1, 1, 5, 3, "gates near 0: almost the delta rule", low=-1e-3),
        case(2, 2, 16, 16, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="backward.gated_token_step",
    title="Gated DeltaNet's adjoint step",
    signature="gated_token_step_backward(q_t, k_t, v_t, beta_t, g_t, S_prev, dS, do_t) -> "
              "(dq_t, dk_t, dv_t, dbeta_t, dg_t, dS_prev)",
    reference=gated_token_step_backward,
    make_cases=_gstep_cases,
    chapter=20,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("undecayed_dS_prev", lambda *a: _gstep(*a, decay_dS=False),
                "dS_{t−1} is missing the decay: S' = α_t S_{t−1}, so the gradient reaching "
                "S_{t−1} is α_t times the gradient with respect to S'."),
        Mistake("d_alpha_not_dg", lambda *a: _gstep(*a, times_alpha=False),
                "that is ∂L/∂α_t, not ∂L/∂g_t: α_t = e^{g_t}, so dg_t = α_t · dα_t."),
        Mistake("dg_from_decayed_state", lambda *a: _gstep(*a, dg_state="S_dec"),
                "dg_t multiplies by the decayed state S' = α_t S_{t−1}: the derivative of "
                "α_t S_{t−1} with respect to α_t is S_{t−1} itself, so dα_t = Σ dS' ⊙ S_{t−1}."),
        Mistake("undecayed_read_back", lambda *a: _gstep(*a, decayed_read=False),
                "your read-back uses S_{t−1}: Gated DeltaNet forgets before the error, so the "
                "token reads k_t S' with S' = α_t S_{t−1} (and dk_t's read-back share uses S')."),
        Mistake("dg_before_correction", lambda *a: _gstep(*a, dg_after_correction=False),
                "dg_t uses the gradient of S_t, before the read-back's correction: α_t scales "
                "S', and S' reaches the loss through S_t AND through the read-back k_t S', so "
                "dS' = dS + k_tᵀ (−β_t du_t) is the one to multiply."),
    ],
    hint="α = e^{g}; S' = α S_{t−1}; u = β (v − k S'); dS += qᵀ do; dq = do S_tᵀ; du = k dS; "
         "dk = dS u − S' β du; dv = β du; dβ = du · (v − k S'); dS' = dS − kᵀ β du; "
         "dg = α Σ dS' ⊙ S_{t−1}; dS_{t−1} = α dS'.",
))

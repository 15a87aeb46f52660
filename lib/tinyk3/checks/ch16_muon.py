"""Chapter 16 exercises: Muon's Newton–Schulz orthogonalisation, and QK-Clip's per-row scales
for an MLA layer (the clip factors and the split between q_nope, q_rope and k_nope)."""

from __future__ import annotations

import torch

from .core import Case, Exercise, Mistake, register

# -- muon.newton_schulz ---------------------------------------------------------------------------


def newton_schulz(G, steps, a, b, c):
    """Reference: ``X₀ = G / max(‖G‖_F, 1e-7)`` (a tall ``G`` transposed first), then ``steps``
    times ``A = X Xᵀ``, ``X ← aX + (bA + cA²)X``; transposed back; in ``G``'s dtype."""
    return _ns(G, steps, a, b, c)


def _ns(G, steps, a, b, c, *, norm="fro", eps=1e-7, swap_bc=False, back=True,
        dtype=None, extra_steps=0):
    """The iteration, with the keyword arguments switching to mistakes."""
    X = G.to(dtype or G.dtype)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    if norm == "fro":
        X = X / X.norm().clamp_min(eps) if eps else X / X.norm()
    elif norm == "spectral":
        X = X / torch.linalg.matrix_norm(X, ord=2)
    if swap_bc:
        b, c = c, b
    for _ in range(steps + extra_steps):
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall and back:
        X = X.T
    return X.to(G.dtype)


def _ns_cases(gen: torch.Generator) -> list[Case]:
    quintic = (3.4445, -4.7750, 2.0315)

    def case(m, n, steps, label, *, coeffs=quintic, scale=1.0, zero=False, dtype=torch.float64):
        G = scale * torch.randn(m, n, generator=gen, dtype=torch.float64)
        if zero:
            G = torch.zeros(m, n, dtype=torch.float64)
        return Case((G.to(dtype), steps) + tuple(coeffs),
                    label=f"G [{m}, {n}], {steps} steps, (a, b, c) = {coeffs}: {label}")

    return [
        case(16, 32, 5, "a wide matrix, Muon's five steps"),
        case(40, 12, 5, "a tall matrix: transposed, and back"),
        case(24, 24, 1, "one step", scale=30.0),
        case(20, 30, 5, "large entries: the normalisation matters", scale=1e3),
        case(12, 18, 8, "the classic cubic (1.5, -0.5, 0): towards U Vᵀ",
             coeffs=(1.5, -0.5, 0.0)),
        case(32, 48, 5, "float32: keep the dtype", dtype=torch.float32),
        case(6, 10, 5, "a zero matrix: the eps guard gives zeros", zero=True),
    ]


register(Exercise(
    id="muon.newton_schulz",
    title="the Newton–Schulz orthogonalisation",
    signature="newton_schulz(G [m, n], steps, a, b, c) -> X [m, n]",
    reference=newton_schulz,
    make_cases=_ns_cases,
    chapter=16,
    atol=1e-5,
    rtol=1e-4,
    mistakes=[
        Mistake("no_normalisation", lambda G, s, a, b, c: _ns(G, s, a, b, c, norm=None),
                "you iterate on G itself: a singular value above 1 grows like σ⁵ at every "
                "step. Divide by the Frobenius norm first, X = G / G.norm(), so that every "
                "singular value is at most 1."),
        Mistake("spectral_norm", lambda G, s, a, b, c: _ns(G, s, a, b, c, norm="spectral"),
                "you divided by the largest singular value: Muon divides by the Frobenius "
                "norm, G.norm() (cheap, no SVD, and ≥ the spectral norm), which puts the "
                "singular values at different points of the polynomial."),
        Mistake("no_eps", lambda G, s, a, b, c: _ns(G, s, a, b, c, eps=0.0),
                "a zero G gives 0/0 = NaN: divide by G.norm().clamp_min(1e-7) (Muon's eps), "
                "so the zero matrix stays zero."),
        Mistake("b_and_c_swapped", lambda G, s, a, b, c: _ns(G, s, a, b, c, swap_bc=True),
                "b and c are swapped: the step is X ← aX + (bA + cA²)X with A = X Xᵀ, so b "
                "goes with A (σ³) and c with A² (σ⁵)."),
        Mistake("not_transposed_back", lambda G, s, a, b, c: _ns(G, s, a, b, c, back=False),
                "for a tall G you work on Gᵀ (the smaller Gram matrix) but return the result "
                "transposed: transpose it back to G's shape [m, n]."),
        Mistake("one_step_short", lambda G, s, a, b, c: _ns(G, s, a, b, c, extra_steps=-1),
                "one step short: run the update exactly `steps` times, for _ in range(steps)."),
    ],
    hint="X = G / G.norm().clamp_min(1e-7), transposed if G is tall; then `steps` times A = "
         "X @ X.T; X = a * X + (b * A + c * A @ A) @ X; transpose back if you transposed. "
         "Compute in G's own dtype: bfloat16 (torch.optim.Muon's choice) is off by ~1e-2.",
))


# -- qk_clip.mla_scales ---------------------------------------------------------------------------


def mla_scales(max_logits, tau, alpha, dn, dr, dv):
    """Reference: QK-Clip's row multipliers for one MLA layer of ``H`` heads.

    ``η_h = τ / S_max^h`` for the heads with ``S_max^h > τ``, exactly 1 for the others. Returns
    ``(q_scale [H·(dn + dr)], kv_scale [H·(dn + dv)])``, the factors of the rows of
    ``q_b_proj`` (per head ``dn`` nope rows then ``dr`` rope rows) and of ``kv_b_proj`` (per
    head ``dn`` W_UK rows then ``dv`` W_UV rows): ``q_nope`` by ``η^α``, ``q_rope`` by ``η``
    (the rope key is shared by all heads and is not scaled), ``k_nope`` by ``η^(1−α)``, ``v``
    by 1. In ``max_logits``' dtype."""
    return _scales(max_logits, tau, alpha, dn, dr, dv)


def _scales(m, tau, alpha, dn, dr, dv, *, clamp=True, invert=False, rope_power="one",
            v_power="none", a_q=None, a_k=None):
    if invert:
        eta = (m / tau).clamp(max=1.0)  # min(1, S_max / τ)
    elif clamp:
        eta = torch.where(m > tau, tau / m, torch.ones_like(m))
    else:
        eta = tau / m
    a_q = alpha if a_q is None else a_q
    a_k = 1 - alpha if a_k is None else a_k
    rope = {"one": eta, "alpha": eta.pow(a_q), "none": torch.ones_like(eta)}[rope_power]
    v = {"none": torch.ones_like(eta), "k": eta.pow(a_k)}[v_power]
    H = m.shape[0]
    q = torch.cat([eta.pow(a_q)[:, None].expand(H, dn), rope[:, None].expand(H, dr)], 1)
    kv = torch.cat([eta.pow(a_k)[:, None].expand(H, dn), v[:, None].expand(H, dv)], 1)
    return q.reshape(-1).to(m.dtype), kv.reshape(-1).to(m.dtype)


def _scales_cases(gen: torch.Generator) -> list[Case]:
    def case(H, tau, alpha, dn, dr, dv, label, *, at_tau=False, negative=False,
             dtype=torch.float64):
        m = tau * (0.4 + 1.6 * torch.rand(H, generator=gen, dtype=torch.float64))
        m[1], m[-2] = 1.5 * tau, 0.7 * tau  # at least one head over τ and one below
        if at_tau:
            m[0] = tau  # exactly at τ: not over
        if negative:
            m[-1] = -3.0
        return Case((m.to(dtype), tau, alpha, dn, dr, dv),
                    label=f"H={H}, tau={tau}, alpha={alpha}, dn={dn}, dr={dr}, dv={dv}: {label}")

    return [
        case(4, 100.0, 0.5, 8, 4, 6, "Kimi K2's tau and alpha"),
        case(6, 100.0, 0.3, 8, 4, 8, "alpha = 0.3: the two sides differ", at_tau=True),
        case(8, 50.0, 0.5, 16, 8, 16, "a head exactly at tau, one negative", at_tau=True,
             negative=True),
        case(5, 100.0, 0.7, 6, 2, 4, "alpha = 0.7"),
        case(3, 100.0, 0.5, 8, 0, 8, "no rope channels (dr = 0)"),
        case(16, 100.0, 0.5, 128, 64, 128, "Kimi K2's head sizes", dtype=torch.float32),
    ]


register(Exercise(
    id="qk_clip.mla_scales",
    title="QK-Clip's row scales for MLA",
    signature="mla_scales(max_logits [H], tau, alpha, dn, dr, dv) -> "
              "(q_scale [H·(dn+dr)], kv_scale [H·(dn+dv)])",
    reference=mla_scales,
    make_cases=_scales_cases,
    chapter=16,
    atol=1e-6,
    rtol=1e-6,
    mistakes=[
        Mistake("no_min", lambda *a: _scales(*a, clamp=False),
                "the heads below tau were scaled UP: η = min(1, τ / S_max), so a head whose "
                "largest logit is at most τ keeps η = 1 and is not touched (torch.where(m > "
                "tau, tau / m, 1))."),
        Mistake("inverted", lambda *a: _scales(*a, invert=True),
                "your η is min(1, S_max / τ), the ratio the wrong way up: it shrinks the heads "
                "BELOW τ and leaves those over it. The head must end at τ: η = τ / S_max "
                "where S_max > τ, else 1."),
        Mistake("rope_like_nope", lambda *a: _scales(*a, rope_power="alpha"),
                "the q_rope rows got η^α like q_nope: the rope key is shared by all heads and "
                "is not scaled, so the rope part of the logit is scaled by q_rope alone, by "
                "the full η."),
        Mistake("rope_untouched", lambda *a: _scales(*a, rope_power="none"),
                "the q_rope rows were left at 1: then the rope part of the logit (q_rope · "
                "k_rope) is not clipped at all. Scale them by η (the shared key stays)."),
        Mistake("values_scaled", lambda *a: _scales(*a, v_power="k"),
                "you scaled the W_UV rows too: only the keys take part in the logit. The "
                "last dv rows of each head in kv_b_proj keep the factor 1."),
        Mistake("mha_rule", lambda m, t, al, dn, dr, dv: _scales(m, t, al, dn, dr, dv,
                                                                rope_power="alpha", a_q=0.5,
                                                                a_k=0.5),
                "you applied the multi-head rule, √η on every query and key row: for MLA the "
                "q_nope rows take η^α and k_nope η^(1−α), and the q_rope rows the full η, "
                "because the shared rope key cannot be scaled per head."),
        Mistake("alpha_swapped",
                lambda m, t, al, dn, dr, dv: _scales(m, t, al, dn, dr, dv, a_q=1 - al, a_k=al),
                "α and 1 − α are swapped: q_nope gets η^α and k_nope η^(1−α) (α = ½ hides "
                "it; try the cases with another α)."),
    ],
    hint="eta = torch.where(m > tau, tau / m, 1); per head, q rows: [eta**alpha] * dn + "
         "[eta] * dr; kv rows: [eta**(1 - alpha)] * dn + [1] * dv; flatten head by head, in "
         "m's dtype.",
))

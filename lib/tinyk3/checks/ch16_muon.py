"""Chapter 16 exercises: the largest logit a QK-Norm head can produce (it does not depend on the
weights, so clipping them changes nothing), and QK-Clip's per-row scales for an MLA layer (the
clip factors and the split between q_nope, q_rope and k_nope)."""

from __future__ import annotations

import torch

from .core import Case, Exercise, Mistake, register

# -- qk_norm.max_logit ----------------------------------------------------------------------------


def max_logit(W_q, W_k, gamma_q, gamma_k):
    """Reference: the largest attention logit one head of a QK-Norm layer can produce, over all
    inputs. The head computes ``q = RMSNorm(W_q x) ⊙ γ_q`` and ``k = RMSNorm(W_k x') ⊙ γ_k``
    (eps 0, no rotation between the norm and the product; ``W_q, W_k [d, d_model]`` of full
    rank ``d``) and the logit ``q·k / √d``. The normed vectors have length exactly ``√d`` and,
    with full-rank weights, any direction, so the supremum puts both on the channel ``j`` with
    the largest ``|γ_q,j γ_k,j|``: ``√d · max_j |γ_q,j γ_k,j|``, whatever the weights."""
    d = gamma_q.shape[0]
    return d ** 0.5 * float((gamma_q.double() * gamma_k.double()).abs().max())


def _logit_cases(gen: torch.Generator) -> list[Case]:
    def weights(d, d_model, scale):
        W_q = scale * torch.randn(d, d_model, generator=gen, dtype=torch.float64)
        W_k = scale * torch.randn(d, d_model, generator=gen, dtype=torch.float64)
        return W_q, W_k

    def case(d, d_model, scale, gamma_q, gamma_k, label):
        W_q, W_k = weights(d, d_model, scale)
        return Case((W_q, W_k, gamma_q.double(), gamma_k.double()),
                    label=f"d={d}, d_model={d_model}, weights ×{scale:g}: {label}")

    def spread(d, lo, hi):
        return lo + (hi - lo) * torch.rand(d, generator=gen, dtype=torch.float64)

    d = 16  # the largest gains on different channels
    g_q, g_k = spread(d, 0.5, 1.0), spread(d, 0.5, 1.0)
    g_q[0], g_k[1] = 3.0, 3.0
    g_q[5], g_k[5] = 2.0, 2.0
    signed_q, signed_k = spread(64, 0.2, 1.0), spread(64, 0.2, 1.0)
    signed_q[7], signed_k[7] = -2.5, 2.0  # the largest |product| is negative
    zero_q = spread(4, 0.5, 1.5)
    zero_q[2] = 0.0
    trained = (1 + 0.3 * torch.randn(32, generator=gen, dtype=torch.float64)).abs()
    return [
        case(8, 16, 1.0, torch.ones(8), torch.ones(8), "gains at their initial value 1"),
        case(d, 32, 1.0, g_q, g_k, "the largest gains on different channels"),
        case(64, 64, 0.1, signed_q, signed_k, "a negative gain: the logit's size counts"),
        case(128, 256, 1000.0, spread(128, 0.9, 1.1), spread(128, 0.9, 1.1),
             "huge weights (as after a logit blow-up)"),
        case(4, 8, 1e-3, zero_q, spread(4, 0.5, 1.5), "tiny weights, a gain of zero"),
        case(32, 48, 1.0, trained, trained.flip(0), "gains as training leaves them"),
    ]


def _mistake_logit(kind):
    def fn(W_q, W_k, gamma_q, gamma_k):
        d = gamma_q.shape[0]
        gq, gk = gamma_q.double(), gamma_k.double()
        if kind == "separate_maxima":
            return d ** 0.5 * float(gq.abs().max() * gk.abs().max())
        if kind == "gain_norms":
            return float(gq.norm() * gk.norm()) / d ** 0.5
        if kind == "signed":
            return d ** 0.5 * float((gq * gk).max())
        top = float((gq * gk).abs().max())
        if kind == "unit_length":
            return top / d ** 0.5
        if kind == "no_scale":
            return d * top
        if kind == "weights_too":  # the un-normed bound's spectral norms kept
            return d ** 0.5 * top * float(torch.linalg.matrix_norm(W_q.double(), 2)
                                          * torch.linalg.matrix_norm(W_k.double(), 2))
        raise ValueError(kind)

    return fn


register(Exercise(
    id="qk_norm.max_logit",
    title="the largest logit under QK-Norm",
    signature="max_logit(W_q, W_k, gamma_q, gamma_k) -> float",
    reference=max_logit,
    make_cases=_logit_cases,
    chapter=16,
    mistakes=[
        Mistake("weights_too", _mistake_logit("weights_too"),
                "your bound grows with the weights: RMSNorm divides W_q x by its own RMS, so "
                "the normed q has length √d whatever W_q and x are. The weights choose only "
                "its direction, and with full rank every direction is reachable."),
        Mistake("separate_maxima", _mistake_logit("separate_maxima"),
                "max|γ_q|·max|γ_k| is an upper bound but not the largest logit when the two "
                "largest gains sit on different channels: the logit is Σ_j γ_q,j γ_k,j "
                "q̂_j k̂_j / √d, so the channels pair up. Take max_j |γ_q,j γ_k,j|."),
        Mistake("gain_norms", _mistake_logit("gain_norms"),
                "‖γ_q‖·‖γ_k‖ / √d treats every entry of the normed vectors as ±1: the norm "
                "fixes their length (√d), not their entries, so the largest logit puts the "
                "whole length on the best channel."),
        Mistake("unit_length", _mistake_logit("unit_length"),
                "RMSNorm makes the root-mean-square of the entries 1, not the length: a "
                "d-vector with RMS 1 has length √d."),
        Mistake("no_scale", _mistake_logit("no_scale"),
                "the logit is divided by √d (the softmax scale): d·max|γ_q γ_k| / √d."),
        Mistake("signed", _mistake_logit("signed"),
                "a negative γ_q,j γ_k,j gives a large logit too (flip the sign of k̂): take "
                "the largest |γ_q,j γ_k,j|."),
    ],
    hint="RMSNorm leaves q̂ = W_q x / RMS(W_q x) of length √d whatever the weights; the logit "
         "is Σ_j γ_q,j γ_k,j q̂_j k̂_j / √d. Put all of q̂ and k̂ (±√d) on the channel j with "
         "the largest |γ_q,j γ_k,j|: √d · max_j |γ_q,j γ_k,j|.",
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

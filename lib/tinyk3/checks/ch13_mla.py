"""Chapter 13 exercises: the absorbed attention scores of multi-head latent attention, and
DeepSeek's interleaved rotary embedding."""

from __future__ import annotations

import math

import torch

from .core import Case, Exercise, Mistake, register

# -- mla.absorbed_scores --------------------------------------------------------------------------


def absorbed_scores(q_nope, q_rope, c, k_rope, w_uk):
    """Reference: MLA's attention scores computed from the latent cache, without expanding it::

        s_ts = (q_nope,t W_UK c_sᵀ + q_rope,t k_rope,sᵀ) / √(dn + dr)

    per head: ``W_UK`` (``w_uk[h]``, ``[dn, r]``) is folded into the query, ``q_nope W_UK`` is
    an ``r``-wide row that meets the latents ``c`` directly; the rope part is the shared
    ``dr``-wide key of every head. ``q_nope [B, H, T, dn]``, ``q_rope [B, H, T, dr]``,
    ``c [B, S, r]``, ``k_rope [B, S, dr]``, ``w_uk [H, dn, r]``; returns ``[B, H, T, S]``
    (no mask, no softmax). The scale is the one of the expanded keys, ``dn + dr`` wide."""
    dn, dr = q_nope.shape[-1], q_rope.shape[-1]
    q_lat = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # q_nope W_UK   [B, H, T, r]
    s = torch.einsum("bhtr,bsr->bhts", q_lat, c)  # against the latents
    s = s + torch.einsum("bhtd,bsd->bhts", q_rope, k_rope)  # + the shared rope key
    return s / math.sqrt(dn + dr)


def _raw(q_nope, q_rope, c, k_rope, w_uk, *, rope=True, transpose=False):
    w = w_uk.transpose(-1, -2) if transpose else w_uk
    s = torch.einsum("bhtn,hnr->bhtr", q_nope, w) @ c.unsqueeze(1).transpose(-1, -2)
    if rope:
        s = s + q_rope @ k_rope.unsqueeze(1).transpose(-1, -2)
    return s


def _scaled(width):
    """The raw scores divided by √width(dn, dr, r)."""
    def fn(q_nope, q_rope, c, k_rope, w_uk):
        dn, dr, r = q_nope.shape[-1], q_rope.shape[-1], c.shape[-1]
        return _raw(q_nope, q_rope, c, k_rope, w_uk) / math.sqrt(width(dn, dr, r))
    return fn


def _scores_cases(gen: torch.Generator) -> list[Case]:
    def case(B, H, T, S, dn, dr, r, label, *, dtype=torch.float32):
        q_nope = torch.randn(B, H, T, dn, generator=gen, dtype=dtype)
        q_rope = torch.randn(B, H, T, dr, generator=gen, dtype=dtype)
        c = torch.randn(B, S, r, generator=gen, dtype=dtype)
        k_rope = torch.randn(B, S, dr, generator=gen, dtype=dtype)
        w_uk = torch.randn(H, dn, r, generator=gen, dtype=dtype) / math.sqrt(r)
        return Case((q_nope, q_rope, c, k_rope, w_uk),
                    label=f"B={B}, H={H}, T={T}, S={S}, dn={dn}, dr={dr}, r={r}: {label}")

    return [
        case(2, 3, 5, 5, 8, 4, 8, "dn = r, so W_UK and its transpose have the same shape"),
        case(1, 4, 6, 9, 8, 4, 16, "r > dn, more keys than queries"),
        case(2, 2, 1, 12, 16, 8, 12, "one query against a cache of 12 latents (decoding)"),
        case(1, 2, 4, 7, 6, 2, 10, "dn + dr = 8, r + dr = 12"),
        case(1, 3, 3, 6, 8, 0, 12, "dr = 0: no shared rotary channels at all"),
        case(2, 2, 4, 8, 8, 4, 16, "float64: keep the dtype", dtype=torch.float64),
    ]


register(Exercise(
    id="mla.absorbed_scores",
    title="MLA's absorbed attention scores",
    signature="absorbed_scores(q_nope [B, H, T, dn], q_rope [B, H, T, dr], c [B, S, r], "
              "k_rope [B, S, dr], w_uk [H, dn, r]) -> scores [B, H, T, S]",
    reference=absorbed_scores,
    make_cases=_scores_cases,
    chapter=13,
    atol=1e-5,
    rtol=1e-5,
    mistakes=[
        Mistake("no_scale", lambda *a: _raw(*a),
                "the scores are not scaled: divide by √(dn + dr), the width of the per-head key "
                "[k_nope, k_rope] the absorbed form stands for."),
        Mistake("scale_nope_only", _scaled(lambda dn, dr, r: dn),
                "you scaled by 1/√dn: the key of a head is [k_nope, k_rope], dn + dr wide, and "
                "the scale is 1/√(dn + dr) for both parts (the model was trained with it)."),
        Mistake("scale_absorbed_width", _scaled(lambda dn, dr, r: r + dr),
                "you scaled by the width of the absorbed key, 1/√(r + dr): absorption changes "
                "how the scores are computed, not what they are. The scale stays the expanded "
                "key's, 1/√(dn + dr)."),
        Mistake("scale_latent", _scaled(lambda dn, dr, r: r),
                "you scaled by 1/√r, the latent width: the scale is the per-head key's, "
                "1/√(dn + dr)."),
        Mistake("no_rope", lambda q_nope, q_rope, c, k_rope, w_uk: _raw(
                    q_nope, q_rope, c, k_rope, w_uk, rope=False) / math.sqrt(
                    q_nope.shape[-1] + q_rope.shape[-1]),
                "the rope part is missing: add q_rope k_ropeᵀ, the shared rotated key every head "
                "scores against (k_rope [B, S, dr] broadcast over the heads)."),
        Mistake("w_uk_transposed", lambda q_nope, q_rope, c, k_rope, w_uk: _raw(
                    q_nope, q_rope, c, k_rope, w_uk, transpose=True) / math.sqrt(
                    q_nope.shape[-1] + q_rope.shape[-1]),
                "you multiplied by W_UK transposed: w_uk[h] is [dn, r], so the absorbed query is "
                "q_nope @ w_uk[h] ([T, dn] @ [dn, r] -> [T, r]); it then meets the latents as "
                "(q_nope W_UK) cᵀ."),
    ],
    hint="q_lat = einsum('bhtn,hnr->bhtr', q_nope, w_uk) (q_nope W_UK, r wide); scores = "
         "q_lat @ cᵀ + q_rope @ k_ropeᵀ (c and k_rope [B, S, ·] broadcast over the heads with "
         "unsqueeze(1)), divided by √(dn + dr).",
))


# -- mla.interleaved_rope -------------------------------------------------------------------------


def interleaved_rope(x, positions, theta):
    """Reference: RoPE in DeepSeek's interleaved layout. Channels ``2i`` and ``2i + 1`` form a
    pair, rotated by the angle ``t · θ_i`` with ``θ_i = theta^(−2i/D)`` (``i = 0, …, D/2 − 1``)::

        y[2i]     = x[2i] cos − x[2i+1] sin
        y[2i + 1] = x[2i+1] cos + x[2i] sin

    ``x [..., T, D]``, ``positions [T]`` (integers), ``theta`` a float; the result is in the
    input's interleaved layout and dtype. Angles in float64 here (any precision within the
    tolerance passes)."""
    D = x.shape[-1]
    freqs = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # θ_i   [D/2]
    angles = positions.to(torch.float64)[:, None] * freqs  # t θ_i   [T, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def _rotate(x, positions, theta, *, pairs="interleaved", sign=1.0, two=True, layout_out=None):
    D = x.shape[-1]
    i = torch.arange(0, D, 2, dtype=torch.float64) if two else torch.arange(D // 2,
                                                                           dtype=torch.float64)
    freqs = theta ** (-i / D)
    angles = sign * positions.to(torch.float64)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if pairs == "half":
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if layout_out == "deinterleaved":
        return torch.cat((y1, y2), dim=-1)  # transformers' apply_rotary_pos_emb_interleave
    return torch.stack((y1, y2), dim=-1).flatten(-2)


def _rope_cases(gen: torch.Generator) -> list[Case]:
    def case(shape, positions, theta, label, *, dtype=torch.float32):
        x = torch.randn(*shape, generator=gen, dtype=dtype)
        pos = torch.as_tensor(positions, dtype=torch.long)
        return Case((x, pos, theta), label=f"x {list(shape)}, positions {label}, "
                                          f"theta={theta:g}")

    return [
        case((2, 3, 6, 8), range(6), 10000.0, "0..5"),
        case((1, 2, 5, 4), range(37, 42), 10000.0, "37..41 (decoding after a prefill)"),
        case((4, 9, 16), range(9), 100.0, "0..8, a small theta: fast-turning pairs"),
        case((2, 1, 3, 64), [3, 10, 50], 10000.0, "3, 10, 50 (any positions), D = 64"),
        case((1, 2, 7, 6), range(7), 10000.0, "0..6, D = 6: three pairs"),
        case((2, 4, 5, 8), range(20, 25), 10000.0, "20..24, float64: keep the dtype",
             dtype=torch.float64),
    ]


register(Exercise(
    id="mla.interleaved_rope",
    title="DeepSeek's interleaved rotary embedding",
    signature="interleaved_rope(x [..., T, D], positions [T], theta) -> [..., T, D] "
              "(interleaved layout)",
    reference=interleaved_rope,
    make_cases=_rope_cases,
    chapter=13,
    # Angles t·θ_i of up to ~50 rad computed in float32 carry ~4e-6 rad of rounding: a correct
    # answer in float32 angles (transformers' and tinyk3.layers.rope's way) must pass.
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("rotate_half", lambda x, p, th: _rotate(x, p, th, pairs="half"),
                "you paired channel i with i + D/2 (rotate-half, Llama's layout). DeepSeek's "
                "checkpoints pair neighbours: channels 2i and 2i + 1 (x[..., 0::2] with "
                "x[..., 1::2]), both rotated by the angle t·θ_i."),
        Mistake("deinterleaved_output", lambda x, p, th: _rotate(x, p, th,
                                                                layout_out="deinterleaved"),
                "the rotation is right but the output is de-interleaved: evens first, then odds "
                "(torch.cat of the two halves; transformers' apply_rotary_pos_emb_interleave "
                "returns this). Put each rotated pair back in place: torch.stack((y1, y2), "
                "dim=-1).flatten(-2)."),
        Mistake("wrong_direction", lambda x, p, th: _rotate(x, p, th, sign=-1.0),
                "you rotated by −t·θ_i: the pair (a, b) becomes (a cos − b sin, b cos + a sin), "
                "the rotation by +t·θ_i."),
        Mistake("frequencies_without_two", lambda x, p, th: _rotate(x, p, th, two=False),
                "your frequencies are theta^(−i/D) for i = 0..D/2−1: the exponent is −2i/D "
                "(torch.arange(0, D, 2) / D), so the slowest pair turns by theta^(−(D−2)/D) "
                "per token."),
        Mistake("ignored_positions", lambda x, p, th: interleaved_rope(
                    x, torch.arange(x.shape[-2]), th),
                "you rotated token j by j·θ_i (torch.arange(T)) instead of by its position: use "
                "the positions given (after a cache, decoding continues at the cache's "
                "length)."),
    ],
    hint="freqs = theta ** (−torch.arange(0, D, 2) / D); angles = positions[:, None] * freqs "
         "([T, D/2]); x1, x2 = x[..., 0::2], x[..., 1::2]; y1 = x1 cos − x2 sin, "
         "y2 = x2 cos + x1 sin; return torch.stack((y1, y2), dim=-1).flatten(-2) in x's dtype.",
))

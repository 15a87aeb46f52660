"""Chapter 13's exercises against wrong answers written by hand, the way a learner would write
them (independent of the registered Mistake functions), and against correct variants.

Each wrong answer names the registered mistake the checker should recognise, or None where no
registered mistake explains the bug (then the exercise's general hint must be shown).
"""

from __future__ import annotations

import math

import torch

from helpers import right, run, wrong
from tinyk3 import checks
from tinyk3.layers.rope import rope

# -- mla.absorbed_scores ----------------------------------------------------------------------------


def _learner_absorbed(q_nope, q_rope, c, k_rope, w_uk, *, bug=None):
    """A learner's absorbed scores, head by head; `bug` names the one thing done wrong."""
    B, H, T, dn = q_nope.shape
    dr, r = q_rope.shape[-1], c.shape[-1]
    out = []
    for h in range(H):
        w = w_uk[h].T if bug == "transposed" else w_uk[h]  # [dn, r]
        q_lat = q_nope[:, h] @ w  # [B, T, r]
        s = q_lat @ c.transpose(1, 2)  # [B, T, S]
        if bug != "no_rope":
            s = s + q_rope[:, h] @ k_rope.transpose(1, 2)
        out.append(s)
    s = torch.stack(out, dim=1)
    width = {"scale_576": r + dr, "scale_dn": dn, "no_scale": 1}.get(bug, dn + dr)
    s = s / math.sqrt(width)
    if bug == "softmax":
        s = s.softmax(-1)
    return s


@wrong("mla.absorbed_scores", "no_scale")
def as_no_scale(*args):
    return _learner_absorbed(*args, bug="no_scale")


@wrong("mla.absorbed_scores", "scale_absorbed_width")
def as_scale_absorbed_width(*args):
    return _learner_absorbed(*args, bug="scale_576")


@wrong("mla.absorbed_scores", "scale_nope_only")
def as_scale_dn(*args):
    return _learner_absorbed(*args, bug="scale_dn")


@wrong("mla.absorbed_scores", "no_rope")
def as_forgot_rope(*args):
    return _learner_absorbed(*args, bug="no_rope")


@wrong("mla.absorbed_scores", "w_uk_transposed")
def as_transposed(*args):
    return _learner_absorbed(*args, bug="transposed")


@wrong("mla.absorbed_scores")
def as_softmax(*args):
    """Returns the attention weights instead of the scores."""
    return _learner_absorbed(*args, bug="softmax")


@right("mla.absorbed_scores")
def as_ok_naive(q_nope, q_rope, c, k_rope, w_uk):
    """Expand the keys from the latents, then ordinary scores: what absorption avoids."""
    k_nope = torch.einsum("bsr,hnr->bhsn", c, w_uk)  # c W_UKᵀ per head   [B, H, S, dn]
    H = q_nope.shape[1]
    k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, H, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


@right("mla.absorbed_scores")
def as_ok_concat(q_nope, q_rope, c, k_rope, w_uk):
    """The absorbed query and the rope query as one (r + dr)-wide row, against [c, k_rope]."""
    q = torch.cat([q_nope @ w_uk.unsqueeze(0), q_rope], dim=-1)  # [B, H, T, r + dr]
    k = torch.cat([c, k_rope], dim=-1).unsqueeze(1)  # [B, 1, S, r + dr], one key for all heads
    return q @ k.transpose(-1, -2) / math.sqrt(q_nope.shape[-1] + q_rope.shape[-1])


# -- mla.interleaved_rope -----------------------------------------------------------------------


def _learner_rope(x, positions, theta, *, bug=None):
    D = x.shape[-1]
    i = torch.arange(D // 2) if bug == "no_two" else torch.arange(0, D, 2)
    freqs = 1.0 / theta ** (i.float() / D)
    pos = torch.arange(x.shape[-2]) if bug == "positions" else positions
    angles = pos.float()[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if bug == "sign":
        sin = -sin
    if bug == "half":
        a, b = x[..., : D // 2], x[..., D // 2:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ya, yb = a * cos - b * sin, b * cos + a * sin
    if bug in ("half", "cat"):
        return torch.cat([ya, yb], dim=-1)
    y = torch.empty_like(x)
    y[..., 0::2], y[..., 1::2] = ya, yb
    return y


@wrong("mla.interleaved_rope", "rotate_half")
def ir_rotate_half(x, positions, theta):
    return _learner_rope(x, positions, theta, bug="half")


@wrong("mla.interleaved_rope", "deinterleaved_output")
def ir_concatenated(x, positions, theta):
    return _learner_rope(x, positions, theta, bug="cat")


@wrong("mla.interleaved_rope", "wrong_direction")
def ir_negative_angle(x, positions, theta):
    return _learner_rope(x, positions, theta, bug="sign")


@wrong("mla.interleaved_rope", "frequencies_without_two")
def ir_frequencies(x, positions, theta):
    return _learner_rope(x, positions, theta, bug="no_two")


@wrong("mla.interleaved_rope", "ignored_positions")
def ir_arange(x, positions, theta):
    return _learner_rope(x, positions, theta, bug="positions")


@wrong("mla.interleaved_rope")
def ir_growing_frequencies(x, positions, theta):
    """theta^(+2i/D): the pairs turn faster and faster (no registered mistake)."""
    D = x.shape[-1]
    angles = positions.double()[:, None] * theta ** (torch.arange(0, D, 2).double() / D)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


@right("mla.interleaved_rope")
def ir_ok_complex(x, positions, theta):
    """DeepSeek-V3's own inference code: pairs as complex numbers times e^{i t θ}."""
    D = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    rot = torch.polar(torch.ones(len(positions), D // 2, dtype=torch.float64),
                      positions.double()[:, None] * freqs)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2))
    return torch.view_as_real(z * rot).flatten(-2).to(x.dtype)


@right("mla.interleaved_rope")
def ir_ok_lib(x, positions, theta):
    return rope(x, positions, theta=theta, interleaved=True)


@right("mla.interleaved_rope")
def ir_ok_permuted(x, positions, theta):
    """Rotate-half on the de-interleaved channels, then interleave back: the same rotation."""
    D = x.shape[-1]
    perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
    y = rope(x[..., perm], positions, theta=theta, interleaved=False)
    return y[..., torch.argsort(perm)]


# -- the lists --------------------------------------------------------------------------------------


CORRECT = {  # answers made by a factory
    "mla.absorbed_scores": (lambda *a: _learner_absorbed(*a),),
    "mla.interleaved_rope": (lambda x, p, th: _learner_rope(x, p, th),),
}

IDS = ["mla.absorbed_scores", "mla.interleaved_rope"]


def test_every_registered_mistake_is_wrong_on_some_case():
    """No mistake coincides with the reference on every case (else it could never be told
    apart), and each is matched to itself when submitted."""
    for eid in IDS:
        ex = checks.EXERCISES[eid]
        for m in ex.mistakes:
            result = run(eid, m.fn)
            assert not result and result.mistake == m.name, (eid, m.name, result.report)


def test_the_score_cases_cover_dn_equal_r_nope_decoding_and_both_dtypes():
    cases = checks.EXERCISES["mla.absorbed_scores"].cases()
    dn, r = cases[0].args[0].shape[-1], cases[0].args[2].shape[-1]
    assert dn == r  # the transposed W_UK fails by value on the first case, not by a shape error
    assert any(c.args[1].shape[-1] == 0 for c in cases)  # NoPE
    assert any(c.args[0].shape[2] == 1 < c.args[2].shape[1] for c in cases)  # one query, a cache
    assert {c.args[0].dtype for c in cases} == {torch.float32, torch.float64}
    assert run("mla.absorbed_scores", as_transposed).failed_case == 1


def test_the_rope_cases_cover_offset_positions_and_both_dtypes():
    cases = checks.EXERCISES["mla.interleaved_rope"].cases()
    assert any(int(c.args[1][0]) > 0 for c in cases)
    assert {c.args[0].dtype for c in cases} == {torch.float32, torch.float64}
    assert all(c.args[0].shape[-1] % 2 == 0 for c in cases)


def test_the_score_reference_equals_the_expanded_keys_in_float64():
    case = checks.EXERCISES["mla.absorbed_scores"].cases()[-1]
    assert case.args[0].dtype == torch.float64
    ref = checks.EXERCISES["mla.absorbed_scores"].reference(*case.args)
    assert torch.allclose(ref, as_ok_naive(*case.args), atol=1e-12, rtol=0)


def test_the_rope_reference_is_the_libs_and_a_fixed_permutation_of_rotate_half():
    """Interleaved and rotate-half RoPE are the same rotation up to a channel permutation, so
    scores q·k agree while the rotated tensors differ."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 10, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(5, 15)
    ref = checks.EXERCISES["mla.interleaved_rope"].reference
    qi, ki = ref(q, pos, 10000.0), ref(k, pos, 10000.0)
    assert torch.allclose(qi, rope(q, pos, interleaved=True), atol=1e-5)
    assert torch.allclose(qi, ir_ok_permuted(q, pos, 10000.0), atol=1e-5)
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])
    qh, kh = rope(q[..., perm], pos), rope(k[..., perm], pos)
    assert (qh - qi).abs().max() > 0.1  # the tensors differ ...
    assert torch.allclose(qh @ kh.mT, qi @ ki.mT, atol=1e-4)  # ... the scores do not


def test_the_score_reference_gives_the_library_layers_attention():
    """Softmax of the reference scores, then the latents and W_UV: the output of
    MultiHeadLatentAttention.attend on its naive path (keys and values expanded)."""
    from tinyk3.layers.mla import MultiHeadLatentAttention, causal_softmax

    torch.manual_seed(0)
    layer = MultiHeadLatentAttention(32, 3, kv_lora_rank=16, qk_nope_head_dim=8,
                                     qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        q_nope, q_rope = layer.queries(x)
        c, k_rope = layer.latents(x)
        s = checks.EXERCISES["mla.absorbed_scores"].reference(q_nope, q_rope, c, k_rope,
                                                              layer.w_uk())
        o = causal_softmax(s) @ c.unsqueeze(1) @ layer.w_uv()
        o_lib = layer.attend(q_nope, q_rope, c, k_rope, absorb=False)
    assert torch.allclose(o, o_lib, atol=1e-12, rtol=0)

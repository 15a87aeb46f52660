"""Part VI: the derived backward of the three chunked delta rules (chapters 19 and 20).

The reference is autograd through each rule's token loop (``recurrent``), in float64: the loop
is the definition, and autograd differentiates it without any formula of ours. Against it, at
awkward shapes (T not a multiple of C, Dk ≠ Dv, with and without an initial state and a
final-state gradient): the token loop's own adjoint (``recurrent_backward``), the chunked
backward (``chunked_backward``) and ``chunked`` differentiated through it, all within 1e-10.
Then ``gradcheck`` (finite differences) on ``chunked``; float32 against float64 at long T and
at the lower-bound gate (−5 per step); the bytes kept between forward and backward; errors.
Independent oracles (fla's naive chunked forms, transformers' torch forms) are in
``test_fla_oracle.py``, ``test_gated_oracles_fla.py`` and ``test_gated_oracles_hf.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinyk3.grad_memory import saved_bytes
from tinyk3.ops import delta_rule, gated_delta_rule, kda

RULES = {"delta_rule": delta_rule, "gated_delta_rule": gated_delta_rule, "kda": kda}
F64 = 1e-10


def inputs(rule, B, H, T, Dk, Dv, *, seed, dtype=torch.float64, gate=2.0, init=True,
           d_state=True):
    """q, k (unit rows), v, β, [g], and S0, dO, dS (None where asked)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = r(B, H, T, Dk), F.normalize(r(B, H, T, Dk), dim=-1), r(B, H, T, Dv)
    beta = torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    args = [q, k, v, beta]
    if rule == "gated_delta_rule":
        args.append(-gate * torch.rand(B, H, T, generator=gen, dtype=torch.float64))
    elif rule == "kda":
        args.append(-gate * torch.rand(B, H, T, Dk, generator=gen, dtype=torch.float64))
    S0 = r(B, H, Dk, Dv) if init else None
    dO, dS = r(B, H, T, Dv), (r(B, H, Dk, Dv) if d_state else None)
    cast = [a.to(dtype) for a in args]
    return cast, None if S0 is None else S0.to(dtype), dO.to(dtype), \
        None if dS is None else dS.to(dtype)


def autograd_grads(fn, args, S0, dO, dS, **kw):
    """Autograd's gradients of ⟨o, dO⟩ + ⟨S_T, dS⟩ through ``fn``, one per input (+ S0)."""
    leaves = [a.clone().requires_grad_() for a in args]
    init = None if S0 is None else S0.clone().requires_grad_()
    o, S = fn(*leaves, initial_state=init, **kw)
    loss = (o * dO).sum() + (0 if dS is None else (S * dS).sum())
    wrt = leaves + ([] if init is None else [init])
    return list(torch.autograd.grad(loss, wrt))


def dist(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


# (B, H, T, Dk, Dv, C, initial state, final-state gradient)
SHAPES = [(1, 2, 37, 8, 5, 8, True, True), (2, 1, 16, 4, 6, 16, False, False),
          (1, 1, 5, 3, 3, 8, True, False), (1, 2, 70, 6, 4, 16, False, True),
          (1, 1, 1, 4, 4, 64, True, True)]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) +
                         ("-S0" if s[6] else "") + ("-dS" if s[7] else ""))
def test_backward_equals_autograd_through_the_token_loop_float64(rule, shape):
    B, H, T, Dk, Dv, C, init, ds = shape
    mod = RULES[rule]
    args, S0, dO, dS = inputs(rule, B, H, T, Dk, Dv, seed=T + C, init=init, d_state=ds)
    ref = autograd_grads(mod.recurrent, args, S0, dO, dS)
    loop = mod.recurrent_backward(*args, dO, dS, initial_state=S0)
    chunk = mod.chunked_backward(*args, dO, dS, chunk_size=C, initial_state=S0)
    through = autograd_grads(mod.chunked, args, S0, dO, dS, chunk_size=C)
    assert (loop.d_initial_state is None) == (chunk.d_initial_state is None) == (S0 is None)
    got = {"recurrent_backward": [g for g in loop if g is not None],
           "chunked_backward": [g for g in chunk if g is not None],
           "chunked (derived)": through}
    for name, grads in got.items():
        assert len(grads) == len(ref), name
        for field, a, b in zip(loop._fields, grads, ref):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, field)
            assert dist(a, b) < F64, f"{rule} {name} {field}: {dist(a, b):.1e}"


@pytest.mark.parametrize("rule", ["gated_delta_rule", "kda"])
def test_strong_gates_and_the_exact_diagonal_path_float64(rule):
    """Gates far below the lower bound (−20 per step): KDA's diagonal blocks go pair by pair."""
    mod = RULES[rule]
    args, S0, dO, dS = inputs(rule, 1, 2, 50, 8, 8, seed=3, gate=20.0)
    ref = autograd_grads(mod.recurrent, args, S0, dO, dS)
    got = mod.chunked_backward(*args, dO, dS, chunk_size=32, initial_state=S0)
    for field, a, b in zip(got._fields, got, ref):
        assert dist(a, b) < F64, f"{rule} {field}: {dist(a, b):.1e}"


@pytest.mark.parametrize("rule", RULES)
def test_gradcheck_of_chunked(rule):
    """Finite differences against the derived backward, every input at once (T = 7, C = 4)."""
    args, S0, _, _ = inputs(rule, 1, 1, 7, 3, 2, seed=11)
    leaves = [a.clone().requires_grad_() for a in args] + [S0.clone().requires_grad_()]

    def f(*xs):
        return RULES[rule].chunked(*xs[:-1], chunk_size=4, initial_state=xs[-1])

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7)


def test_only_the_state_or_only_the_output_used():
    args, S0, dO, dS = inputs("delta_rule", 1, 2, 20, 4, 4, seed=5)
    leaves = [a.clone().requires_grad_() for a in args]
    _, S = delta_rule.chunked(*leaves, chunk_size=8, initial_state=S0)
    got = torch.autograd.grad((S * dS).sum(), leaves)
    ref = delta_rule.chunked_backward(*args, torch.zeros_like(dO), dS, chunk_size=8,
                                      initial_state=S0)
    assert all(dist(a, b) < F64 for a, b in zip(got, ref))
    o, _ = delta_rule.chunked(*leaves, chunk_size=8)
    got = torch.autograd.grad((o * dO).sum(), leaves)
    ref = delta_rule.chunked_backward(*args, dO, chunk_size=8)
    assert all(dist(a, b) < F64 for a, b in zip(got, ref))


def test_bfloat16_inputs_get_bfloat16_gradients():
    args, S0, dO, _ = inputs("kda", 1, 1, 24, 8, 8, seed=6, dtype=torch.bfloat16)
    leaves = [a.clone().requires_grad_() for a in args]
    o, _ = kda.chunked(*leaves, chunk_size=16)
    grads = torch.autograd.grad((o.float() * dO.float()).sum(), leaves)
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


# float32 against float64, the same computation: the derived backward's error next to autograd's
# (through the PyTorch chunked form, in float32), relative Frobenius distance per gradient.
# Measured on this machine: delta rule at T 8192 ≤ 4.2e-7 (autograd ≤ 3.9e-7); at gates of −5
# per step (KDA: −5 or 0 per channel), Gated DeltaNet ≤ 3.7e-7 (autograd's dg: 3.4e-5, the
# rounding of the diagonal's cancelling shares), KDA ≤ 4.4e-7 (autograd ≤ 3.5e-7). Bound: 1e-5.
F32 = 1e-5


def frob(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("rule,T,D", [("delta_rule", 8192, 16), ("gated_delta_rule", 1024, 32),
                                      ("kda", 1024, 32)])
def test_float32_at_long_context_and_the_lower_bound_gate(rule, T, D):
    mod = RULES[rule]
    args, S0, dO, dS = inputs(rule, 1, 1, T, D, D, seed=T)
    if rule == "gated_delta_rule":
        args[4] = torch.full_like(args[4], -5.0)
    if rule == "kda":  # channels at the lower bound and channels that keep everything
        args[4] = -5.0 * (torch.arange(D) % 2).to(args[4]).expand_as(args[4]).clone()
    ref = mod.chunked_backward(*args, dO, dS, chunk_size=64, initial_state=S0)
    got = mod.chunked_backward(*[a.float() for a in args], dO.float(), dS.float(),
                               chunk_size=64, initial_state=S0.float())
    for field, a, b in zip(got._fields, got, ref):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        assert frob(a, b) < F32, f"{rule} {field}: {frob(a, b):.1e}"


@pytest.mark.parametrize("rule", ["gated_delta_rule", "kda"])
def test_the_diagonal_pairs_give_the_gate_no_gradient(rule):
    """One token from a zero state: its gate decays nothing, so ∂L/∂g is exactly 0. The only
    pair is the diagonal one, whose decay e^{G_i − G_i} = 1 has no gradient; computed through
    the factored paths its two shares would cancel only up to rounding (attention-gym PR 461).
    In float32, at the lower-bound gate, and in a chunk where every other token is zero."""
    mod = RULES[rule]
    for T in (1, 16):
        args, _, dO, _ = inputs(rule, 2, 2, T, 16, 8, seed=T, dtype=torch.float32, init=False)
        args[4] = torch.full_like(args[4], -5.0)
        if T > 1:  # only the last token is non-zero: still no pair j < i carries anything
            for x in args[:3]:
                x[:, :, :-1] = 0
        got = mod.chunked_backward(*args, dO, chunk_size=16)
        assert torch.equal(got.dg[:, :, -1], torch.zeros_like(got.dg[:, :, -1])), rule
        ref = autograd_grads(mod.recurrent, [a.double() for a in args], None, dO.double(), None)
        assert dist(got.dq.double(), ref[0]) < 1e-6  # the diagonal's share of dq is there


@pytest.mark.parametrize("rule", RULES)
def test_derived_backward_keeps_at_most_a_quarter_of_autograds_bytes(rule):
    """B 1, H 4, T 4096, D 64, C 64, float32: what autograd keeps beyond the inputs' storages."""
    args, _, _, _ = inputs(rule, 1, 4, 4096, 64, 64, seed=0, dtype=torch.float32, init=False,
                           d_state=False)
    leaves = [a.requires_grad_() for a in args]
    kept = {mode: saved_bytes(lambda *xs, m=mode: RULES[rule].chunked(
        *xs, chunk_size=64, backward=m), *leaves) for mode in ("derived", "autograd")}
    # the derived backward keeps the boundary states only: 64 chunks × 64 × 64 floats × 4 heads
    assert kept["derived"].bytes == 64 * 64 * 64 * 4 * 4
    assert kept["derived"].bytes <= kept["autograd"].bytes / 4, kept


def test_clear_errors():
    args, S0, dO, dS = inputs("gated_delta_rule", 1, 2, 9, 4, 3, seed=1)
    with pytest.raises(ValueError, match="backward must be one of"):
        gated_delta_rule.chunked(*args, backward="manual")
    with pytest.raises(ValueError, match="d_o must have shape"):
        gated_delta_rule.chunked_backward(*args, dO[:, :, :-1])
    with pytest.raises(ValueError, match="d_state must have shape"):
        gated_delta_rule.chunked_backward(*args, dO, dS[..., :-1])
    with pytest.raises(TypeError, match="d_o must be a floating-point"):
        delta_rule.chunked_backward(*args[:4], dO.long())
    with pytest.raises(ValueError, match="chunk_size"):
        kda.chunked_backward(*inputs("kda", 1, 1, 4, 2, 2, seed=0)[0], dO[:1, :1, :4, :2],
                             chunk_size=0)


def test_the_chapters_loss_helpers():
    """grad_memory.cotangents and autograd_grads (the loss chapters 19 and 20 differentiate)
    against the derived backward; step_bytes of a small language model, both backward passes."""
    from tinyk3 import layers, models
    from tinyk3.grad_memory import autograd_grads as grads_of
    from tinyk3.grad_memory import cotangents, step_bytes

    args, _, _, _ = inputs("kda", 1, 2, 20, 4, 3, seed=8)
    dO, dS = cotangents(1, 2, 20, 4, 3, seed=9)
    assert dO.shape == (1, 2, 20, 3) and dS.shape == (1, 2, 4, 3) and dO.dtype == torch.float64
    got = kda.chunked_backward(*args, dO, dS, chunk_size=8)
    for a, b in zip(got, grads_of(kda.recurrent, args, dO, dS)):
        assert dist(a, b) < F64
    mixer = layers.DeltaNetConfig(n_head=2, form="chunked", chunk_size=16)
    model = models.LM(models.LMConfig(vocab_size=32, block_size=64, n_embd=16,
                                      pattern=("d",), mixers={"d": mixer}, pos_emb=False))
    kept = {m: step_bytes(model, 64, m) for m in ("autograd", "derived")}
    assert 0 < kept["derived"] < kept["autograd"]

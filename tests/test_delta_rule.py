"""tinyk3.ops.delta_rule: the token loop agrees with a reference written here in the papers'
layout, is one gradient-descent step per token, carries its state across calls, and misuse
fails clearly.

fla's own reference code is a second, external oracle: tests/test_fla_oracle.py.

Reference (independent of the lib): numpy float64, ``S ∈ R^{Dv×Dk}``,
``S_t = S_{t-1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ``, ``o_t = S_t q_t`` (state after the update).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import OP_DTYPE_IDS, OP_DTYPES, OP_SHAPE_IDS, OP_SHAPES, OP_TOL
from tinyk3.ops import delta_rule

TOL, DTYPES, DTYPE_IDS = OP_TOL, OP_DTYPES, OP_DTYPE_IDS
SHAPES, SHAPE_IDS = OP_SHAPES, OP_SHAPE_IDS

# Every form keeps the same contract: the token loop and the one-block triangular solve.
FORMS = [delta_rule.recurrent, delta_rule.parallel]
FORM_IDS = ["recurrent", "parallel"]


def _inputs(B, H, T, Dk, Dv, dtype, *, unit_keys=True, seed=0):
    """q, k, v, beta ∈ (0, 1) and a non-zero initial state. Un-normalised keys get random norms
    in (0.5, 1.4) (so ‖k‖² up to ≈2: the transition may flip sign but does not blow up)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=dtype)
    k = torch.randn(B, H, T, Dk, generator=g, dtype=dtype)
    k = k / k.norm(dim=-1, keepdim=True)
    if not unit_keys:
        k = k * (0.5 + 0.9 * torch.rand(B, H, T, 1, generator=g, dtype=dtype))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    beta = torch.rand(B, H, T, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=dtype)
    return q, k, v, beta, S0


def _np_reference(q, k, v, beta, S0=None):
    """numpy float64 in the papers' layout. Returns o and the final state in OUR layout."""
    q, k, v, beta = (t.detach().double().numpy() for t in (q, k, v, beta))
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    o = np.zeros((B, H, T, Dv))
    S_out = np.zeros((B, H, Dk, Dv))
    eye = np.eye(Dk)
    for b in range(B):
        for h in range(H):
            S = np.zeros((Dv, Dk)) if S0 is None else S0[b, h].detach().double().numpy().T.copy()
            for t in range(T):
                kt, bt = k[b, h, t], beta[b, h, t]
                S = S @ (eye - bt * np.outer(kt, kt)) + bt * np.outer(v[b, h, t], kt)
                o[b, h, t] = S @ q[b, h, t]
            S_out[b, h] = S.T
    return torch.from_numpy(o), torch.from_numpy(S_out)


def _rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


# -- against the reference ----------------------------------------------------------------------

@pytest.mark.parametrize("unit_keys", [True, False], ids=["l2-keys", "raw-keys"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_agrees_with_numpy_reference(form, shape, dtype, with_state, unit_keys):
    B, H, T, Dk, Dv = shape
    q, k, v, beta, S0 = _inputs(*shape, dtype, unit_keys=unit_keys)
    init = S0 if with_state else None
    o, S = form(q, k, v, beta, initial_state=init)
    assert o.shape == (B, H, T, Dv) and o.dtype == dtype
    assert S.shape == (B, H, Dk, Dv) and S.dtype == torch.promote_types(dtype, torch.float32)
    ref_o, ref_S = _np_reference(q, k, v, beta, init)
    assert _rel_err(o, ref_o) <= TOL[dtype], f"o: {_rel_err(o, ref_o):.3g}"
    assert _rel_err(S, ref_S) <= TOL[dtype], f"S: {_rel_err(S, ref_S):.3g}"


def test_reference_is_not_plain_linear_attention():
    """Guard for the test itself: with β ∈ (0, 1) the delta rule differs from S += kᵀv."""
    q, k, v, beta, _ = _inputs(1, 2, 8, 4, 4, torch.float64, seed=1)
    o, S = delta_rule.recurrent(q, k, v, beta)
    additive = (k.unsqueeze(-1) * (beta[..., None] * v).unsqueeze(-2)).cumsum(2)  # Σ β_j k_jᵀ v_j
    assert _rel_err(o, torch.einsum("bhtk,bhtkv->bhtv", q, additive)) > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_half_precision_accumulates_in_float32(form, dtype):
    q, k, v, beta, S0 = _inputs(1, 2, 12, 8, 8, dtype, seed=2)
    o, S = form(q, k, v, beta, initial_state=S0)
    assert o.dtype == dtype and S.dtype == torch.float32
    ref_o, ref_S = _np_reference(q, k, v, beta, S0)
    assert _rel_err(o, ref_o) <= 1e-2  # one rounding of o to 8 (bf16) or 11 (f16) bits
    assert _rel_err(S, ref_S) <= 1e-5  # the state never leaves float32


# -- states -------------------------------------------------------------------------------------

def test_split_anywhere_equals_one_pass():
    T = 9
    q, k, v, beta, S0 = _inputs(2, 2, T, 4, 3, torch.float64, seed=3)
    ref_o, ref_S = delta_rule.recurrent(q, k, v, beta, initial_state=S0)
    for t0 in range(T + 1):
        o1, mid = delta_rule.recurrent(q[:, :, :t0], k[:, :, :t0], v[:, :, :t0], beta[:, :, :t0],
                                       initial_state=S0)
        o2, S = delta_rule.recurrent(q[:, :, t0:], k[:, :, t0:], v[:, :, t0:], beta[:, :, t0:],
                                     initial_state=mid)
        assert _rel_err(torch.cat([o1, o2], dim=2), ref_o) <= 1e-12, f"split at {t0}"
        assert _rel_err(S, ref_S) <= 1e-12, f"split at {t0}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decoding_one_token_at_a_time(dtype):
    q, k, v, beta, _ = _inputs(2, 3, 10, 5, 4, dtype, seed=4)
    ref_o, ref_S = delta_rule.recurrent(q, k, v, beta)
    S, outs = None, []
    for t in range(10):
        o_t, S = delta_rule.recurrent(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                      beta[:, :, t:t + 1], initial_state=S)
        outs.append(o_t)
    assert _rel_err(torch.cat(outs, dim=2), ref_o) <= TOL[dtype]
    assert _rel_err(S, ref_S) <= TOL[dtype]


def test_empty_sequence_passes_the_state_through():
    q, k, v, beta, S0 = _inputs(2, 2, 0, 3, 4, torch.float64)
    o, S = delta_rule.recurrent(q, k, v, beta, initial_state=S0)
    assert o.shape == (2, 2, 0, 4) and o.dtype == torch.float64
    assert torch.equal(S, S0)
    _, S = delta_rule.recurrent(q, k, v, beta)
    assert torch.equal(S, torch.zeros(2, 2, 3, 4, dtype=torch.float64))


def test_pure_function_inputs_untouched():
    ins = _inputs(1, 2, 5, 3, 4, torch.float64, seed=5)
    before = [t.clone() for t in ins]
    q, k, v, beta, S0 = ins
    delta_rule.recurrent(q, k, v, beta, initial_state=S0)
    for t, b in zip(ins, before):
        assert torch.equal(t, b)


# -- what the update means ----------------------------------------------------------------------

def test_one_step_is_one_gradient_descent_step():
    """S_1 = S_0 − β ∇_S ½‖k S − v‖² at S_0 (autograd), for unit-norm k."""
    q, k, v, beta, S0 = _inputs(2, 3, 1, 6, 4, torch.float64, seed=6)
    _, S1 = delta_rule.recurrent(q, k, v, beta, initial_state=S0)
    S = S0.clone().requires_grad_()
    loss = 0.5 * (torch.einsum("bhk,bhkv->bhv", k[:, :, 0], S) - v[:, :, 0]).square().sum()
    (grad,) = torch.autograd.grad(loss, S)  # heads are independent: one loss for all is fine
    assert _rel_err(S1, S0 - beta[:, :, 0, None, None] * grad) <= 1e-12
    assert _rel_err(S1, S0) > 1e-3  # and the step moved the state


def test_beta_zero_leaves_the_state_unchanged():
    q, k, v, _, S0 = _inputs(2, 2, 6, 4, 5, torch.float64, seed=7)
    o, S = delta_rule.recurrent(q, k, v, torch.zeros(2, 2, 6, dtype=torch.float64), initial_state=S0)
    assert torch.equal(S, S0)
    assert _rel_err(o, q @ S0) <= 1e-12  # o_t = q_t S_0


def test_beta_one_with_unit_keys_overwrites():
    """β = 1, ‖k_t‖ = 1: reading at k_t right after the write returns v_t exactly, whatever the
    state held (q = k makes o_t = k_t S_t that read)."""
    q, k, v, _, S0 = _inputs(2, 2, 12, 4, 3, torch.float64, seed=8)  # T > Dk: keys overlap
    ones = torch.ones(2, 2, 12, dtype=torch.float64)
    o, S = delta_rule.recurrent(k, k, v, ones, initial_state=S0)
    assert _rel_err(o, v) <= 1e-12
    assert _rel_err(torch.einsum("bhk,bhkv->bhv", k[:, :, -1], S), v[:, :, -1]) <= 1e-12
    # with β < 1 the write is partial: the read is between old and new, not v
    o_half, _ = delta_rule.recurrent(k, k, v, 0.5 * ones, initial_state=S0)
    assert _rel_err(o_half, v) > 1e-2


def test_orthonormal_keys_are_recalled_exactly():
    """Dk orthonormal keys written once with β = 1 from S = 0: reading each key returns its value."""
    D = 6
    g = torch.Generator().manual_seed(9)
    Qm, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    k = Qm.T.reshape(1, 1, D, D)  # rows are orthonormal keys
    v = torch.randn(1, 1, D, 3, generator=g, dtype=torch.float64)
    _, S = delta_rule.recurrent(k, k, v, torch.ones(1, 1, D, dtype=torch.float64))
    assert _rel_err(k @ S, v) <= 1e-12


@pytest.mark.parametrize("b", [0.25, 0.7, 1.0])
def test_transition_eigenvalues(b):
    """With v = 0 one step maps S_0 = I to A = I − β kᵀk: eigenvalues 1 (D−1 times) and 1 − β,
    the eigenvector of 1 − β being k (unit k)."""
    D = 5
    q, k, _, _, _ = _inputs(1, 1, 1, D, D, torch.float64, seed=10)
    eye = torch.eye(D, dtype=torch.float64).reshape(1, 1, D, D)
    _, A = delta_rule.recurrent(q, k, torch.zeros(1, 1, 1, D, dtype=torch.float64),
                                torch.full((1, 1, 1), b, dtype=torch.float64), initial_state=eye)
    A = A[0, 0]
    assert _rel_err(A, A.T) <= 1e-15  # symmetric
    ev = torch.linalg.eigvalsh(A)  # ascending
    expected = torch.tensor([1.0 - b] + [1.0] * (D - 1), dtype=torch.float64)
    assert _rel_err(ev, expected) <= 1e-12
    k0 = k[0, 0, 0]
    assert _rel_err(k0 @ A, (1.0 - b) * k0) <= 1e-12


# -- gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_gradcheck(form):
    ins = tuple(t.requires_grad_() for t in _inputs(1, 2, 3, 3, 2, torch.float64, unit_keys=False,
                                                    seed=11))

    def fn(q, k, v, beta, S0):
        return form(q, k, v, beta, initial_state=S0)

    assert torch.autograd.gradcheck(fn, ins, eps=1e-6, atol=1e-7)


def test_parallel_and_recurrent_have_equal_gradients():
    grads = []
    for form in FORMS:
        ins = [t.clone().requires_grad_() for t in _inputs(2, 2, 12, 4, 3, torch.float64, seed=13)]
        o, S = form(*ins[:4], initial_state=ins[4])
        (o.square().sum() + S.sin().sum()).backward()
        grads.append([t.grad for t in ins])
    for a, b in zip(*grads):
        assert _rel_err(a, b) <= 1e-11


def test_parallel_continues_from_a_recurrent_prefill():
    q, k, v, beta, S0 = _inputs(1, 2, 20, 5, 4, torch.float64, seed=14)
    o_all, S_all = delta_rule.recurrent(q, k, v, beta, initial_state=S0)
    o1, S1 = delta_rule.recurrent(q[:, :, :8], k[:, :, :8], v[:, :, :8], beta[:, :, :8],
                                  initial_state=S0)
    o2, S2 = delta_rule.parallel(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], beta[:, :, 8:],
                                 initial_state=S1)
    assert _rel_err(torch.cat([o1, o2], 2), o_all) <= 1e-12 and _rel_err(S2, S_all) <= 1e-12


# -- misuse -------------------------------------------------------------------------------------

def _bad_inputs():
    f64 = torch.float64
    q, k, v, beta, S0 = _inputs(2, 2, 4, 3, 5, torch.float32)
    meta = torch.device("meta")
    return [
        # (id, args, kwargs, exception, message pattern)
        ("3-D q", (q[0], k, v, beta), {}, ValueError, r"q must have shape \[B, H, T, D\]"),
        ("k head size", (q, k[..., :2], v, beta), {}, ValueError, r"expected q, k \[B, H, T, Dk\]"),
        ("v length", (q, k, v[:, :, :3], beta), {}, ValueError, r"v \[B, H, T, Dv\]"),
        ("int k", (q, k.int(), v, beta), {}, TypeError, "k must be a floating-point tensor"),
        ("mixed dtypes", (q, k, v.to(f64), beta), {}, TypeError, "share a dtype"),
        ("v on meta", (q, k, v.to(meta), beta), {}, ValueError, "one device"),
        ("beta [B, H, T, 1]", (q, k, v, beta[..., None]), {}, ValueError,
         r"beta must have shape \[B, H, T\] = \[2, 2, 4\], got \[2, 2, 4, 1\]"),
        ("beta too short", (q, k, v, beta[:, :, :3]), {}, ValueError, r"got \[2, 2, 3\]"),
        ("beta per head only", (q, k, v, beta[:, :, 0]), {}, ValueError, r"beta must have shape"),
        ("beta float64", (q, k, v, beta.to(f64)), {}, TypeError,
         r"beta must have the dtype of q, k, v \(torch.float32\), got torch.float64"),
        ("int beta", (q, k, v, (beta > 0.5).long()), {}, TypeError, "beta must have the dtype"),
        ("float beta", (q, k, v, 0.5), {}, TypeError, r"beta must be a torch.Tensor \[B, H, T\], got float"),
        ("beta on meta", (q, k, v, beta.to(meta)), {}, ValueError, "beta is on meta, the inputs on cpu"),
        ("state shape", (q, k, v, beta), {"initial_state": S0[..., :4]}, ValueError,
         r"initial_state must have shape \[2, 2, 3, 5\], got \[2, 2, 3, 4\]"),
        ("state transposed", (q, k, v, beta), {"initial_state": S0.transpose(-1, -2)}, ValueError,
         r"initial_state must have shape \[2, 2, 3, 5\]"),
        ("int state", (q, k, v, beta), {"initial_state": S0.long()}, TypeError,
         "initial_state must be a floating-point tensor"),
        ("state on meta", (q, k, v, beta), {"initial_state": S0.to(meta)}, ValueError,
         "initial_state is on meta, the inputs on cpu"),
        ("pair state", (q, k, v, beta), {"initial_state": (S0, S0)}, TypeError,
         "initial_state must be a torch.Tensor, got tuple"),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_bad_inputs_raise_clear_errors(form, case):
    _, args, kwargs, exc, pattern = case
    with pytest.raises(exc, match=pattern) as info:
        form(*args, **kwargs)
    assert str(info.value).startswith(f"delta_rule.{form.__name__}: ")  # says which operator


def test_initial_state_is_keyword_only():
    q, k, v, beta, S0 = _inputs(1, 1, 2, 2, 2, torch.float64)
    with pytest.raises(TypeError):
        delta_rule.recurrent(q, k, v, beta, S0)


# -- the chunked form (chapter 8) ----------------------------------------------------------------

CHUNKS = [1, 3, 4, 64]


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_chunked_agrees_with_numpy_reference(shape, dtype, chunk_size):
    """Non-zero initial state, raw key norms, T not a multiple of the chunk size (T = 7, 9, 16)."""
    q, k, v, beta, S0 = _inputs(*shape, dtype, unit_keys=False, seed=21)
    o, S = delta_rule.chunked(q, k, v, beta, chunk_size=chunk_size, initial_state=S0)
    assert o.shape == shape[:3] + (shape[4],) and o.dtype == dtype
    ref_o, ref_S = _np_reference(q, k, v, beta, S0)
    assert _rel_err(o, ref_o) <= TOL[dtype] and _rel_err(S, ref_S) <= TOL[dtype]


def test_chunked_float32_at_8192_tokens_within_stated_bound():
    """Stated bound: float32 chunked (C = 64) vs float64 recurrent, unit q and k, unit-variance
    v, T = 8192: max abs error <= 1e-5 on o and S (measured 1.8e-6 and 9e-7)."""
    g = torch.Generator().manual_seed(8192)
    B, H, T, D = 1, 2, 8192, 32
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = torch.rand(B, H, T, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, D, D, generator=g, dtype=torch.float64) * 0.1
    ref_o, ref_S = delta_rule.chunked(q, k, v, beta, chunk_size=64, initial_state=S0)  # float64
    o, S = delta_rule.chunked(*(t.float() for t in (q, k, v, beta)), chunk_size=64, initial_state=S0.float())
    assert (o.double() - ref_o).abs().max().item() <= 1e-5
    assert (S.double() - ref_S).abs().max().item() <= 1e-5
    # and the float64 chunked form is the recurrence to round-off (here, not only on short T)
    ref_o2, ref_S2 = delta_rule.recurrent(q[:, :, :1000], k[:, :, :1000], v[:, :, :1000], beta[:, :, :1000],
                                          initial_state=S0)
    o2, S2 = delta_rule.chunked(q[:, :, :1000], k[:, :, :1000], v[:, :, :1000], beta[:, :, :1000],
                                chunk_size=64, initial_state=S0)
    assert _rel_err(o2, ref_o2) <= 1e-12 and _rel_err(S2, ref_S2) <= 1e-12


def test_chunked_gradcheck_with_a_short_last_chunk():
    ins = tuple(t.requires_grad_() for t in _inputs(1, 2, 5, 3, 2, torch.float64, unit_keys=False, seed=22))

    def fn(q, k, v, beta, S0):
        return delta_rule.chunked(q, k, v, beta, chunk_size=2, initial_state=S0)

    assert torch.autograd.gradcheck(fn, ins, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, None])
def test_chunked_refuses_a_bad_chunk_size(bad):
    q, k, v, beta, _ = _inputs(1, 1, 4, 2, 2, torch.float32)
    with pytest.raises(ValueError, match="delta_rule.chunked: chunk_size must be a positive int"):
        delta_rule.chunked(q, k, v, beta, chunk_size=bad)


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_chunked_bad_inputs_raise_clear_errors(case):
    _, args, kwargs, exc, pattern = case
    with pytest.raises(exc, match=pattern) as info:
        delta_rule.chunked(*args, **kwargs)
    assert str(info.value).startswith("delta_rule.chunked: ")


def test_wy_stage_is_the_wy_factors_of_chapter_7():
    """delta_rule.wy_stage (stage 1 of chunked) equals tinyk3.ops.wy.wy_factors chunk by chunk."""
    from tinyk3.ops import wy

    _, k, v, beta, _ = _inputs(2, 3, 6, 5, 4, torch.float64, seed=11)
    W, U = delta_rule.wy_stage(k, v, beta.unsqueeze(-1))  # one chunk of 6 per head
    W_ref, U_ref = wy.wy_factors(k, v, beta)
    assert (W - W_ref).abs().max().item() <= 1e-13
    assert (U - U_ref).abs().max().item() <= 1e-13


@pytest.mark.parametrize("C", [1, 3, 4])
def test_state_pass_records_the_recurrent_states_at_chunk_starts(C):
    """state_pass (stage 3): S_[c] is the recurrence's state after the tokens before chunk c,
    U'_[c] = U_[c] − W_[c] S_[c], and the last state is the recurrence's final state."""
    B, H, T, Dk, Dv = 1, 2, 12, 4, 3
    _, k, v, beta, S0 = _inputs(B, H, T, Dk, Dv, torch.float64, seed=12)
    N = T // C
    K, V, b = (x.reshape(B * H, N, C, *x.shape[3:]) for x in (k, v, beta.unsqueeze(-1)))
    W, U = delta_rule.wy_stage(K, V, b)
    S_all, U_new, S_N = delta_rule.state_pass(W, U, K.mT, S0.reshape(B * H, Dk, Dv))
    assert S_all.shape == (B * H, N, Dk, Dv) and U_new.shape == (B * H, N, C, Dv)
    for c in range(N):
        q0 = torch.zeros(B, H, c * C, Dk, dtype=k.dtype)
        _, S_c = delta_rule.recurrent(q0, k[:, :, : c * C], v[:, :, : c * C], beta[:, :, : c * C],
                                      initial_state=S0)
        assert (S_all[:, c] - S_c.reshape(B * H, Dk, Dv)).abs().max().item() <= 1e-12
        assert (U_new[:, c] - (U[:, c] - W[:, c] @ S_all[:, c])).abs().max().item() <= 1e-12
    _, S_T = delta_rule.recurrent(torch.zeros_like(k), k, v, beta, initial_state=S0)
    assert (S_N - S_T.reshape(B * H, Dk, Dv)).abs().max().item() <= 1e-12

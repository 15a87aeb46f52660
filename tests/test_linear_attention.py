"""tinyk3.ops.linear_attention: the recurrent and parallel forms agree with each other and with
references written here, states carry a sequence across calls, and misuse fails clearly.

References (independent of the lib):
* ``_np_reference``: numpy float64 in the papers' transposed layout, ``S ∈ R^{Dv×Dk}``,
  ``S_t = S_{t-1} + v_t k_tᵀ``, ``z_t = z_{t-1} + k_t``, ``o_t = S_t q_t / (q_tᵀ z_t + eps)``;
* ``_double_sum``: the explicit causal sum ``o_t = Σ_{j≤t} (q_t·k_j) v_j / Σ_{j≤t} q_t·k_j``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import OP_DTYPE_IDS, OP_DTYPES, OP_SHAPE_IDS, OP_SHAPES, OP_TOL
from tinyk3.ops import chunks, feature_maps, linear_attention


def _chunked(C):
    """linear_attention.chunked at chunk size C, with the other forms' signature."""
    def form(q, k, v, **kw):
        return linear_attention.chunked(q, k, v, chunk_size=C, **kw)
    form.op_name = "chunked"
    return form


# Chunk sizes 1 (the recurrence), 3 (T = 7, 9, 16 are not multiples) and 64 (one chunk).
FORMS = [linear_attention.recurrent, linear_attention.parallel, _chunked(1), _chunked(3), _chunked(64)]
FORM_IDS = ["recurrent", "parallel", "chunked1", "chunked3", "chunked64"]

TOL, DTYPES, DTYPE_IDS = OP_TOL, OP_DTYPES, OP_DTYPE_IDS
SHAPES, SHAPE_IDS = OP_SHAPES, OP_SHAPE_IDS


def _inputs(B, H, T, Dk, Dv, dtype, *, positive, seed=0):
    """q, k, v and a non-zero initial state. ``positive``: q, k, z in (0.05, 1.05), as feature
    maps give, so the normaliser ``q·z`` stays away from 0."""
    g = torch.Generator().manual_seed(seed)
    if positive:
        q = torch.rand(B, H, T, Dk, generator=g, dtype=dtype) + 0.05
        k = torch.rand(B, H, T, Dk, generator=g, dtype=dtype) + 0.05
    else:
        q = torch.randn(B, H, T, Dk, generator=g, dtype=dtype)
        k = torch.randn(B, H, T, Dk, generator=g, dtype=dtype)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=dtype)
    z0 = torch.rand(B, H, Dk, generator=g, dtype=dtype) + 0.5
    return q, k, v, S0, z0


def _np_reference(q, k, v, S0=None, z0=None, *, normalize=False, eps=1e-6):
    """numpy float64, papers' layout (S ∈ R^{Dv×Dk}, o = S q). Returns o and S, z in OUR layout."""
    q, k, v = (np.asarray(t.detach().double().numpy()) for t in (q, k, v))
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    o = np.zeros((B, H, T, Dv))
    S_out = np.zeros((B, H, Dk, Dv))
    z_out = np.zeros((B, H, Dk))
    for b in range(B):
        for h in range(H):
            S = np.zeros((Dv, Dk)) if S0 is None else S0[b, h].detach().double().numpy().T.copy()
            z = np.zeros(Dk) if z0 is None else z0[b, h].detach().double().numpy().copy()
            for t in range(T):
                S = S + np.outer(v[b, h, t], k[b, h, t])
                z = z + k[b, h, t]
                o[b, h, t] = S @ q[b, h, t]
                if normalize:
                    o[b, h, t] /= q[b, h, t] @ z + eps
            S_out[b, h] = S.T
            z_out[b, h] = z
    return torch.from_numpy(o), torch.from_numpy(S_out), torch.from_numpy(z_out)


def _double_sum(q, k, v, *, normalize):
    """Explicit weights, position by position, no state: o_t = Σ_{j≤t} (q_t·k_j) v_j [/ Σ_j q_t·k_j]."""
    B, H, T, _ = q.shape
    o = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        w = (q[:, :, t, None, :].double() * k[:, :, : t + 1].double()).sum(-1)  # [B, H, t+1]
        o[:, :, t] = (w[..., None] * v[:, :, : t + 1].double()).sum(2)
        if normalize:
            o[:, :, t] /= w.sum(-1, keepdim=True)
    return o


def _rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _state(S0, z0, normalize):
    return (S0, z0) if normalize else S0


def _split_state(state, normalize):
    if normalize:
        assert isinstance(state, tuple) and len(state) == 2
        return state
    assert isinstance(state, torch.Tensor)
    return state, None


# -- the two forms against the references ------------------------------------------------------

@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_forms_agree_with_numpy_reference(shape, dtype, with_state, normalize):
    B, H, T, Dk, Dv = shape
    q, k, v, S0, z0 = _inputs(*shape, dtype, positive=normalize)
    init = _state(S0, z0, normalize) if with_state else None
    ref_o, ref_S, ref_z = _np_reference(
        q, k, v, S0 if with_state else None, z0 if with_state else None, normalize=normalize
    )
    acc = torch.promote_types(dtype, torch.float32)
    results = {}
    for form, name in zip(FORMS, FORM_IDS):
        o, state = form(q, k, v, normalize=normalize, initial_state=init)
        S, z = _split_state(state, normalize)
        assert o.shape == (B, H, T, Dv) and o.dtype == dtype, name
        assert S.shape == (B, H, Dk, Dv) and S.dtype == acc, name
        assert _rel_err(o, ref_o) <= TOL[dtype], f"{name} o: {_rel_err(o, ref_o):.3g}"
        assert _rel_err(S, ref_S) <= TOL[dtype], f"{name} S: {_rel_err(S, ref_S):.3g}"
        if normalize:
            assert z.shape == (B, H, Dk) and z.dtype == acc, name
            assert _rel_err(z, ref_z) <= TOL[dtype], f"{name} z: {_rel_err(z, ref_z):.3g}"
        results[name] = (o, S, z)
    (o_r, S_r, z_r), (o_p, S_p, z_p) = results["recurrent"], results["parallel"]
    assert _rel_err(o_p, o_r) <= TOL[dtype]
    assert _rel_err(S_p, S_r) <= TOL[dtype]
    if normalize:
        assert _rel_err(z_p, z_r) <= TOL[dtype]


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_explicit_double_sum(form, normalize):
    """No state at all: the causal sum over pairs, with eps=0 exactly the weighted average."""
    q, k, v, _, _ = _inputs(2, 2, 9, 4, 3, torch.float64, positive=True, seed=1)
    o, _ = form(q, k, v, normalize=normalize, eps=0.0)
    assert _rel_err(o, _double_sum(q, k, v, normalize=normalize)) <= 1e-12


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_no_internal_scaling_of_q_and_k(form):
    """o is linear in q and in k (normalize=False): nothing rescales or normalises them inside."""
    q, k, v, _, _ = _inputs(1, 2, 5, 4, 3, torch.float64, positive=False, seed=2)
    o, S = form(q, k, v)
    o2, S2 = form(3.0 * q, 0.5 * k, v)
    assert _rel_err(o2, 1.5 * o) <= 1e-12
    assert _rel_err(S2, 0.5 * S) <= 1e-12


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_first_token_and_future_tokens(form):
    """o_0 = q_0 (S_0 + k_0ᵀ v_0); changing token j leaves outputs before j bit-identical."""
    q, k, v, S0, _ = _inputs(1, 2, 6, 4, 5, torch.float64, positive=False, seed=3)
    base, _ = form(q, k, v, initial_state=S0)
    first = torch.einsum("bhk,bhkv->bhv", q[:, :, 0], S0 + k[:, :, 0, :, None] * v[:, :, 0, None, :])
    assert _rel_err(base[:, :, 0], first) <= 1e-12
    for j in range(1, 6):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, j] += 2.0
        v2[:, :, j] -= 3.0
        out, _ = form(q, k2, v2, initial_state=S0)
        assert torch.equal(out[:, :, :j], base[:, :, :j]), f"token {j} leaked backwards"
        assert _rel_err(out[:, :, j:], base[:, :, j:]) > 1e-3  # and it is used from j on


# -- states: prefill with one form, continue with the other ---------------------------------------

@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("second", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("first", FORMS, ids=FORM_IDS)
def test_split_anywhere_equals_one_pass(first, second, normalize):
    T = 7
    q, k, v, S0, z0 = _inputs(2, 2, T, 4, 3, torch.float64, positive=normalize, seed=4)
    init = _state(S0, z0, normalize)
    ref_o, ref_state = linear_attention.recurrent(q, k, v, normalize=normalize, initial_state=init)
    ref_S, ref_z = _split_state(ref_state, normalize)
    for t0 in range(T + 1):  # includes an empty first or second part
        o1, mid = first(q[:, :, :t0], k[:, :, :t0], v[:, :, :t0], normalize=normalize, initial_state=init)
        o2, end = second(q[:, :, t0:], k[:, :, t0:], v[:, :, t0:], normalize=normalize, initial_state=mid)
        S, z = _split_state(end, normalize)
        assert _rel_err(torch.cat([o1, o2], dim=2), ref_o) <= 1e-12, f"split at {t0}"
        assert _rel_err(S, ref_S) <= 1e-12, f"split at {t0}"
        if normalize:
            assert _rel_err(z, ref_z) <= 1e-12, f"split at {t0}"


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_decoding_one_token_at_a_time(form, dtype, normalize):
    """T = 1 calls chained through the state equal one call over the whole sequence."""
    q, k, v, _, _ = _inputs(2, 3, 10, 5, 4, dtype, positive=normalize, seed=5)
    ref_o, ref_state = linear_attention.parallel(q, k, v, normalize=normalize)
    state, outs = None, []
    for t in range(10):
        o_t, state = form(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                          normalize=normalize, initial_state=state)
        assert o_t.shape == (2, 3, 1, 4)
        outs.append(o_t)
    assert _rel_err(torch.cat(outs, dim=2), ref_o) <= TOL[dtype]
    for a, b in zip(_split_state(state, normalize), _split_state(ref_state, normalize)):
        if b is not None:
            assert _rel_err(a, b) <= TOL[dtype]


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_empty_sequence_passes_the_state_through(form, normalize):
    q, k, v, S0, z0 = _inputs(2, 2, 0, 3, 4, torch.float64, positive=True)
    o, state = form(q, k, v, normalize=normalize, initial_state=_state(S0, z0, normalize))
    assert o.shape == (2, 2, 0, 4) and o.dtype == torch.float64
    S, z = _split_state(state, normalize)
    assert torch.equal(S, S0)
    if normalize:
        assert torch.equal(z, z0)
    o, state = form(q, k, v, normalize=normalize)  # no initial state: zeros of the right shapes
    S, z = _split_state(state, normalize)
    assert torch.equal(S, torch.zeros(2, 2, 3, 4, dtype=torch.float64))
    if normalize:
        assert torch.equal(z, torch.zeros(2, 2, 3, dtype=torch.float64))


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_pure_function_inputs_untouched(form, normalize):
    q, k, v, S0, z0 = _inputs(1, 2, 5, 3, 4, torch.float64, positive=True, seed=6)
    before = [t.clone() for t in (q, k, v, S0, z0)]
    form(q, k, v, normalize=normalize, initial_state=_state(S0, z0, normalize))
    for t, b in zip((q, k, v, S0, z0), before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_half_precision_accumulates_in_float32(form, dtype):
    q, k, v, S0, z0 = _inputs(1, 2, 12, 8, 8, dtype, positive=True, seed=7)
    o, (S, z) = form(q, k, v, normalize=True, initial_state=(S0, z0))
    assert o.dtype == dtype and S.dtype == torch.float32 and z.dtype == torch.float32
    ref_o, ref_S, ref_z = _np_reference(q, k, v, S0, z0, normalize=True)
    assert _rel_err(o, ref_o) <= 1e-2  # one rounding of o to 8 (bf16) or 11 (f16) bits
    assert _rel_err(S, ref_S) <= 1e-5  # the state never leaves float32
    assert _rel_err(z, ref_z) <= 1e-5


# -- normalisation: weighted averages, and softmax as a special case -------------------------------

@pytest.mark.parametrize("phi", ["elu+1", "softplus", "taylor2"])
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_normalized_output_is_a_convex_combination_of_values(form, phi):
    """With positive features every o_t is a weighted average of v_0..v_t: inside their range per
    channel, and a constant value sequence comes back unchanged (eps=0)."""
    g = torch.Generator().manual_seed(8)
    f = feature_maps.get(phi)
    x_q, x_k = (torch.randn(2, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = 5.0 * torch.randn(2, 2, 12, 3, generator=g, dtype=torch.float64)
    o, _ = form(f(x_q), f(x_k), v, normalize=True, eps=0.0)
    lo, hi = v.cummin(dim=2).values, v.cummax(dim=2).values
    assert (o >= lo - 1e-12).all() and (o <= hi + 1e-12).all()
    assert _rel_err(o, v) > 0.1  # not trivially the current value
    const = torch.full_like(v, 2.5)
    o, _ = form(f(x_q), f(x_k), const, normalize=True, eps=0.0)
    assert (o - 2.5).abs().max().item() <= 1e-12


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_normalized_equals_softmax_for_exp_features_of_one_hot_keys(form):
    """φ(q) = exp(q), φ(k) = k one-hot: φ(q)·φ(k) = exp(q_c) = exp(q·k), so normalised linear
    attention IS causal softmax attention (scale 1) on these inputs, exactly."""
    g = torch.Generator().manual_seed(9)
    B, H, T, D = 2, 2, 10, 6
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = F.one_hot(torch.randint(0, D, (B, H, T), generator=g), D).double()
    v = torch.randn(B, H, T, 5, generator=g, dtype=torch.float64)
    o, _ = form(q.exp(), k, v, normalize=True, eps=0.0)
    softmax = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    assert _rel_err(o, softmax) <= 1e-12


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_taylor2_features_give_softmax_with_exp_replaced_by_its_taylor_polynomial(form):
    """With φ = taylor2 the weights are 1 + s + s²/2 (s = q·k): the row-normalised masked matrix
    of those weights times V, and close to softmax when |s| is small."""
    g = torch.Generator().manual_seed(10)
    q, k = (0.3 * torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 9, 3, generator=g, dtype=torch.float64)
    o, (S, z) = form(feature_maps.taylor2(q), feature_maps.taylor2(k), v, normalize=True, eps=0.0)
    assert S.shape == (1, 2, 1 + 4 + 16, 3) and z.shape == (1, 2, 21)
    s = q @ k.transpose(-1, -2)
    w = (1 + s + s**2 / 2) * torch.ones(9, 9, dtype=torch.bool).tril()
    assert _rel_err(o, (w / w.sum(-1, keepdim=True)) @ v) <= 1e-12
    softmax = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    assert 1e-6 < _rel_err(o, softmax) < 0.05  # an approximation, not an identity


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_normalize_with_signed_features_keeps_the_sign_of_the_normaliser(form):
    """No feature map (signed q, k): the op still divides by q_t·z_t + eps as it is, sign and all
    (which is why layers must apply a positive φ before normalize=True)."""
    q, k, v, S0, z0 = _inputs(2, 2, 8, 4, 3, torch.float64, positive=False, seed=14)
    z0 = z0 - 1.0  # signed too
    o, (S, z) = form(q, k, v, normalize=True, initial_state=(S0, z0))
    ref_o, ref_S, ref_z = _np_reference(q, k, v, S0, z0, normalize=True)
    denom = (q * (z0[:, :, None] + k.cumsum(2))).sum(-1)
    assert (denom < 0).any() and (denom > 0).any()  # the test really has both signs
    assert _rel_err(o, ref_o) <= 1e-12
    assert _rel_err(S, ref_S) <= 1e-12 and _rel_err(z, ref_z) <= 1e-12


def test_eps_is_added_to_the_normaliser():
    q, k, v, _, _ = _inputs(1, 1, 4, 3, 2, torch.float64, positive=True, seed=11)
    for form in FORMS:
        o0, _ = form(q, k, v, normalize=True, eps=0.0)
        o1, _ = form(q, k, v, normalize=True, eps=0.5)
        denom = (q * k.cumsum(2)).sum(-1, keepdim=True)
        assert _rel_err(o1, o0 * denom / (denom + 0.5)) <= 1e-12


# -- gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_gradcheck(form, normalize):
    q, k, v, S0, z0 = (t.requires_grad_() for t in
                       _inputs(1, 2, 3, 3, 2, torch.float64, positive=normalize, seed=12))

    def fn(q, k, v, S0, z0):
        o, state = form(q, k, v, normalize=normalize, initial_state=_state(S0, z0, normalize))
        return (o, *state) if normalize else (o, state)

    assert torch.autograd.gradcheck(fn, (q, k, v, S0, z0), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_gradients_of_all_forms_agree(normalize):
    grads = []
    for form in FORMS:
        ins = [t.requires_grad_() for t in
               _inputs(2, 2, 8, 4, 3, torch.float64, positive=normalize, seed=13)]
        q, k, v, S0, z0 = ins
        o, state = form(q, k, v, normalize=normalize, initial_state=_state(S0, z0, normalize))
        S, _ = _split_state(state, normalize)
        (o.square().sum() + S.sin().sum()).backward()
        grads.append([t.grad if t.grad is not None else torch.zeros_like(t) for t in ins])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert _rel_err(a, b) <= 1e-12


# -- misuse -------------------------------------------------------------------------------------

def _bad_inputs():
    f32, f64 = torch.float32, torch.float64
    q, k, v, S0, z0 = _inputs(2, 2, 4, 3, 5, f32, positive=True)
    meta = torch.device("meta")
    return [
        # (id, args, kwargs, exception, message pattern)
        ("3-D q", (q[0], k, v), {}, ValueError, r"q must have shape \[B, H, T, D\], got \(2, 4, 3\)"),
        ("5-D v", (q, k, v[None]), {}, ValueError, r"v must have shape \[B, H, T, D\]"),
        ("k head size", (q, k[..., :2], v), {}, ValueError, r"expected q, k \[B, H, T, Dk\]"),
        ("v length", (q, k, v[:, :, :3]), {}, ValueError, r"v \(2, 2, 3, 5\)"),
        ("v heads", (q, k, v[:, :1]), {}, ValueError, r"expected q, k \[B, H, T, Dk\]"),
        ("int q", (q.long(), k, v), {}, TypeError, "q must be a floating-point tensor, got torch.int64"),
        ("int v", (q, k, v.int()), {}, TypeError, "v must be a floating-point tensor"),
        ("bool k", (q, k > 0.5, v), {}, TypeError, "k must be a floating-point tensor"),
        ("mixed dtypes", (q, k.to(f64), v), {}, TypeError, "share a dtype"),
        ("list q", (q.tolist(), k, v), {}, TypeError, "q must be a torch.Tensor, got list"),
        ("k on meta", (q, k.to(meta), v), {}, ValueError, "one device"),
        ("state shape", (q, k, v), {"initial_state": S0[..., :4]}, ValueError,
         r"initial_state S must have shape \[2, 2, 3, 5\], got \[2, 2, 3, 4\]"),
        ("state transposed", (q, k, v), {"initial_state": S0.transpose(-1, -2)}, ValueError,
         r"initial_state S must have shape \[2, 2, 3, 5\]"),
        ("int state", (q, k, v), {"initial_state": S0.long()}, TypeError,
         "initial_state S must be a floating-point tensor"),
        ("state on meta", (q, k, v), {"initial_state": S0.to(meta)}, ValueError,
         "initial_state S is on meta, the inputs on cpu"),
        ("numpy state", (q, k, v), {"initial_state": S0.numpy()}, TypeError,
         "initial_state S must be a torch.Tensor, got ndarray"),
        ("pair without normalize", (q, k, v), {"initial_state": (S0, z0)}, TypeError,
         "normalize=False, initial_state is S alone, not a pair"),
        ("S alone with normalize", (q, k, v), {"normalize": True, "initial_state": S0}, TypeError,
         r"normalize=True, initial_state must be the pair \(S, z\)"),
        ("triple with normalize", (q, k, v), {"normalize": True, "initial_state": (S0, z0, z0)},
         TypeError, "must be the pair"),
        ("z shape", (q, k, v), {"normalize": True, "initial_state": (S0, z0[..., :2])}, ValueError,
         r"initial z must have shape \[2, 2, 3\], got \[2, 2, 2\]"),
        ("pair swapped", (q, k, v), {"normalize": True, "initial_state": (z0, S0)}, ValueError,
         "must have shape"),
        ("z on meta", (q, k, v), {"normalize": True, "initial_state": (S0, z0.to(meta))}, ValueError,
         "initial z is on meta"),
        ("z None", (q, k, v), {"normalize": True, "initial_state": (S0, None)}, TypeError,
         "initial z must be a torch.Tensor, got NoneType"),
        ("S None", (q, k, v), {"normalize": True, "initial_state": (None, z0)}, TypeError,
         "initial_state S must be a torch.Tensor, got NoneType"),
    ]


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_clear_errors(form, case):
    _, args, kwargs, exc, pattern = case
    name = getattr(form, "op_name", form.__name__)
    with pytest.raises(exc, match=pattern) as info:
        form(*args, **kwargs)
    assert str(info.value).startswith(f"linear_attention.{name}: ")  # says which operator


def test_keyword_only_options():
    q, k, v, S0, _ = _inputs(1, 1, 2, 2, 2, torch.float64, positive=True)
    for form in FORMS:
        with pytest.raises(TypeError):
            form(q, k, v, True)  # normalize must be named


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_chunked_refuses_a_bad_chunk_size(bad):
    q, k, v, _, _ = _inputs(1, 1, 4, 2, 2, torch.float32, positive=True)
    with pytest.raises(ValueError, match="linear_attention.chunked: chunk_size must be a positive int"):
        linear_attention.chunked(q, k, v, chunk_size=bad)


@pytest.mark.parametrize("T,C", [(12, 4), (10, 4), (3, 4), (1, 1), (0, 3)])
def test_chunk_layout_round_trip(T, C):
    """ops.chunks.to_chunks pads with zeros to ⌈T/C⌉ chunks; from_chunks drops the padding."""
    x = torch.randn(2, 3, T, 5, dtype=torch.float64)
    xc = chunks.to_chunks(x, C)
    N = -(-T // C)
    assert xc.shape == (2, 3, N, C, 5)
    assert torch.equal(xc.reshape(2, 3, N * C, 5)[:, :, T:], torch.zeros(2, 3, N * C - T, 5, dtype=x.dtype))
    assert torch.equal(chunks.from_chunks(xc, T), x)
    beta = torch.rand(2, 3, T, dtype=torch.float64)  # a per-token scalar, [B, H, T]
    assert torch.equal(chunks.from_chunks(chunks.to_chunks(beta, C), T), beta)


@pytest.mark.parametrize("N", [0, 1, 5])
def test_exclusive_scan_is_the_shifted_cumsum(N):
    """exclusive_scan_ overwrites x[:, :, c] with start + Σ_{c'<c} x[:, :, c'] and returns the total,
    without touching start (and without handing start back when there is nothing to add)."""
    g = torch.Generator().manual_seed(N)
    x = torch.randn(2, 3, N, 4, 2, generator=g, dtype=torch.float64)
    start = torch.randn(2, 3, 4, 2, generator=g, dtype=torch.float64)
    start_copy, inclusive = start.clone(), start.unsqueeze(2) + x.cumsum(dim=2)
    expected = torch.cat([start.unsqueeze(2), inclusive[:, :, :-1]], dim=2) if N else x.clone()
    total = chunks.exclusive_scan_(x, start)
    assert (x - expected).abs().max().item() <= 1e-12 if N else x.numel() == 0
    assert (total - (inclusive[:, :, -1] if N else start)).abs().max().item() <= 1e-12
    assert torch.equal(start, start_copy) and total is not start


def test_initial_state_helper_zeros_casts_and_checks():
    like = torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)
    zero = chunks.initial_state(None, (1, 2, 4, 4), like, "op")
    assert zero.dtype == torch.float32 and torch.equal(zero, torch.zeros(1, 2, 4, 4))
    given = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    assert chunks.initial_state(given, (1, 2, 4, 4), like, "op").dtype == torch.float32
    with pytest.raises(ValueError, match=r"op: initial_state must have shape \[1, 2, 4, 4\]"):
        chunks.initial_state(given[..., :3], (1, 2, 4, 4), like, "op")
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="op: chunk_size must be a positive int"):
            chunks.chunk_size(bad, "op")

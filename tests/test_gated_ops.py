"""tinyk3.ops.gated_delta_rule and tinyk3.ops.kda (chapters 10 and 11): the token loops agree
with a numpy reference written here in the papers' layout, the chunked forms agree with the loops
(float64 ≤ 1e-10, float32 at T = 8192 within a stated bound), gradients pass gradcheck, the
reductions hold (g = 0 is the delta rule; KDA with one gate across channels is Gated DeltaNet),
KDA's float32 guarantee holds for gates down to −5 at every chunk size, and misuse fails clearly.

External oracles (fla's naive references, transformers' PyTorch forms): test_gated_oracles*.py.

Reference (independent of the lib): numpy float64, ``S ∈ R^{Dv×Dk}``,
``S_t = S_{t−1} Diag(α_t) (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ``, ``o_t = S_t q_t``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import OP_DTYPE_IDS, OP_DTYPES, OP_SHAPE_IDS, OP_SHAPES, OP_TOL
from tinyk3.ops import delta_rule, gated_delta_rule, kda

RULES = ["gdn", "kda"]
CHUNKS = [1, 5, 16, 32, 64]


def _inputs(B, H, T, Dk, Dv, dtype, *, rule, gmin=-1.0, seed=0):
    """Unit keys, β ∈ (0, 1), log decays in (gmin, 0], a non-zero initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=dtype)
    beta = torch.rand(B, H, T, generator=gen, dtype=dtype)
    shape = (B, H, T) if rule == "gdn" else (B, H, T, Dk)
    g = gmin * torch.rand(*shape, generator=gen, dtype=dtype)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen, dtype=dtype)
    return q, k, v, beta, g, S0


def _ops(rule):
    return gated_delta_rule if rule == "gdn" else kda


def _np_reference(q, k, v, beta, g, S0):
    """numpy float64 in the papers' layout (S: Dv × Dk, decay on the columns = key channels)."""
    q, k, v, beta, g = (t.detach().double().numpy() for t in (q, k, v, beta, g))
    if g.ndim == 3:
        g = np.repeat(g[..., None], q.shape[-1], axis=-1)
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    o, S_out, eye = np.zeros((B, H, T, Dv)), np.zeros((B, H, Dk, Dv)), np.eye(Dk)
    for b in range(B):
        for h in range(H):
            S = S0[b, h].detach().double().numpy().T.copy()
            for t in range(T):
                kt, bt = k[b, h, t], beta[b, h, t]
                S = S @ np.diag(np.exp(g[b, h, t])) @ (eye - bt * np.outer(kt, kt)) + bt * np.outer(
                    v[b, h, t], kt)
                o[b, h, t] = S @ q[b, h, t]
            S_out[b, h] = S.T
    return torch.from_numpy(o), torch.from_numpy(S_out)


def _rel(a, b):
    """max |a − b| relative to max(1, max |b|); 0 for empty tensors."""
    if b.numel() == 0:
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1.0)).item()


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("B,H,T,Dk,Dv", OP_SHAPES, ids=OP_SHAPE_IDS)
def test_token_loop_equals_numpy_reference(rule, B, H, T, Dk, Dv):
    q, k, v, beta, g, S0 = _inputs(B, H, T, Dk, Dv, torch.float64, rule=rule, seed=T)
    o_ref, S_ref = _np_reference(q, k, v, beta, g, S0)
    o, S = _ops(rule).recurrent(q, k, v, beta, g, initial_state=S0)
    assert _rel(o, o_ref) < 1e-12 and _rel(S, S_ref) < 1e-12


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", OP_DTYPES, ids=OP_DTYPE_IDS)
@pytest.mark.parametrize("C", CHUNKS)
@pytest.mark.parametrize("B,H,T,Dk,Dv", OP_SHAPES, ids=OP_SHAPE_IDS)
def test_chunked_equals_token_loop(rule, dtype, C, B, H, T, Dk, Dv):
    """Any T (the last chunk is padded), Dk ≠ Dv, a non-zero initial state; float64 ≤ 1e-10."""
    q, k, v, beta, g, S0 = _inputs(B, H, T, Dk, Dv, dtype, rule=rule, seed=T + C)
    o_ref, S_ref = _ops(rule).recurrent(q, k, v, beta, g, initial_state=S0)
    o, S = _ops(rule).chunked(q, k, v, beta, g, chunk_size=C, initial_state=S0)
    tol = 1e-10 if dtype == torch.float64 else OP_TOL[dtype]
    assert o.dtype == dtype and S.shape == S0.shape
    assert _rel(o, o_ref) < tol and _rel(S, S_ref) < tol


# float32 over a long sequence against the float64 loop. Measured here: ≤ 3e-7 relative for both
# rules at T = 8192 (the decay keeps the state bounded); the bound leaves a factor of ≈30.
LONG_TOL = 1e-5


@pytest.mark.parametrize("rule", RULES)
def test_float32_chunked_at_T_8192_within_bound(rule):
    q, k, v, beta, g, S0 = _inputs(1, 1, 8192, 16, 16, torch.float64, rule=rule, gmin=-0.2, seed=3)
    o_ref, S_ref = _ops(rule).recurrent(q, k, v, beta, g, initial_state=S0)
    o, S = _ops(rule).chunked(*(t.float() for t in (q, k, v, beta, g)), chunk_size=64,
                              initial_state=S0.float())
    assert _rel(o, o_ref) < LONG_TOL and _rel(S, S_ref) < LONG_TOL


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_gradcheck(rule, form):
    """float64 gradients of o and S_T with respect to q, k, v, β, g and S_0."""
    q, k, v, beta, g, S0 = _inputs(1, 1, 11, 4, 3, torch.float64, rule=rule, seed=5)
    fn = getattr(_ops(rule), form)
    kw = {"chunk_size": 4} if form == "chunked" else {}
    inputs = [t.clone().requires_grad_() for t in (q, k, v, beta, g, S0)]
    assert torch.autograd.gradcheck(lambda *a: fn(*a[:5], initial_state=a[5], **kw), inputs)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("C", [1, 16, 64])
def test_zero_gate_is_the_delta_rule(rule, C):
    q, k, v, beta, g, S0 = _inputs(2, 2, 45, 8, 6, torch.float64, rule=rule, seed=C)
    o_ref, S_ref = delta_rule.recurrent(q, k, v, beta, initial_state=S0)
    for o, S in (_ops(rule).recurrent(q, k, v, beta, torch.zeros_like(g), initial_state=S0),
                 _ops(rule).chunked(q, k, v, beta, torch.zeros_like(g), chunk_size=C,
                                    initial_state=S0)):
        assert _rel(o, o_ref) < 1e-12 and _rel(S, S_ref) < 1e-12


@pytest.mark.parametrize("C", [1, 16, 64])
def test_kda_with_one_gate_across_channels_is_gated_deltanet(C):
    q, k, v, beta, g, S0 = _inputs(2, 2, 45, 8, 6, torch.float64, rule="gdn", gmin=-3.0, seed=C)
    o_ref, S_ref = gated_delta_rule.recurrent(q, k, v, beta, g, initial_state=S0)
    g_ch = g.unsqueeze(-1).expand(-1, -1, -1, 8).contiguous()
    for o, S in (kda.recurrent(q, k, v, beta, g_ch, initial_state=S0),
                 kda.chunked(q, k, v, beta, g_ch, chunk_size=C, initial_state=S0)):
        assert _rel(o, o_ref) < 1e-12 and _rel(S, S_ref) < 1e-12


def _stress_gates(B, H, T, Dk, dtype, seed):
    """The lower-bound gate's worst cases: whole chunks at −5, channels near 0 (long memory)
    beside channels at −5, and uniform draws in [−5, 0]."""
    gen = torch.Generator().manual_seed(seed)
    g = -5.0 * torch.rand(B, H, T, Dk, generator=gen, dtype=dtype)
    g[..., : Dk // 4] = -1e-3  # long-lived channels
    g[..., Dk // 4: Dk // 2] = -5.0  # channels that forget at once
    g[:, :, 64:128] = -5.0  # a whole 64-token chunk at the bound
    return g


# float32 against float64 at gates down to −5: measured ≤ 3e-7 relative at every chunk size.
STRESS_TOL = 1e-5


@pytest.mark.parametrize("C", [16, 32, 64])
def test_kda_float32_finite_and_accurate_for_gates_down_to_minus_5(C):
    q, k, v, beta, _, S0 = _inputs(1, 2, 300, 32, 16, torch.float64, rule="kda", seed=C)
    g = _stress_gates(1, 2, 300, 32, torch.float64, seed=C)
    assert g.min().item() >= -5.0
    o_ref, S_ref = kda.recurrent(q, k, v, beta, g, initial_state=S0)
    o, S = kda.chunked(*(t.float() for t in (q, k, v, beta, g)), chunk_size=C,
                       initial_state=S0.float())
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert _rel(o, o_ref) < STRESS_TOL and _rel(S, S_ref) < STRESS_TOL


def test_kda_below_the_bound_uses_the_exact_diagonal_and_stays_finite():
    """Gates of −20 per step: a 16-token sub-chunk sums to −320, past float32's exp range for the
    factorised diagonal blocks; the pairwise path keeps the result finite and accurate."""
    q, k, v, beta, _, S0 = _inputs(1, 1, 80, 16, 8, torch.float64, rule="kda", seed=2)
    g = -20.0 * torch.rand(1, 1, 80, 16, dtype=torch.float64)
    g[..., :4] = -1e-2
    assert (g.reshape(1, 1, 5, 16, 16).sum(3).min() < -kda.EXP_LIMIT).item()
    o_ref, S_ref = kda.recurrent(q, k, v, beta, g, initial_state=S0)
    o, S = kda.chunked(*(t.float() for t in (q, k, v, beta, g)), chunk_size=64,
                       initial_state=S0.float())
    assert torch.isfinite(o).all() and _rel(o, o_ref) < STRESS_TOL and _rel(S, S_ref) < STRESS_TOL


def test_kda_pair_scores_exact_diagonal_equals_factorised_form():
    """Both ways of forming the diagonal sub-blocks agree where both are finite."""
    gen = torch.Generator().manual_seed(0)
    Z, n, s, D = 3, 4, 16, 8
    X, Y = torch.randn(Z, n, s, D, generator=gen, dtype=torch.float64), torch.randn(
        Z, n, s, D, generator=gen, dtype=torch.float64)
    gates = -2.0 * torch.rand(Z, n, s, D, generator=gen, dtype=torch.float64)
    L = gates.cumsum(2)
    r = torch.cat([torch.zeros_like(L[:, :1, -1:]), L[:, :-1, -1:].cumsum(1)], dim=1)
    G = (r + L).reshape(Z, n * s, D)
    ref = torch.einsum("zid,zjd,zijd->zij", X.reshape(Z, -1, D), Y.reshape(Z, -1, D),
                       torch.exp(G[:, :, None] - G[:, None, :])).tril()
    for exact in (False, True):
        P = kda.pair_scores(X, Y, L, r, strict=False, exact_diagonal=exact)
        assert (P - ref).abs().max().item() < 1e-12
    P = kda.pair_scores(X, Y, L, r, strict=True)
    assert (P - ref.tril(-1)).abs().max().item() < 1e-12


@pytest.mark.parametrize("C,expected", [(64, 16), (32, 16), (16, 16), (8, 8), (24, 8), (5, 1)])
def test_sub_chunk_size(C, expected):
    assert kda.sub_chunk_size(C) == expected


@pytest.mark.parametrize("rule", RULES)
def test_state_carries_across_calls(rule):
    """Two chunked calls, the second starting from the first's final state, equal one call."""
    q, k, v, beta, g, S0 = _inputs(1, 2, 70, 8, 8, torch.float64, rule=rule, seed=9)
    o_all, S_all = _ops(rule).chunked(q, k, v, beta, g, chunk_size=16, initial_state=S0)
    cut = 27
    o1, S1 = _ops(rule).chunked(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], beta[:, :, :cut],
                                g[:, :, :cut], chunk_size=16, initial_state=S0)
    o2, S2 = _ops(rule).chunked(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], beta[:, :, cut:],
                                g[:, :, cut:], chunk_size=16, initial_state=S1)
    assert _rel(torch.cat([o1, o2], dim=2), o_all) < 1e-12 and _rel(S2, S_all) < 1e-12


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_empty_sequence_returns_the_initial_state(rule, form):
    q, k, v, beta, g, S0 = _inputs(1, 2, 0, 4, 3, torch.float32, rule=rule)
    o, S = getattr(_ops(rule), form)(q, k, v, beta, g, initial_state=S0)
    assert o.shape == (1, 2, 0, 3) and torch.equal(S, S0)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_bad_gates_fail_clearly(rule, form):
    q, k, v, beta, g, _ = _inputs(1, 2, 8, 4, 3, torch.float32, rule=rule)
    fn = getattr(_ops(rule), form)
    other = (1, 2, 8, 4) if rule == "gdn" else (1, 2, 8)
    with pytest.raises(ValueError, match="g .*shape"):
        fn(q, k, v, beta, torch.zeros(other))
    with pytest.raises(ValueError, match="<= 0"):
        fn(q, k, v, beta, g.abs() + 0.1)
    with pytest.raises(ValueError, match="non-finite"):
        fn(q, k, v, beta, torch.full_like(g, float("nan")))
    with pytest.raises(TypeError, match="dtype"):
        fn(q, k, v, beta, g.double())
    with pytest.raises(TypeError, match="torch.Tensor"):
        fn(q, k, v, beta, -0.5)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("C", [0, -16, True, 16.0])
def test_bad_chunk_size_fails_clearly(rule, C):
    q, k, v, beta, g, _ = _inputs(1, 1, 8, 4, 3, torch.float32, rule=rule)
    with pytest.raises(ValueError, match="chunk_size"):
        _ops(rule).chunked(q, k, v, beta, g, chunk_size=C)


@pytest.mark.parametrize("rule", RULES)
def test_bad_shapes_and_state_fail_clearly(rule):
    q, k, v, beta, g, S0 = _inputs(1, 2, 8, 4, 3, torch.float32, rule=rule)
    with pytest.raises(ValueError, match="beta"):
        _ops(rule).chunked(q, k, v, beta[:, :, :4], g)
    with pytest.raises(ValueError, match="initial_state"):
        _ops(rule).chunked(q, k, v, beta, g, initial_state=S0[:, :1])

"""tinyk3.kernels.backward: the backward pass of the three chunked rules as Triton kernels
(chapter 21), under the Triton interpreter on CPU.

Every gradient is compared with the derived PyTorch backward (``ops.<rule>.chunked_backward``)
run in float64 on the same inputs (that backward is itself checked against autograd through the
float64 token loops in tests/test_backward.py). Errors are max |a − b| / max(1, max |b|), as in
the forward's kernel tests:

* float32 mode (``operands="float32"``, ieee products): 1e-5 (measured ≤ 2e-6 here, KDA's gate
  stress included);
* bfloat16-operand mode (bf16 tiles into every tl.dot, float32 accumulators, ``W``, ``U``,
  ``U'``, ``dU'``, ``P``, ``dS_[c+1]`` stored in bf16; emulated exactly under the interpreter):
  3e-2 (measured ≤ 1.3e-2);
* kernels against kernels (kept vs recomputed states): 2e-6.
"""

from __future__ import annotations

import pytest
import torch

import tinyk3.kernels as kernels
from helpers import delta_rule_inputs
from tinyk3.kernels import backward as kb
from tinyk3.kernels import delta_rule as kd
from tinyk3.kernels import gated_delta_rule as kg
from tinyk3.kernels import kda as kk
from tinyk3.kernels import runtime
from tinyk3.ops import delta_rule as ops_dr
from tinyk3.ops import gated_delta_rule as ops_gdn
from tinyk3.ops import kda as ops_kda

pytestmark = pytest.mark.triton

needs_triton = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"tinyk3.kernels: {kernels.REASON}")

TOL_F32 = 1e-5
TOL_BF16 = 3e-2
TOL_SAME = 2e-6
RULES = {"delta_rule": (0, kd, ops_dr), "gated_delta_rule": (1, kg, ops_gdn), "kda": (2, kk, ops_kda)}
NAMES = ("dq", "dk", "dv", "dbeta", "dg", "d_initial_state")

# (B, H, T, Dk, Dv, C): T never a multiple of C, Dk ≠ Dv, several Dk blocks in the last case
CASES = [
    (2, 1, 37, 16, 32, 16),  # 3 chunks, the last partial; B = 2
    (1, 2, 45, 20, 12, 32),  # head sizes that are not powers of two
    (1, 1, 80, 80, 24, 64),  # C = 64: 4 sub-chunks; Dk = 80 in 2 (3 for KDA) blocks
]
CASE_IDS = ["B{}H{}T{}Dk{}Dv{}C{}".format(*c) for c in CASES]


def _err(a, b):
    a, b = a.detach().double(), b.detach().double()
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _inputs(rule, B, H, T, Dk, Dv, seed=0, low=-1.0, stress=False):
    """float32 inputs, the gate uniform in [low, 0] (stress: −5 everywhere but a few tokens)."""
    q, k, v, beta, S0 = delta_rule_inputs(B, H, T, Dk, Dv, torch.float32, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    shape = (B, H, T) if rule == "gated_delta_rule" else (B, H, T, Dk)
    g = None if rule == "delta_rule" else low * torch.rand(shape, generator=gen)
    if stress:
        g = torch.full(shape, -5.0)
        g[:, :, :3] = -1e-3  # nearly no decay next to the strongest
        if rule == "kda":
            g[..., 1::3] = -1e-2  # channels that keep their memory
    d_o = torch.randn(B, H, T, Dv, generator=gen)
    d_state = torch.randn(B, H, Dk, Dv, generator=gen)
    return q, k, v, beta, g, S0, d_o, d_state


def _reference(rule, q, k, v, beta, g, d_o, d_state, C, S0):
    """``chunked_backward`` in float64, as the kernels' tuple (dg None for the delta rule)."""
    gate, _, ops = RULES[rule]
    x = [t.double() for t in (q, k, v, beta)] + ([] if g is None else [g.double()])
    r = ops.chunked_backward(*x, d_o.double(), None if d_state is None else d_state.double(),
                             chunk_size=C, initial_state=None if S0 is None else S0.double())
    return (*r[:4], None if gate == 0 else r[4], r[-1])


def _kernel_grads(rule, q, k, v, beta, g, d_o, d_state, C, S0, **mode):
    return kb.backward(q, k, v, beta, g, d_o, d_state, gate=RULES[rule][0], chunk_size=C,
                       initial_state=S0, **mode)


def _check(got, ref, tol, what):
    for name, a, b in zip(NAMES, got, ref):
        if b is None:
            continue
        assert torch.isfinite(a).all(), (what, name)
        assert _err(a, b) <= tol, (what, name, f"{_err(a, b):.2e}")


# -- against the float64 derived backward ----------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_float32_mode_equals_the_float64_backward(rule, case):
    B, H, T, Dk, Dv, C = case
    q, k, v, beta, g, S0, d_o, dS = _inputs(rule, B, H, T, Dk, Dv, seed=sum(case))
    for state, final in ((S0, dS), (None, None)):  # with and without S_0 and ∂L/∂S_T
        got = _kernel_grads(rule, q, k, v, beta, g, d_o, final, C, state)
        _check(got, _reference(rule, q, k, v, beta, g, d_o, final, C, state), TOL_F32,
               (rule, case, state is not None))


@needs_triton
@pytest.mark.parametrize("rule", list(RULES))
def test_bf16_operands_against_the_float64_backward(rule):
    B, H, T, Dk, Dv, C = CASES[2]
    q, k, v, beta, g, S0, d_o, dS = _inputs(rule, B, H, T, Dk, Dv, seed=3)
    got = _kernel_grads(rule, q, k, v, beta, g, d_o, dS, C, S0, operands="bfloat16")
    ref = _reference(rule, q, k, v, beta, g, d_o, dS, C, S0)
    _check(got, ref, TOL_BF16, rule)
    # and not float32-accurate: the operands really were rounded
    assert max(_err(a, b) for a, b in zip(got, ref) if b is not None) > 10 * TOL_F32


@needs_triton
@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("rule", ["gated_delta_rule", "kda"])
def test_gates_at_the_lower_bound(rule, C):
    """Gates of −5 per step (Kimi K3's lower bound): finite and float32-accurate (the diagonal
    blocks' reference for KDA; the diagonal pairs left out of the gate's terms)."""
    q, k, v, beta, g, S0, d_o, dS = _inputs(rule, 1, 2, 100, 32, 16, seed=7, stress=True)
    got = _kernel_grads(rule, q, k, v, beta, g, d_o, dS, C, S0)
    _check(got, _reference(rule, q, k, v, beta, g, d_o, dS, C, S0), TOL_F32, (rule, C))


@needs_triton
@pytest.mark.parametrize("rule", ["gated_delta_rule", "kda"])
def test_one_token_from_a_zero_state_has_no_gate_gradient(rule):
    """With one token and S_0 = 0 the output does not depend on the gate: dg must be exactly 0
    (the decay pair i = j left out, not cancelled by rounding)."""
    q, k, v, beta, g, _, d_o, _ = _inputs(rule, 1, 2, 1, 16, 16, seed=9, low=-5.0)
    got = _kernel_grads(rule, q, k, v, beta, g, d_o, None, 16, None)
    assert torch.equal(got[4], torch.zeros_like(got[4]))


@needs_triton
@pytest.mark.parametrize("rule", list(RULES))
def test_recomputed_states_equal_kept_ones(rule):
    """``states=None`` and ``x=None`` (recompute the boundary states and the inverses in the
    backward, as fla recomputes its states) give the gradients of the kept ones."""
    q, k, v, beta, g, S0, d_o, dS = _inputs(rule, 1, 2, 45, 20, 12, seed=11)
    gate, kern, _ = RULES[rule]
    x = (q, k, v, beta) if gate == 0 else (q, k, v, beta, g)
    fwd = kern.forward_stages(*x, chunk_size=32, initial_state=S0)
    kept = kb.backward(q, k, v, beta, g, d_o, dS, gate=gate, chunk_size=32, initial_state=S0,
                       states=fwd["states"], x=fwd.get("x"))
    again = kb.backward(q, k, v, beta, g, d_o, dS, gate=gate, chunk_size=32, initial_state=S0)
    for name, a, b in zip(NAMES, kept, again):
        assert (a is None) == (b is None) and (a is None or _err(a, b) <= TOL_SAME), name


@needs_triton
@pytest.mark.parametrize("rule", list(RULES))
def test_each_stage_writes_its_equation(rule):
    """What the stages store: U' equals the forward's; the last chunk's dS_[c+1] is ∂L/∂S_T;
    P = Ωᵀ dO; X is the inverse of I + tril(diag(β) A, −1) (with 𝒯 = X diag(β))."""
    gate, kern, _ = RULES[rule]
    q, k, v, beta, g, S0, d_o, dS = _inputs(rule, 1, 1, 40, 16, 16, seed=13)
    x = (q, k, v, beta) if gate == 0 else (q, k, v, beta, g)
    fwd = kern.forward_stages(*x, chunk_size=16, initial_state=S0)
    st = kb.backward(q, k, v, beta, g, d_o, dS, gate=gate, chunk_size=16, initial_state=S0,
                     states=fwd["states"], return_stages=True)
    assert _err(st["u_new"], fwd["u_new"]) <= TOL_SAME
    assert _err(st["ds_next"][:, :, -1], dS) == 0.0
    # P = Ωᵀ dO for the first chunk, Ω from the float64 forward's definition
    q1, k1, do1 = (t[0, 0, :16].double() for t in (q, k, d_o))
    if gate == 0:
        om = (q1 @ k1.T).tril()
    elif gate == 1:
        G = g[0, 0, :16].double().cumsum(0)
        om = ((q1 @ k1.T) * torch.exp((G[:, None] - G[None, :]).tril())).tril()
    else:
        G = g[0, 0, :16].double().cumsum(0)
        om = torch.einsum("id,jd,ijd->ij", q1, k1, torch.exp((G[:, None] - G[None, :]).clamp(max=0)))
        om = om.tril()
    assert _err(st["p"][0, 0, :16], om.T @ do1) <= TOL_F32
    X = st["x"][0, 0, :16].double()
    b1 = beta[0, 0, :16].double()
    if gate == 2:
        A = torch.einsum("id,jd,ijd->ij", k1, k1, torch.exp((G[:, None] - G[None, :]).clamp(max=0)))
    else:
        A = k1 @ k1.T * (1.0 if gate == 0 else torch.exp((G[:, None] - G[None, :]).clamp(max=0)))
    eye = torch.eye(16, dtype=torch.float64)
    assert _err(X @ (eye + (b1[:, None] * A).tril(-1)), eye) <= TOL_F32


@needs_triton
@pytest.mark.parametrize("rule", list(RULES))
def test_autograd_through_the_kernels(rule):
    """``kernels.<rule>.chunked`` trains: its autograd backward launches these kernels (not the
    PyTorch form), with None for inputs that need no gradient."""
    gate, kern, ops = RULES[rule]
    q, k, v, beta, g, S0, d_o, dS = _inputs(rule, 1, 2, 37, 16, 24, seed=17)
    x = [q, k, v, beta] + ([] if gate == 0 else [g])
    leaves = [t.clone().requires_grad_() for t in x]
    o, S = kern.chunked(*leaves, chunk_size=16, initial_state=S0)
    ((o * d_o).sum() + (S * dS).sum()).backward()
    ref = _reference(rule, q, k, v, beta, g, d_o, dS, 16, S0)
    for name, t, b in zip(NAMES, leaves, ref):
        assert _err(t.grad, b) <= TOL_F32, name
    calls = []
    real = kb.backward
    kb.backward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        only_v = v.clone().requires_grad_()
        kern.chunked(*([q, k, only_v] + x[3:]), chunk_size=16)[0].sum().backward()
    finally:
        kb.backward = real
    assert calls == [1] and only_v.grad is not None and q.grad is None


@needs_triton
def test_empty_sequence():
    q, k, v, beta, g, S0, d_o, dS = _inputs("kda", 1, 2, 0, 16, 8)
    dq, dk, dv, db, dg, d0 = kb.backward(q, k, v, beta, g, d_o, dS, gate=2, chunk_size=16,
                                         initial_state=S0)
    assert dq.shape == (1, 2, 0, 16) and dg.shape == (1, 2, 0, 16) and torch.equal(d0, dS)


def _tiny_model(form: str):
    """Three mixers, one per rule, in a two-block-per-rule model: the same weights in every form."""
    from tinyk3.layers import DeltaNetConfig, GatedDeltaNetConfig, KDAConfig
    from tinyk3.models import LM, LMConfig

    pattern = (KDAConfig(n_head=2, head_dim=8, chunk_size=16, form=form),
               GatedDeltaNetConfig(n_head=2, head_dim=8, chunk_size=16, form=form),
               DeltaNetConfig(n_head=2, chunk_size=16, form=form))
    cfg = LMConfig(vocab_size=40, block_size=64, n_embd=16, pattern=pattern, pos_emb=False,
                   norm="rmsnorm", tie_embeddings=False)
    torch.manual_seed(0)
    return LM(cfg)


@needs_triton
def test_a_model_trains_through_the_kernels():
    """A tiny model whose mixers are the three rules, ``form="triton"``: two SGD steps give the
    losses of the same model in the PyTorch chunked form (derived backward) to float32 round-off,
    and the loss falls."""
    idx = torch.randint(0, 40, (1, 33), generator=torch.Generator().manual_seed(1))
    losses = {}
    for form in ("triton", "chunked"):
        model = _tiny_model(form)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        seen = []
        for _ in range(2):
            logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(loss.item())
        losses[form] = seen
    assert losses["triton"] == pytest.approx(losses["chunked"], rel=1e-5), losses
    assert losses["triton"][-1] < losses["triton"][0]


# -- compiled for real GPUs, without one ---------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80", "sm_90"])
def test_backward_compiles_for_gpu_targets(arch, tmp_path, monkeypatch):
    """Triton IR → PTX → cubin for the four backward kernels of each rule, bf16 operands, small
    tiles (about a second a kernel); benchmarks/2026-12-03-ptxas-backward/ has C = 64, D = 128."""
    reason = runtime.cannot_compile_reason()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    target = "sm_90a" if arch == 90 else "sm_80"
    for gate in (0, 1, 2):
        out = kb.compile_for_gpu(gate, arch, chunk_size=32, Dk=32, Dv=32, operands="bfloat16")
        assert set(out) == {"_dv_local_kernel", "_adjoint_kernel", "_ut_backward_kernel",
                            "_dqk_kernel"}
        for name, compiled in out.items():
            assert f".target {target}" in compiled.asm["ptx"], name
            report = runtime.ptxas_report(compiled.asm["ptx"])
            assert 0 < report["registers"] <= 255, (gate, name, report["text"])
            assert report["spill_stores"] == report["spill_loads"] == 0, (gate, name, report["text"])

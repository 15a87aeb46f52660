"""tinyk3.kernels.gated_delta_rule and tinyk3.kernels.kda (the gated stages of
tinyk3.kernels.gated): under the Triton interpreter on CPU each equals the float64 token loop
(``ops.gated_delta_rule.recurrent`` / ``ops.kda.recurrent``) on awkward shapes; KDA stays finite
and accurate for gates down to −5 per step; the reductions hold (KDA with equal channels is
Gated DeltaNet, ``g = 0`` is chapter 9's kernel); every stage compiles for sm_80 and sm_90
without a GPU; bad inputs fail clearly.

Tolerances, relative to max(1, max |reference|), the reference in float64 on the same inputs:
* float32 mode (``operands="float32"``, ieee products): 1e-5, the float32 bound of the ops'
  tests (measured ≤ 5e-7 here, the gate-stress case included);
* bfloat16-operand mode (bf16 tiles into every tl.dot, float32 accumulation, W, U, S_[c], U'
  stored in bf16; emulated by rounding under the interpreter): 1.5e-2, chapter 9's bound
  (measured ≤ 5e-3, ≤ 7.5e-3 in the gate-stress case);
* kernel against kernel (the reductions): 2e-6 (float32 round-off in another order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tinyk3.kernels as kernels
from helpers import delta_rule_inputs
from tinyk3.kernels import delta_rule as kd
from tinyk3.kernels import gated_delta_rule as kg
from tinyk3.kernels import kda as kk
from tinyk3.kernels import runtime
from tinyk3.ops import gated_delta_rule as ops_gdn
from tinyk3.ops import kda as ops_kda
from tinyk3.ops.delta_rule import ut_transform

# Reaches Triton and tinyk3.kernels: rerun with Triton hidden by `make unit-no-triton`.
pytestmark = pytest.mark.triton

needs_triton = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"tinyk3.kernels: {kernels.REASON}")

TOL_F64 = 1e-5
TOL_BF16 = 1.5e-2
TOL_SAME = 2e-6
RULES = {"gdn": (kg, ops_gdn), "kda": (kk, ops_kda)}
ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# (B, H, T, Dk, Dv, C): T never a multiple of C, Dk ≠ Dv, head sizes that are not powers of two
CASES = [
    (2, 1, 37, 16, 32, 16),  # 3 chunks, the last partial; B = 2
    (1, 2, 45, 20, 12, 32),  # head sizes 20 and 12 (padded to 32 and 16 by masks)
    (1, 2, 80, 24, 16, 64),  # C = 64: two chunks, the second of 16 tokens; 4 sub-chunks
]
CASE_IDS = ["B{}H{}T{}Dk{}Dv{}C{}".format(*c) for c in CASES]


def _gate(rule, B, H, T, Dk, low, seed, dtype=torch.float32):
    """Log decays uniform in [low, 0]: [B, H, T] (Gated DeltaNet) or [B, H, T, Dk] (KDA)."""
    shape = (B, H, T) if rule == "gdn" else (B, H, T, Dk)
    return (low * torch.rand(shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _inputs(rule, B, H, T, Dk, Dv, dtype=torch.float32, seed=0, low=-1.0):
    q, k, v, beta, S0 = delta_rule_inputs(B, H, T, Dk, Dv, dtype, seed)
    return q, k, v, beta, _gate(rule, B, H, T, Dk, low, seed + 100, dtype), S0


def _rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _loop64(rule, q, k, v, beta, g, S0):
    """The float64 token loop on the same (possibly rounded) inputs."""
    ops = RULES[rule][1]
    return ops.recurrent(*(t.double() for t in (q, k, v, beta, g)),
                         initial_state=None if S0 is None else S0.double())


# -- against the float64 token loop, under the interpreter ----------------------------------------

@needs_triton
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_float32_mode_equals_the_float64_loop(rule, case):
    B, H, T, Dk, Dv, C = case
    q, k, v, beta, g, S0 = _inputs(rule, B, H, T, Dk, Dv, low=-1.0 if rule == "gdn" else -2.0)
    init = S0 if C != 32 else None  # one case from the zero state
    o, S = RULES[rule][0].chunked(q, k, v, beta, g, chunk_size=C, initial_state=init)
    assert o.shape == (B, H, T, Dv) and o.dtype == torch.float32
    assert S.shape == (B, H, Dk, Dv) and S.dtype == torch.float32
    ro, rS = _loop64(rule, q, k, v, beta, g, init)
    assert _rel_err(o, ro) <= TOL_F64, f"o: {_rel_err(o, ro):.2e}"
    assert _rel_err(S, rS) <= TOL_F64, f"S: {_rel_err(S, rS):.2e}"


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_bf16_operands_against_the_float64_loop(rule, case):
    """bfloat16 inputs default to fla's mode (bf16 operands, float32 accumulation)."""
    B, H, T, Dk, Dv, C = case
    q, k, v, beta, g, S0 = _inputs(rule, B, H, T, Dk, Dv, torch.bfloat16, seed=7)
    o, S = RULES[rule][0].chunked(q, k, v, beta, g, chunk_size=C, initial_state=S0)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    ro, rS = _loop64(rule, q, k, v, beta, g, S0)
    assert _rel_err(o, ro) <= TOL_BF16, f"o: {_rel_err(o, ro):.2e}"
    assert _rel_err(S, rS) <= TOL_BF16, f"S: {_rel_err(S, rS):.2e}"
    # the modes differ: with float32 operands the state is far closer to float64
    _, S32 = RULES[rule][0].chunked(q, k, v, beta, g, chunk_size=C, initial_state=S0,
                                    operands="float32")
    assert _rel_err(S32, rS) <= TOL_F64 < _rel_err(S, rS)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rule", list(RULES))
def test_half_inputs_with_float32_operands(rule, dtype):
    """Half inputs, float32 operands: only o is rounded (to the inputs' dtype); the state is float32
    throughout. float16 inputs default to this mode."""
    q, k, v, beta, g, S0 = _inputs(rule, 1, 2, 37, 16, 16, dtype, seed=2)
    mod = RULES[rule][0]
    o, S = mod.chunked(q, k, v, beta, g, chunk_size=16, initial_state=S0, operands="float32")
    assert o.dtype == dtype and S.dtype == torch.float32
    ro, rS = _loop64(rule, q, k, v, beta, g, S0)
    assert _rel_err(o, ro) <= 1e-2 and _rel_err(S, rS) <= TOL_F64
    if dtype == torch.float16:
        assert torch.equal(mod.chunked(q, k, v, beta, g, chunk_size=16, initial_state=S0)[0], o)


# -- KDA's guarantee: gates down to −5 per step ---------------------------------------------------

def _stress_gates(B, H, T, Dk, seed=3):
    """g in [−5, 0], a whole chunk (tokens 64..127) at −5 in every channel, four long-lived
    channels near 0, and in head 1 four channels at −5 throughout."""
    gen = torch.Generator().manual_seed(seed)
    g = -5.0 * torch.rand(B, H, T, Dk, generator=gen)
    g[:, :, 64:128] = -5.0
    g[..., :4] = -1e-3 * torch.rand(B, H, T, 4, generator=gen)
    g[:, 1, :, 4:8] = -5.0
    return g


@needs_triton
@pytest.mark.parametrize("C", [16, 32, 64])
def test_kda_gate_stress_is_finite_and_accurate(C):
    """exp(−Σg) over a 64-token chunk at g = −5 is e^320 (inf in float32): the naive factorised
    scores fail; the kernel's 16-token sub-chunks with reference points hold."""
    B, H, T, Dk, Dv = 1, 2, 150, 32, 16
    q, k, v, beta, S0 = delta_rule_inputs(B, H, T, Dk, Dv, seed=4)
    g = _stress_gates(B, H, T, Dk)
    ro, rS = _loop64("kda", q, k, v, beta, g, S0)
    o, S = kk.chunked(q, k, v, beta, g, chunk_size=C, initial_state=S0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert _rel_err(o, ro) <= TOL_F64, f"o: {_rel_err(o, ro):.2e}"
    assert _rel_err(S, rS) <= TOL_F64, f"S: {_rel_err(S, rS):.2e}"
    ob, Sb = kk.chunked(q, k, v, beta, g, chunk_size=C, initial_state=S0, operands="bfloat16")
    assert _rel_err(ob, ro) <= TOL_BF16 and _rel_err(Sb, rS) <= TOL_BF16
    # what the sub-chunks avoid: one factorisation over the whole chunk overflows
    G = g[:, :, 64:128].double().cumsum(2).float()
    assert not torch.isfinite(torch.exp(-G)).all()


@needs_triton
def test_kda_below_the_guarantee():
    """A sub-chunk whose gates sum below −80 is refused with a pointer to the op; a single step
    below −5 that keeps every sub-chunk above −80 is accepted and accurate (the check is the
    exact condition, not g ≥ −5)."""
    B, H, T, Dk, Dv = 1, 1, 40, 16, 16
    q, k, v, beta, S0 = delta_rule_inputs(B, H, T, Dk, Dv, seed=5)
    g = -0.5 * torch.rand(B, H, T, Dk, generator=torch.Generator().manual_seed(6))
    g[0, 0, 20, 3] = -40.0  # sub-chunk 16..31 now sums to about −44 in channel 3
    o, S = kk.chunked(q, k, v, beta, g, chunk_size=32, initial_state=S0)
    ro, rS = _loop64("kda", q, k, v, beta, g, S0)
    assert _rel_err(o, ro) <= TOL_F64 and _rel_err(S, rS) <= TOL_F64
    g[0, 0, 16:32, 5] = -6.0  # 16 × −6 = −96 < −80
    with pytest.raises(ValueError, match=r"sum to -96.*tinyk3\.ops\.kda\.chunked"):
        kk.chunked(q, k, v, beta, g, chunk_size=32)
    po, _ = ops_kda.chunked(q, k, v, beta, g, chunk_size=32)  # the op handles it
    assert torch.isfinite(po).all()


@needs_triton
def test_gated_deltanet_takes_any_gate():
    """One gate per head: every factor the kernel forms is exp(G_i − G_j) ≤ 1 with the exponent
    masked first, so even −50 per step stays finite and accurate."""
    q, k, v, beta, g, S0 = _inputs("gdn", 1, 2, 70, 16, 16, seed=8, low=-50.0)
    o, S = kg.chunked(q, k, v, beta, g, chunk_size=64, initial_state=S0)
    ro, rS = _loop64("gdn", q, k, v, beta, g, S0)
    assert _rel_err(o, ro) <= TOL_F64 and _rel_err(S, rS) <= TOL_F64


# -- reductions --------------------------------------------------------------------------------------

@needs_triton
def test_kda_with_equal_channels_is_the_gated_deltanet_kernel():
    q, k, v, beta, g, S0 = _inputs("gdn", 1, 2, 45, 20, 12, seed=9, low=-2.0)
    o1, S1 = kg.chunked(q, k, v, beta, g, chunk_size=32, initial_state=S0)
    o2, S2 = kk.chunked(q, k, v, beta, g.unsqueeze(-1).expand(*g.shape, 20), chunk_size=32,
                        initial_state=S0)
    assert _rel_err(o2, o1) <= TOL_SAME and _rel_err(S2, S1) <= TOL_SAME


@needs_triton
@pytest.mark.parametrize("rule", list(RULES))
def test_zero_gate_is_chapter_9s_kernel(rule):
    q, k, v, beta, g, S0 = _inputs(rule, 1, 2, 45, 20, 12, seed=10)
    o, S = RULES[rule][0].chunked(q, k, v, beta, torch.zeros_like(g), chunk_size=16, initial_state=S0)
    ro, rS = kd.chunked(q, k, v, beta, chunk_size=16, initial_state=S0)
    assert _rel_err(o, ro) <= TOL_SAME and _rel_err(S, rS) <= TOL_SAME


# -- the stages ------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("rule", list(RULES))
def test_each_stage_equals_its_equation(rule):
    """Stage 1 writes W = 𝒯 (K ⊙ γ) and U = 𝒯 V with the decayed scores (ops' decay_mask /
    pair_scores); stage 2 every S_[c] and U' = U − W S_[c] with the decayed state update."""
    B, H, T, Dk, Dv, C = 1, 1, 50, 16, 16, 32
    q, k, v, beta, g, S0 = _inputs(rule, B, H, T, Dk, Dv, seed=11, low=-3.0)
    st = (kg if rule == "gdn" else kk).forward_stages(q, k, v, beta, g, chunk_size=C,
                                                     initial_state=S0)
    N, pad = -(-T // C), (-T) % C
    f = [t.double() for t in (k, v, g)]

    def chunks(x):  # [B, H, T, ...] -> [N, C, ...] (B = H = 1), zero-padded
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(N, C, *x.shape[3:])

    K, V, gc = (chunks(t) for t in f)
    b = chunks(beta.double().unsqueeze(-1))
    if rule == "gdn":
        G = gc.cumsum(1)  # [N, C]
        A = (K @ K.transpose(-1, -2)) * ops_gdn.decay_mask(G, strict=True)
        gamma, end = torch.exp(G).unsqueeze(-1), torch.exp(G[:, -1:] - G).unsqueeze(-1)
        decay = torch.exp(G[:, -1])[:, None, None]
    else:
        s = ops_kda.SUB_CHUNK
        L = gc.reshape(N, C // s, s, Dk).cumsum(2)
        r = torch.cat([torch.zeros_like(L[:, :1, -1:]), L[:, :-1, -1:].cumsum(1)], dim=1)
        A = ops_kda.pair_scores(K.reshape(N, C // s, s, Dk), K.reshape(N, C // s, s, Dk), L, r,
                                strict=True)
        G = (r + L).reshape(N, C, Dk)
        gamma, end, decay = torch.exp(G), torch.exp(G[:, -1:] - G), torch.exp(G[:, -1]).unsqueeze(-1)
    Tg = ut_transform(A, b)
    W, U = Tg @ (gamma * K), Tg @ V
    assert _rel_err(chunks(st["w"]), W) <= TOL_F64 and _rel_err(chunks(st["u"]), U) <= TOL_F64
    S = S0[0, 0].double()
    for c in range(N):
        assert _rel_err(st["states"][0, 0, c], S) <= TOL_F64, f"S_[{c}]"
        du = U[c] - W[c] @ S
        assert _rel_err(chunks(st["u_new"])[c], du) <= TOL_F64, f"U' at chunk {c}"
        S = decay[c] * S + (end[c] * K[c]).T @ du
    assert _rel_err(st["S"][0, 0], S) <= TOL_F64


@needs_triton
@pytest.mark.parametrize("rule", list(RULES))
def test_smaller_tiles_split_the_work_and_change_nothing(rule):
    """Dk = 40 walked in three blocks of BK = 16 in stages 1 and 3 (the last partial: KDA's gate
    tiles are formed block by block), Dv = 24 split over two state-pass programs (BV = 16)."""
    B, H, T, Dk, Dv, C = 1, 2, 45, 40, 24, 32
    q, k, v, beta, g, S0 = _inputs(rule, B, H, T, Dk, Dv, seed=16, low=-3.0)
    mod = RULES[rule][0]
    opts = dict(num_warps=4, num_stages=1)
    small = {"wy": dict(BK=16, BV=16, **opts), "state": dict(BK=64, BV=16, **opts),
             "output": dict(BK=16, BV=16, **opts)}
    split = mod.forward_stages(q, k, v, beta, g, chunk_size=C, initial_state=S0, config=small)
    default = mod.forward_stages(q, k, v, beta, g, chunk_size=C, initial_state=S0)
    for name in default:
        assert _rel_err(split[name], default[name]) <= TOL_SAME, name
    ro, rS = _loop64(rule, q, k, v, beta, g, S0)
    assert _rel_err(split["o"], ro) <= TOL_F64 and _rel_err(split["S"], rS) <= TOL_F64


@needs_triton
@pytest.mark.parametrize("rule", list(RULES))
def test_bf16_mode_stores_bfloat16_values(rule):
    q, k, v, beta, g, S0 = _inputs(rule, 1, 2, 40, 24, 16, seed=12)
    mod = kg if rule == "gdn" else kk
    st = mod.forward_stages(q, k, v, beta, g, chunk_size=16, initial_state=S0, operands="bfloat16")
    for name in ("w", "u", "states", "u_new"):
        assert st[name].dtype == torch.float32 and torch.equal(st[name], st[name].bfloat16().float()), name
    f32 = mod.forward_stages(q, k, v, beta, g, chunk_size=16, initial_state=S0)
    assert not torch.equal(f32["w"], f32["w"].bfloat16().float())


@needs_triton
def test_empty_sequence_and_split_sequence():
    q, k, v, beta, g, S0 = _inputs("kda", 1, 2, 0, 16, 16)
    o, S = kk.chunked(q, k, v, beta, g, chunk_size=16, initial_state=S0)
    assert o.shape == (1, 2, 0, 16) and torch.equal(S, S0) and S is not S0
    q, k, v, beta, g, S0 = _inputs("gdn", 1, 2, 50, 16, 16, seed=13)
    o, S = kg.chunked(q, k, v, beta, g, chunk_size=16, initial_state=S0)
    cut = [t[:, :, :21] for t in (q, k, v, beta, g)], [t[:, :, 21:] for t in (q, k, v, beta, g)]
    o1, mid = kg.chunked(*cut[0], chunk_size=16, initial_state=S0)
    o2, S2 = kg.chunked(*cut[1], chunk_size=16, initial_state=mid)
    assert _rel_err(torch.cat([o1, o2], dim=2), o) <= TOL_SAME and _rel_err(S2, S) <= TOL_SAME


# -- gradients ---------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("rule", list(RULES))
def test_backward_kernels_equal_the_float64_backward(rule):
    """The backward runs as Triton kernels (chapter 21): through autograd, its gradients (g's
    included, with the incoming dS) equal the op's float64 ones to float32 round-off.
    tests/test_kernels_backward.py has the stage-by-stage and stress checks."""
    kern, ops = RULES[rule]
    q, k, v, beta, g, S0 = _inputs(rule, 1, 1, 37, 16, 16, seed=14)
    gen = torch.Generator().manual_seed(15)
    go, gS = torch.randn(1, 1, 37, 16, generator=gen), torch.randn(1, 1, 16, 16, generator=gen)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v, beta, g, S0)]
        o, S = fn(*leaves[:5], chunk_size=16, initial_state=leaves[5])
        ((o * go.to(dtype)).sum() + (S * gS.to(dtype)).sum()).backward()
        return [t.grad for t in leaves]

    got, ref = grads(kern.chunked, torch.float32), grads(ops.chunked, torch.float64)
    for name, a, b in zip(["q", "k", "v", "beta", "g", "S0"], got, ref):
        assert a is not None and _rel_err(a, b) <= TOL_F64, (name, _rel_err(a, b))
    v_only = v.clone().requires_grad_()
    kern.chunked(q, k, v_only, beta, g, chunk_size=16)[0].sum().backward()
    assert v_only.grad is not None and q.grad is None


# -- compiled for real GPUs, without one --------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("rule", list(RULES))
def test_compiles_for_gpu_targets(rule, arch, tmp_path, monkeypatch):
    """Triton IR → PTX → cubin for each stage, with ptxas' registers and spills. Small tiles keep
    it to about a second a kernel; the record benchmarks/2026-12-02-ptxas-gated/ has C = 64,
    D = 128 (tools/gpu_check_kernels.py --ptxas-record)."""
    reason = kd.cannot_compile_reason()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from a cache
    mod = kg if rule == "gdn" else kk
    target = "sm_90a" if arch == 90 else "sm_80"
    for operands in ("bfloat16", "float32"):
        out = mod.compile_for_gpu(arch, chunk_size=32, Dk=32, Dv=32, dtype=torch.bfloat16,
                                  operands=operands, input_precision="tf32")
        assert set(out) == {"_wy_kernel", "_state_kernel", "_output_kernel"}
        for name, compiled in out.items():
            assert f".target {target}" in compiled.asm["ptx"], name
            assert compiled.asm["cubin"][:4] == b"\x7fELF", name
            report = runtime.ptxas_report(compiled.asm["ptx"])
            assert 0 < report["registers"] <= 255, (name, report["text"])
            assert report["spill_stores"] == report["spill_loads"] == 0, (name, report["text"])
            if operands == "bfloat16":  # bf16 tensor-core products, float32 accumulators
                mma = [x for x in compiled.asm["ptx"].splitlines() if "mma" in x and ".bf16" in x]
                assert mma and all(".f32" in x for x in mma), name


# -- misuse ------------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("rule", list(RULES))
def test_bad_inputs_fail_clearly(rule):
    mod = RULES[rule][0]
    q, k, v, beta, g, _ = _inputs(rule, 1, 2, 8, 16, 16)
    name = "gated_delta_rule" if rule == "gdn" else "kda"
    with pytest.raises(TypeError, match=f"tinyk3.ops.{name}.chunked for float64"):
        mod.chunked(*(t.double() for t in (q, k, v, beta, g)), chunk_size=16)
    with pytest.raises(ValueError, match="g .the log decay. must have shape"):
        mod.chunked(q, k, v, beta, g[:, :, :4], chunk_size=16)
    wrong = g[..., 0] if rule == "kda" else g.unsqueeze(-1).expand(1, 2, 8, 16)
    with pytest.raises(ValueError, match="must have shape"):
        mod.chunked(q, k, v, beta, wrong, chunk_size=16)
    with pytest.raises(TypeError, match="g must have the dtype of q"):
        mod.chunked(q, k, v, beta, g.half(), chunk_size=16)
    with pytest.raises(ValueError, match="must be <= 0"):
        mod.chunked(q, k, v, beta, -g + 0.1, chunk_size=16)
    with pytest.raises(ValueError, match="non-finite"):
        mod.chunked(q, k, v, beta, torch.full_like(g, float("nan")), chunk_size=16)
    for kwargs, match in [(dict(chunk_size=48), "chunk_size must be one of"),
                          (dict(operands="bf16"), "operands must be one of"),
                          (dict(input_precision="fast"), "input_precision must be one of"),
                          (dict(initial_state=torch.zeros(1, 2, 16, 8)), "initial_state must have shape")]:
        with pytest.raises(ValueError, match=match):
            mod.chunked(q, k, v, beta, g, **kwargs)
    big = torch.randn(1, 1, 8, 256)
    with pytest.raises(ValueError, match="head dimensions must be 1..128"):
        mod.chunked(big, big, torch.randn(1, 1, 8, 16), torch.rand(1, 1, 8),
                    _gate(rule, 1, 1, 8, 256, -1.0, 0), chunk_size=16)
    meta = [t.to("meta") for t in (q, k, v, beta)]
    with pytest.raises(ValueError, match="g is on meta, the inputs on cpu"):
        mod.chunked(q, k, v, beta, g.to("meta"), chunk_size=16)
    with pytest.raises(ValueError, match="CUDA device .* or the CPU"):
        mod.chunked(*meta, g.to("meta"), chunk_size=16)


@needs_triton
def test_with_triton_interpret_set_at_import():
    """The usual way (TRITON_INTERPRET=1 before triton is imported): triton's own combine
    functions are then interpreter objects, which the gate scans must accept too."""
    code = textwrap.dedent("""
        import torch, triton
        from tinyk3.kernels import gated_delta_rule as kg, kda as kk
        from tinyk3.ops import gated_delta_rule, kda
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 37, 32, generator=gen)
        k = torch.nn.functional.normalize(torch.randn(1, 2, 37, 32, generator=gen), dim=-1)
        v, beta = torch.randn(1, 2, 37, 16, generator=gen), torch.rand(1, 2, 37, generator=gen)
        g = -3 * torch.rand(1, 2, 37, 32, generator=gen)
        errs = []
        for kern, op, gate in ((kg, gated_delta_rule, g[..., 0]), (kk, kda, g)):
            o, S = kern.chunked(q, k, v, beta, gate, chunk_size=32)
            ro, rS = op.chunked(q.double(), k.double(), v.double(), beta.double(), gate.double())
            errs += [(o - ro).abs().max().item(), (S - rS).abs().max().item()]
        print(kg.gated.runtime.interpreter_only(), max(errs))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**SUBPROCESS_ENV, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    flag, err = r.stdout.split()
    assert flag == "True" and float(err) <= 1e-5  # absolute; max |o| ≈ 3 here


def test_without_triton_imports_and_fails_clearly():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None
        import torch, tinyk3.kernels as K
        from tinyk3.kernels import gated_delta_rule as kg, kda as kk
        assert K.AVAILABLE is False
        q = torch.randn(1, 1, 4, 16)
        for fn, g in ((kg.chunked, -torch.rand(1, 1, 4)), (kk.chunked, -torch.rand(1, 1, 4, 16))):
            try:
                fn(q, q, q, torch.rand(1, 1, 4), g, chunk_size=16)
            except K.TritonUnavailableError as e:
                print("ERROR:", e)
            else:
                raise SystemExit("no error raised")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=SUBPROCESS_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    errors = r.stdout.split("ERROR:")[1:]
    assert len(errors) == 2 and all("needs Triton" in e and "pip install" in e for e in errors)
    assert "gated_delta_rule.chunked" in errors[0] and "kda.chunked" in errors[1]


@needs_triton
def test_gpu_check_script_gated_smoke_on_cpu(tmp_path):
    """tools/gpu_check_kernels.py's gated forms in --device cpu mode (interpreter, tiny)."""
    out = tmp_path / "g.json"
    proc = subprocess.run([sys.executable, "tools/gpu_check_kernels.py", "--device", "cpu", "--quick",
                           "--rules", "gated_delta_rule", "kda", "--json", str(out)], cwd=ROOT,
                          env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ALL CHECKS PASSED" in proc.stdout
    report = json.loads(out.read_text())
    rules = {row.get("rule") for row in report["correctness"]}
    assert {"gated_delta_rule", "kda"} <= rules and "delta_rule" not in rules
    assert {row.get("rule") for row in report["timings"]} >= {"gated_delta_rule", "kda"}
    assert all(row["passed"] for row in report["correctness"] if "passed" in row)
    # the backward kernels (chapter 21): the record's fixed fields (RECORD_FORMAT 2)
    assert report["format"] == 2 and report["passed"] is True
    back = report["backward_correctness"]
    assert {row["rule"] for row in back} == {"gated_delta_rule", "kda"}
    assert any(row["stress"] for row in back) and all(row["passed"] for row in back)
    for row in back:
        assert set(row) == {"rule", "shape", "C", "dtype", "precision", "stress", "err", "tol",
                            "finite", "passed"}
        assert set(row["err"]) == {"dq", "dk", "dv", "dbeta", "dg", "d_initial_state"}
    timed = [row for row in report["backward_timings"] if "method" in row]
    assert {row["method"] for row in timed} >= {"kernel bf16", "pytorch chunked"}
    assert all(set(row) == {"rule", "T", "B", "H", "D", "method", "ms_fwd_bwd", "peak_mib"}
               for row in timed)

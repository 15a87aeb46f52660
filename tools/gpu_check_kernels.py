"""Check tinyk3.kernels on a real GPU: the COMPILED kernels of chapter 9 (delta_rule) and of
chapters 10-11 (gated_delta_rule, kda) against float64 references (and fla's kernels, if
installed), then timings against fla.

The test suite can only run the kernels under the Triton interpreter and compile them for
sm_80 / sm_90 without running them; this script is the check that needs a GPU.

    python tools/gpu_check_kernels.py                # correctness + timings on cuda:0
    python tools/gpu_check_kernels.py --quick        # chunk size 64 only, one T for timings
    python tools/gpu_check_kernels.py --sweep        # also time launch configs of the state pass
    python tools/gpu_check_kernels.py --json out.json
    python tools/gpu_check_kernels.py --device cpu   # smoke test of this script (interpreter, tiny)
    python tools/gpu_check_kernels.py --rules kda    # one rule only (delta_rule, gated_delta_rule, kda)
    python tools/gpu_check_kernels.py --ptxas-record benchmarks/2026-12-02-ptxas-gated
                                                     # no GPU needed: compile the gated stages for
                                                     # sm_80/sm_90, write registers/spills/shared
    python tools/gpu_check_kernels.py --ptxas-record-backward benchmarks/2026-12-03-ptxas-backward
                                                     # the same for the backward kernels
    python tools/gpu_check_kernels.py --forward-only # skip the backward checks (chapter 21)

On a GPU the results are written to ``benchmarks/<date>-gpu-kernels/gpu_check.json`` unless
``--json`` names another file (one unattended command: ``python tools/gpu_check_kernels.py``).

Needs torch with CUDA and triton (``pip install triton``); fla is optional
(``pip install flash-linear-attention``). Exit status 1 if a correctness check fails.

What it reports:
1. errors of the kernel against ``tinyk3.ops.delta_rule.chunked`` run in float64 on the same
   inputs, for float32 inputs with ``input_precision`` "ieee" (bound 1e-5: float32 round-off)
   and "tf32" (bound 1e-2), bfloat16 inputs in both operand modes (``operands="bfloat16"``,
   the default for them and fla's design, bound 2e-2; ``"float32"`` with tf32, bound 2e-2: o is
   rounded to 8 bits) and float16 inputs (float32 operands, tf32), fused and unfused, several
   chunk sizes, T not a multiple of C, Dk ≠ Dv, and a head size that is not a power of two;
   fla's output on the same inputs
   (``scale=1.0``: fla scales q by Dk^-0.5 by default; layout [B, T, H, D]).
2. forward time (triton.testing.do_bench, median ms) of: the kernel (bf16 operands; float32
   operands with tf32 and ieee; fused and not), the PyTorch chunked form, causal softmax
   attention (SDPA) at the same shapes, fla's chunk_delta_rule (and the kernel's throughput as a
   multiple of fla's); and the share of each stage's kernel in the kernel's time (torch.profiler).
3. The gated rules (``gated_delta_rule_checks``): the compiled kernels against the float64 token
   loop (``ops.gated_delta_rule.recurrent`` / ``ops.kda.recurrent``) in every mode (bounds as
   above), KDA's gate-stress case (gates in [−5, 0], a whole chunk at −5) at C = 16, 32, 64,
   fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` on the same inputs
   (layout [B, T, H, D], ``scale=1.0``, ``g`` before ``beta``); forward times at bf16, B 4, H 16,
   D 128, T 2048-16384 of our kernels (bf16 and tf32 operands), the PyTorch op and fla's kernel,
   with the throughput ratio (ours / fla's) printed.
4. The backward kernels (chapter 21, all three rules; ``--forward-only`` skips them): gradients
   by autograd through the compiled ``kernels.<rule>.chunked`` (whose backward launches
   ``tinyk3.kernels.backward``) against the float64 token loop's adjoint
   (``ops.<rule>.recurrent_backward``) on the same inputs, float32 (ieee, bound 1e-5) and bf16
   operands (bound 3e-2), C 16-64, the gate-stress case at −5 per step; then forward + backward
   time and peak memory at bf16, B 4, H 16, D 128, T 2048-16384 of our kernels, the PyTorch
   chunked form (derived backward) and fla's ``chunk_delta_rule`` / ``chunk_gated_delta_rule`` /
   ``chunk_kda`` (fla's own Triton backward).

The JSON record (``RECORD_FORMAT = 2``): ``format``, ``env`` (python, torch, triton, device,
capability, fla), ``rules``, ``correctness`` and ``timings`` (1-3; rows as printed),
``backward_correctness`` (rows: ``rule, shape [B, H, T, D], C, dtype, precision, stress, err``
(dict of the six gradients' errors), ``tol, finite, passed``), ``backward_timings`` (rows:
``rule, T, B, H, D, method, ms_fwd_bwd, peak_mib``, and ``rule, T, throughput_vs_fla``), and
``passed``. ``tests/test_kernels_backward.py`` pins these fields on a CPU dry run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))  # run from a checkout

from tinyk3.kernels import AVAILABLE, REASON  # noqa: E402

if not AVAILABLE:
    sys.exit(f"tinyk3.kernels unavailable: {REASON}")

import triton  # noqa: E402

from tinyk3.kernels import delta_rule as kd  # noqa: E402
from tinyk3.kernels import gated as kgated  # noqa: E402
from tinyk3.kernels import gated_delta_rule as kgdn  # noqa: E402
from tinyk3.kernels import kda as kkda  # noqa: E402
from tinyk3.kernels import runtime  # noqa: E402
from tinyk3.ops import delta_rule as ops  # noqa: E402
from tinyk3.ops import gated_delta_rule as ops_gdn  # noqa: E402
from tinyk3.ops import kda as ops_kda  # noqa: E402

try:  # fla-core 0.6: chunk_delta_rule(q, k, v, beta, scale, initial_state, output_final_state)
    from fla.ops.delta_rule import chunk_delta_rule as fla_chunk_delta_rule
except Exception:  # not installed, or broken on this machine
    fla_chunk_delta_rule = None
try:  # fla-core 0.6: chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gdn
except Exception:
    fla_chunk_gdn = None
try:  # fla-core 0.6: chunk_kda(q, k, v, g [B, T, H, K], beta, scale, initial_state, output_final_state)
    from fla.ops.kda import chunk_kda as fla_chunk_kda
except Exception:
    fla_chunk_kda = None

RECORD_FORMAT = 2  # the JSON record's layout (module docstring); 2 added the backward sections
TOL = {("float32", "ieee"): (1e-5, 1e-5), ("float32", "tf32"): (1e-2, 1e-2),
       ("bfloat16", "tf32"): (2e-2, 1e-2), ("float16", "tf32"): (2e-2, 1e-2),
       ("bfloat16", "bf16"): (2e-2, 2e-2)}


def inputs(B, H, T, Dk, Dv, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, Dk, generator=g), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g)
    beta = torch.rand(B, H, T, generator=g)
    S0 = torch.randn(B, H, Dk, Dv, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, beta)] + [S0.to(device)]


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def correctness(device, quick):
    big = (2, 4, 1000, 128, 128) if device == "cuda" else (1, 2, 70, 32, 32)
    odd = (1, 2, 37, 20, 12)
    cases = []  # (shape, C, dtype, precision, fuse, operands)
    for C in ((64,) if quick else (16, 32, 64)):
        for shape in (big, odd):
            for fuse in (False, True):
                cases.append((shape, C, torch.float32, "ieee", fuse, None))
                cases.append((shape, C, torch.bfloat16, None, fuse, None))  # bf16 operands
    for fuse in (False, True):
        cases.append((big, 64, torch.float32, "tf32", fuse, None))
        cases.append((big, 64, torch.bfloat16, "tf32", fuse, "float32"))
    cases.append((big, 64, torch.float16, None, False, None))
    rows, ok = [], True
    for shape, C, dtype, prec, fuse, operands in cases:
        q, k, v, beta, S0 = inputs(*shape, dtype, device)
        o, S = kd.chunked(q, k, v, beta, chunk_size=C, initial_state=S0, input_precision=prec,
                          fuse_output=fuse, operands=operands)
        ro, rS = ops.chunked(*(t.double() for t in (q, k, v, beta)), chunk_size=C,
                             initial_state=S0.double())
        name = str(dtype).split(".")[1]
        bf16_ops = operands == "bfloat16" or (operands is None and dtype == torch.bfloat16)
        mode = "bf16" if bf16_ops else prec or ("ieee" if dtype == torch.float32 else "tf32")
        prec = mode
        tol_o, tol_S = TOL[(name, mode)]
        eo, eS = rel_err(o, ro), rel_err(S, rS)
        passed = eo <= tol_o and eS <= tol_S
        ok &= passed
        row = dict(shape=shape, C=C, dtype=name, precision=prec or "default", fused=fuse,
                   err_o=eo, err_S=eS, tol_o=tol_o, tol_S=tol_S, passed=passed)
        rows.append(row)
        print(f"  {str(shape):24} C={C:<3} {name:9} {row['precision']:8} fused={fuse!s:5} "
              f"o {eo:.1e}  S {eS:.1e}  {'ok' if passed else 'FAIL'}")

    if fla_chunk_delta_rule is not None and device == "cuda":
        q, k, v, beta, S0 = inputs(*big, torch.bfloat16, device, seed=2)
        o, S = kd.chunked(q, k, v, beta, chunk_size=64, initial_state=S0)
        fo, fS = fla_chunk_delta_rule(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      beta.transpose(1, 2), scale=1.0, initial_state=S0,
                                      output_final_state=True)
        eo, eS = rel_err(fo.transpose(1, 2), o), rel_err(fS, S)
        print(f"  fla chunk_delta_rule vs kernel (bf16 operands, both): o {eo:.1e}  S {eS:.1e} "
              "(the same rounding points up to where β is applied: expect ~1e-2)")
        rows.append(dict(check="fla", err_o=eo, err_S=eS))
    return rows, ok


def bench(fn, device):
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100)
    import time

    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def timings(device, quick, sweep):
    B, H, D = (4, 16, 128) if device == "cuda" else (1, 2, 32)
    Ts = ((4096,) if quick else (1024, 4096, 16384)) if device == "cuda" else (64,)
    rows = []
    for T in Ts:
        q, k, v, beta, S0 = inputs(B, H, T, D, D, torch.bfloat16, device)
        methods = forward_methods(q, k, v, beta, S0, device)
        with torch.no_grad():
            for name, fn in methods.items():
                ms = bench(fn, device)
                rows.append(dict(T=T, B=B, H=H, D=D, method=name, ms=ms, tokens_per_ms=B * T / ms))
                print(f"  T={T:<6} {name:22} {ms:9.3f} ms   {B * T / ms:10.0f} tokens/ms")
            times = {r["method"]: r["ms"] for r in rows if r.get("T") == T and "method" in r}
            if "fla chunk_delta_rule" in times:  # the target: >= 0.7x fla's throughput
                ratio = times["fla chunk_delta_rule"] / times["kernel bf16"]
                print(f"  T={T:<6} kernel bf16 throughput / fla chunk_delta_rule: {ratio:.2f}x")
                rows.append(dict(T=T, throughput_vs_fla=ratio))
            if device == "cuda":
                rows.append(stage_shares(methods["kernel bf16"], T))
            if sweep and device == "cuda":
                rows += sweep_state_pass(q, k, v, beta, S0, T)
    return rows


def forward_methods(q, k, v, beta, S0, device):
    """The forwards to time, on the same bf16 inputs ([B, H, T, D]; fla gets [B, T, H, D])."""
    f32 = dict(operands="float32")
    methods = {
        "kernel bf16": lambda: kd.chunked(q, k, v, beta, initial_state=S0, operands="bfloat16"),
        "kernel bf16 fused": lambda: kd.chunked(q, k, v, beta, initial_state=S0,
                                                operands="bfloat16", fuse_output=True),
        "kernel tf32": lambda: kd.chunked(q, k, v, beta, initial_state=S0, input_precision="tf32",
                                          **f32),
        "kernel ieee": lambda: kd.chunked(q, k, v, beta, initial_state=S0, input_precision="ieee",
                                          **f32),
        "pytorch chunked": lambda: ops.chunked(q, k, v, beta, initial_state=S0),
        # the quadratic baseline at the same shapes: causal softmax attention
        "sdpa causal": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    if fla_chunk_delta_rule is not None and device == "cuda":
        qt, kt, vt, bt = (t.transpose(1, 2).contiguous() for t in (q, k, v, beta))
        methods["fla chunk_delta_rule"] = lambda: fla_chunk_delta_rule(
            qt, kt, vt, bt, scale=1.0, initial_state=S0, output_final_state=True)
    return methods


def stage_shares(fn, T):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.key_averages():
        for stage in ("_wy_kernel", "_state_kernel", "_output_kernel"):
            if stage in ev.key:
                times[stage] = times.get(stage, 0.0) + getattr(ev, "device_time_total", 0.0)
    total = sum(times.values()) or 1.0
    print("    stage shares (bf16 operands): " + ", ".join(f"{k} {v / total:.0%}" for k, v in times.items()))
    return dict(T=T, stage_shares={k: v / total for k, v in times.items()})


def sweep_state_pass(q, k, v, beta, S0, T):
    rows = []
    base = kd.launch_config(64, q.shape[-1], v.shape[-1])
    for BV in (16, 32, 64):
        for warps in (4, 8):
            for stages in (1, 2, 3):
                cfg = {**base, "state": dict(base["state"], BV=BV, num_warps=warps, num_stages=stages)}
                try:
                    ms = bench(lambda cfg=cfg: kd.forward_stages(q, k, v, beta, initial_state=S0,
                                                                 config=cfg), "cuda")
                except Exception as exc:  # e.g. out of shared memory on smaller GPUs
                    print(f"    state pass BV={BV} warps={warps} stages={stages}: {type(exc).__name__}")
                    continue
                rows.append(dict(T=T, sweep="state", BV=BV, num_warps=warps, num_stages=stages, ms=ms))
                print(f"    state pass BV={BV:<3} warps={warps} stages={stages}: {ms:8.3f} ms "
                      "(whole forward)")
    return rows


# ---------------------------------------------------------------------------------------------
# The gated rules (chapters 10 and 11)
# ---------------------------------------------------------------------------------------------

GATED = {"gated_delta_rule": (kgdn, ops_gdn), "kda": (kkda, ops_kda)}


def gated_inputs(rule, B, H, T, Dk, Dv, dtype, device, seed=0, stress=False):
    """q, k, v, beta as for chapter 9, the gates as Kimi K3's lower-bound gate makes them
    (g = −5 sigmoid(x), in (−5, 0)); ``stress``: KDA gates uniform in [−5, 0] with a whole chunk
    (tokens 64..127) at −5 and four long-lived channels near 0."""
    q, k, v, beta, S0 = inputs(B, H, T, Dk, Dv, dtype, device, seed)
    gen = torch.Generator(device="cpu").manual_seed(seed + 100)
    shape = (B, H, T) if rule == "gated_delta_rule" else (B, H, T, Dk)
    if stress:
        g = -5.0 * torch.rand(shape, generator=gen)
        g[:, :, 64:128] = -5.0
        g[..., :4] = -1e-3 * torch.rand(*shape[:3], 4, generator=gen)
    else:
        g = -5.0 * torch.sigmoid(torch.randn(shape, generator=gen) - 2.0)
    return q, k, v, beta, g.to(device=device, dtype=dtype), S0


def gated_correctness(rule, device, quick):
    kern, op = GATED[rule]
    big = (2, 4, 1000, 128, 128) if device == "cuda" else (1, 2, 70, 32, 32)
    odd = (1, 2, 37, 20, 12)
    cases = []  # (shape, C, dtype, precision, operands, stress)
    for C in ((64,) if quick else (16, 32, 64)):
        for shape in (big, odd):
            cases.append((shape, C, torch.float32, "ieee", None, False))
            cases.append((shape, C, torch.bfloat16, None, None, False))  # bf16 operands
    cases.append((big, 64, torch.float32, "tf32", None, False))
    cases.append((big, 64, torch.bfloat16, "tf32", "float32", False))
    cases.append((big, 64, torch.float16, None, None, False))
    if rule == "kda":  # the guarantee: gates down to −5 per step, float32, every chunk size
        stress = (1, 2, 200, 128 if device == "cuda" else 32, 64 if device == "cuda" else 16)
        for C in ((64,) if quick else (16, 32, 64)):
            cases.append((stress, C, torch.float32, "ieee", None, True))
            cases.append((stress, C, torch.bfloat16, None, None, True))
    rows, ok = [], True
    for shape, C, dtype, prec, operands, stress in cases:
        q, k, v, beta, g, S0 = gated_inputs(rule, *shape, dtype, device, stress=stress)
        o, S = kern.chunked(q, k, v, beta, g, chunk_size=C, initial_state=S0, input_precision=prec,
                            operands=operands)
        ro, rS = op.recurrent(*(t.double() for t in (q, k, v, beta, g)), initial_state=S0.double())
        name = str(dtype).split(".")[1]
        bf16_ops = operands == "bfloat16" or (operands is None and dtype == torch.bfloat16)
        mode = "bf16" if bf16_ops else prec or ("ieee" if dtype == torch.float32 else "tf32")
        tol_o, tol_S = TOL[(name, mode)]
        eo, eS = rel_err(o, ro), rel_err(S, rS)
        finite = bool(torch.isfinite(o).all() and torch.isfinite(S).all())
        passed = finite and eo <= tol_o and eS <= tol_S
        ok &= passed
        rows.append(dict(rule=rule, shape=shape, C=C, dtype=name, precision=mode, stress=stress,
                         err_o=eo, err_S=eS, tol_o=tol_o, tol_S=tol_S, passed=passed))
        print(f"  {rule:16} {str(shape):24} C={C:<3} {name:9} {mode:5} {'stress' if stress else '':6} "
              f"o {eo:.1e}  S {eS:.1e}  {'ok' if passed else 'FAIL'}")

    fla_fn = fla_chunk_gdn if rule == "gated_delta_rule" else fla_chunk_kda
    if fla_fn is not None and device == "cuda":
        q, k, v, beta, g, S0 = gated_inputs(rule, *big, torch.bfloat16, device, seed=2)
        o, S = kern.chunked(q, k, v, beta, g, chunk_size=64, initial_state=S0)
        fo, fS = fla_fn(*(t.transpose(1, 2) for t in (q, k, v)), g=g.transpose(1, 2),
                        beta=beta.transpose(1, 2), scale=1.0, initial_state=S0,
                        output_final_state=True)
        eo, eS = rel_err(fo.transpose(1, 2), o), rel_err(fS, S)
        print(f"  {rule:16} fla vs kernel (bf16 inputs, both): o {eo:.1e}  S {eS:.1e} "
              "(rounding points differ: expect ~1e-2)")
        rows.append(dict(rule=rule, check="fla", err_o=eo, err_S=eS))
    return rows, ok


def gated_timings(rule, device, quick):
    B, H, D = (4, 16, 128) if device == "cuda" else (1, 2, 32)
    Ts = ((4096,) if quick else (2048, 4096, 8192, 16384)) if device == "cuda" else (64,)
    rows = []
    for T in Ts:
        q, k, v, beta, g, S0 = gated_inputs(rule, B, H, T, D, D, torch.bfloat16, device)
        methods = gated_methods(rule, q, k, v, beta, g, S0, device)
        times = {}
        with torch.no_grad():
            for name, fn in methods.items():
                try:
                    ms = bench(fn, device)
                except Exception as exc:  # e.g. out of memory for the PyTorch op at large T
                    print(f"  {rule:16} T={T:<6} {name:16} failed: {type(exc).__name__}: {exc}"[:200])
                    continue
                times[name] = ms
                rows.append(dict(rule=rule, T=T, B=B, H=H, D=D, method=name, ms=ms,
                                 tokens_per_ms=B * T / ms))
                print(f"  {rule:16} T={T:<6} {name:16} {ms:9.3f} ms   {B * T / ms:10.0f} tokens/ms")
        if "fla" in times and "kernel bf16" in times:
            ratio = times["fla"] / times["kernel bf16"]
            print(f"  {rule:16} T={T:<6} kernel bf16 throughput / fla: {ratio:.2f}x")
            rows.append(dict(rule=rule, T=T, throughput_vs_fla=ratio))
        if device == "cuda":
            rows.append(dict(stage_shares(methods["kernel bf16"], T), rule=rule))
    return rows


def gated_methods(rule, q, k, v, beta, g, S0, device):
    """The forwards to time, on the same bf16 inputs ([B, H, T, D]; fla gets [B, T, H, D])."""
    kern, op = GATED[rule]
    fla_fn = fla_chunk_gdn if rule == "gated_delta_rule" else fla_chunk_kda
    methods = {
        "kernel bf16": lambda: kern.chunked(q, k, v, beta, g, initial_state=S0, operands="bfloat16"),
        "kernel tf32": lambda: kern.chunked(q, k, v, beta, g, initial_state=S0, operands="float32",
                                            input_precision="tf32"),
        "pytorch chunked": lambda: op.chunked(q, k, v, beta, g, initial_state=S0),
    }
    if fla_fn is not None and device == "cuda":
        qt, kt, vt, gt, bt = (t.transpose(1, 2).contiguous() for t in (q, k, v, g, beta))
        methods["fla"] = lambda: fla_fn(qt, kt, vt, g=gt, beta=bt, scale=1.0, initial_state=S0,
                                        output_final_state=True)
    return methods


# ---------------------------------------------------------------------------------------------
# The backward kernels (chapter 21)
# ---------------------------------------------------------------------------------------------

BACKWARD_RULES = {"delta_rule": (kd, ops), "gated_delta_rule": (kgdn, ops_gdn), "kda": (kkda, ops_kda)}
FLA_FUNCTIONS = {"delta_rule": "fla_chunk_delta_rule", "gated_delta_rule": "fla_chunk_gdn",
                 "kda": "fla_chunk_kda"}
BACKWARD_TOL = {"ieee": 1e-5, "bf16": 3e-2}  # the unit tests' bounds (tests/test_kernels_backward.py)
GRAD_NAMES = ("dq", "dk", "dv", "dbeta", "dg", "d_initial_state")


def _rule_inputs(rule, B, H, T, D, dtype, device, seed=0, stress=False):
    """``(q, k, v, beta, g or None, S0)`` on ``device``; ``g`` as :func:`gated_inputs`."""
    if rule == "delta_rule":
        q, k, v, beta, S0 = inputs(B, H, T, D, D, dtype, device, seed)
        return q, k, v, beta, None, S0
    if rule == "kda" or not stress:
        return gated_inputs(rule, B, H, T, D, D, dtype, device, seed, stress=stress)
    q, k, v, beta, g, S0 = gated_inputs(rule, B, H, T, D, D, dtype, device, seed)
    g = torch.full_like(g, -5.0)  # Gated DeltaNet at the lower bound, a few tokens near 0
    g[:, :, :3] = -1e-3
    return q, k, v, beta, g, S0


def _through_kernels(rule, x, S0, d_o, d_state, C, operands):
    """Gradients of ⟨o, d_o⟩ + ⟨S_T, d_state⟩ by autograd through ``kernels.<rule>.chunked``
    (its backward is the Triton backward kernels), in GRAD_NAMES order."""
    kern = BACKWARD_RULES[rule][0]
    leaves = [t.detach().clone().requires_grad_() for t in x if t is not None]
    s0 = S0.detach().clone().requires_grad_()
    o, S = kern.chunked(*leaves, chunk_size=C, initial_state=s0, operands=operands)
    ((o.float() * d_o).sum() + (S * d_state).sum()).backward()
    grads = [t.grad for t in leaves]
    return grads[:4] + ([grads[4]] if len(grads) == 5 else [None]) + [s0.grad]


def backward_correctness(rule, device, quick):
    """Gradients through the compiled kernels against the float64 token loop's adjoint
    (``ops.<rule>.recurrent_backward`` on the same, possibly rounded, inputs). One row per case:
    ``rule, shape [B, H, T, D], C, dtype, precision, stress, err`` (a dict of the six gradients'
    errors, max |a − b| / max(1, max |b|)), ``tol, finite, passed``."""
    big = (2, 4, 1000, 128) if device == "cuda" else (1, 2, 40, 32)
    odd = (1, 2, 37, 20)
    cases = []  # (shape, C, dtype, stress)
    shapes = (big, odd) if device == "cuda" else (odd,)  # the CPU dry run: the odd shape only
    for C in ((64,) if quick else (16, 32, 64)):
        for shape in shapes:
            cases += [(shape, C, torch.float32, False), (shape, C, torch.bfloat16, False)]
    if rule != "delta_rule":  # gates at Kimi K3's lower bound, −5 per step
        stress = (1, 2, 200 if device == "cuda" else 40, 128 if device == "cuda" else 16)
        cases += [(stress, 64 if quick else C, dt, True) for C in ((64,) if quick else (16, 64))
                  for dt in (torch.float32, torch.bfloat16)]
    op = BACKWARD_RULES[rule][1]
    rows, ok = [], True
    for shape, C, dtype, stress in cases:
        B, H, T, D = shape
        q, k, v, beta, g, S0 = _rule_inputs(rule, B, H, T, D, dtype, device, seed=3, stress=stress)
        gen = torch.Generator(device="cpu").manual_seed(4)
        d_o = torch.randn(B, H, T, D, generator=gen).to(device)
        d_state = torch.randn(B, H, D, D, generator=gen).to(device)
        mode = "ieee" if dtype == torch.float32 else "bf16"
        got = _through_kernels(rule, (q, k, v, beta, g), S0, d_o, d_state, C,
                               "float32" if mode == "ieee" else "bfloat16")
        x64 = [t.double() for t in (q, k, v, beta, g) if t is not None]
        ref = op.recurrent_backward(*x64, d_o.double(), d_state.double(), initial_state=S0.double())
        ref = list(ref[:4]) + ([ref[4]] if g is not None else [None]) + [ref[-1]]
        errs = {n: rel_err(a, b) for n, a, b in zip(GRAD_NAMES, got, ref) if b is not None}
        finite = all(bool(torch.isfinite(a).all()) for a in got if a is not None)
        tol = BACKWARD_TOL[mode]
        passed = finite and max(errs.values()) <= tol
        ok &= passed
        name = str(dtype).split(".")[1]
        rows.append(dict(rule=rule, shape=list(shape), C=C, dtype=name, precision=mode,
                         stress=stress, err=errs, tol=tol, finite=finite, passed=passed))
        print(f"  {rule:16} {str(shape):20} C={C:<3} {name:9} {mode:4} {'stress' if stress else '':6} "
              f"worst {max(errs, key=errs.get)} {max(errs.values()):.1e}  {'ok' if passed else 'FAIL'}")
    return rows, ok


def backward_timings(rule, device, quick):
    """Forward + backward time (median ms) and peak memory of one training step's mixer call at
    bf16, B 4, H 16, D 128 (cuda), of: our kernels (bf16 operands), the PyTorch chunked form
    (derived backward), and fla's ``chunk_*`` (its own Triton backward), if installed. One row per
    (T, method): ``rule, T, B, H, D, method, ms_fwd_bwd, peak_mib`` (memory allocated during the
    step beyond the inputs, ``torch.cuda.max_memory_allocated``; None on the CPU), and a row
    ``throughput_vs_fla`` (fla's time / ours) where fla ran."""
    B, H, D = (4, 16, 128) if device == "cuda" else (1, 2, 32)
    Ts = ((4096,) if quick else (2048, 4096, 8192, 16384)) if device == "cuda" else (64,)
    kern, op = BACKWARD_RULES[rule]
    fla_fn = globals()[FLA_FUNCTIONS[rule]]
    rows = []
    for T in Ts:
        q, k, v, beta, g, S0 = _rule_inputs(rule, B, H, T, D, torch.bfloat16, device)
        x = [t for t in (q, k, v, beta, g) if t is not None]
        leaves = [t.detach().clone().requires_grad_() for t in x]
        d_o = torch.randn_like(v)

        def ours(leaves=leaves, S0=S0, d_o=d_o):
            o, _ = kern.chunked(*leaves, initial_state=S0, operands="bfloat16")
            o.backward(d_o)

        def pytorch(leaves=leaves, S0=S0, d_o=d_o):
            o, _ = op.chunked(*leaves, initial_state=S0)
            o.backward(d_o)

        methods = {"kernel bf16": ours, "pytorch chunked": pytorch}
        if fla_fn is not None and device == "cuda":
            tl_ = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in x]
            d_ot = d_o.transpose(1, 2).contiguous()

            def fla(tl_=tl_, S0=S0, d_ot=d_ot):
                if rule == "delta_rule":
                    o, _ = fla_fn(*tl_, scale=1.0, initial_state=S0, output_final_state=True)
                else:
                    qt, kt, vt, bt, gt = tl_
                    o, _ = fla_fn(qt, kt, vt, g=gt, beta=bt, scale=1.0, initial_state=S0,
                                  output_final_state=True)
                o.backward(d_ot)
            methods["fla"] = fla
        times = {}
        for name, fn in methods.items():
            try:
                peak = None
                if device == "cuda":
                    fn()
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    fn()
                    torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                ms = bench(fn, device)
            except Exception as exc:  # e.g. out of memory for the PyTorch form at long T
                print(f"  {rule:16} T={T:<6} {name:16} failed: {type(exc).__name__}: {exc}"[:200])
                continue
            times[name] = ms
            rows.append(dict(rule=rule, T=T, B=B, H=H, D=D, method=name, ms_fwd_bwd=ms,
                             peak_mib=peak))
            mem = "" if peak is None else f"   peak {peak:9.1f} MiB"
            print(f"  {rule:16} T={T:<6} {name:16} fwd+bwd {ms:9.3f} ms{mem}")
        if "fla" in times and "kernel bf16" in times:
            ratio = times["fla"] / times["kernel bf16"]
            print(f"  {rule:16} T={T:<6} kernel bf16 fwd+bwd throughput / fla: {ratio:.2f}x")
            rows.append(dict(rule=rule, T=T, throughput_vs_fla=ratio))
    return rows


def ptxas_record(out_dir: Path) -> None:
    """Compile the gated stages for sm_80 and sm_90 (no GPU needed) at C = 64, Dk = Dv = 128,
    bfloat16 inputs, bf16 operands and float32 operands (tf32), with the launch configuration the
    kernels use, and write ptxas' registers / spills / stack frame and Triton's shared memory."""
    import subprocess

    from tinyk3.bench import stamp

    reason = kd.cannot_compile_reason()
    if reason:
        sys.exit(f"cannot compile here: {reason}")
    rows = []
    for rule, gate in kgated.GATES.items():
        cfg = kgated.launch_config(64, 128, 128, gate)
        for arch in (80, 90):
            for operands, prec in (("bfloat16", "ieee"), ("float32", "tf32")):
                out = kgated.compile_for_gpu(gate, arch, chunk_size=64, Dk=128, Dv=128,
                                             dtype=torch.bfloat16, operands=operands,
                                             input_precision=prec)
                for name, compiled in out.items():
                    r = runtime.ptxas_report(compiled.asm["ptx"])
                    launch = cfg[{"_wy_kernel": "wy", "_state_kernel": "state",
                                  "_output_kernel": "output"}[name]]
                    row = dict(rule=rule, arch=f"sm_{arch}", operands=operands,
                               input_precision=None if operands == "bfloat16" else prec, stage=name,
                               **launch, registers=r["registers"], spill_stores=r["spill_stores"],
                               spill_loads=r["spill_loads"], stack_frame=r["stack_frame"],
                               shared=compiled.metadata.shared)
                    rows.append(row)
                    print(f"  {rule:16} sm_{arch} {operands:8} {name:15} regs {r['registers']:3}  "
                          f"spills {r['spill_stores']}/{r['spill_loads']} B  shared {row['shared']} B")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except OSError:
        commit = None
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stage_resources.json").write_text(json.dumps(dict(
        stamp=stamp(), commit=commit, triton=triton.__version__, torch=torch.__version__,
        C=64, Dk=128, Dv=128, inputs="bfloat16", rows=rows), indent=1))
    print(f"wrote {out_dir / 'stage_resources.json'}")


def ptxas_record_backward(out_dir: Path) -> None:
    """Compile the four backward kernels of each rule for sm_80 and sm_90 (no GPU needed) at
    C = 64, Dk = Dv = 128, bfloat16 inputs, bf16 operands and float32 operands (tf32), with the
    tiles of ``tinyk3.kernels.backward.launch_config``; write the same columns as the forward's
    record (``stage_resources.json``)."""
    import subprocess

    from tinyk3.bench import stamp
    from tinyk3.kernels import backward as kb

    reason = kd.cannot_compile_reason()
    if reason:
        sys.exit(f"cannot compile here: {reason}")
    stage_of = {"_dv_local_kernel": "dv_local", "_adjoint_kernel": "adjoint",
                "_ut_backward_kernel": "ut_backward", "_dqk_kernel": "dqk"}
    rows = []
    for rule, gate in (("delta_rule", 0), *kgated.GATES.items()):
        cfg = kb.launch_config(64, 128, 128, gate)
        for arch in (80, 90):
            for operands, prec in (("bfloat16", "ieee"), ("float32", "tf32")):
                out = kb.compile_for_gpu(gate, arch, chunk_size=64, Dk=128, Dv=128,
                                         dtype=torch.bfloat16, operands=operands,
                                         input_precision=prec)
                for name, compiled in out.items():
                    r = runtime.ptxas_report(compiled.asm["ptx"])
                    row = dict(rule=rule, arch=f"sm_{arch}", operands=operands,
                               input_precision=None if operands == "bfloat16" else prec, stage=name,
                               **cfg[stage_of[name]], registers=r["registers"],
                               spill_stores=r["spill_stores"], spill_loads=r["spill_loads"],
                               stack_frame=r["stack_frame"], shared=compiled.metadata.shared)
                    rows.append(row)
                    print(f"  {rule:16} sm_{arch} {operands:8} {name:20} regs {r['registers']:3}  "
                          f"spills {r['spill_stores']}/{r['spill_loads']} B  shared {row['shared']} B")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stage_resources.json").write_text(json.dumps(dict(
        stamp=stamp(), commit=commit, triton=triton.__version__, torch=torch.__version__,
        C=64, Dk=128, Dv=128, inputs="bfloat16", rows=rows), indent=1))
    print(f"wrote {out_dir / 'stage_resources.json'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--rules", nargs="+", default=["delta_rule", "gated_delta_rule", "kda"],
                   choices=["delta_rule", "gated_delta_rule", "kda"])
    p.add_argument("--forward-only", action="store_true", help="skip the backward kernels' checks")
    p.add_argument("--ptxas-record", type=Path, metavar="DIR",
                   help="compile the gated stages for sm_80/sm_90 (no GPU needed) and write "
                   "DIR/stage_resources.json")
    p.add_argument("--ptxas-record-backward", type=Path, metavar="DIR",
                   help="compile the backward kernels for sm_80/sm_90 (no GPU needed) and write "
                   "DIR/stage_resources.json")
    a = p.parse_args(argv)
    if a.ptxas_record_backward:
        ptxas_record_backward(a.ptxas_record_backward)
        return 0
    if a.ptxas_record:
        ptxas_record(a.ptxas_record)
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine (or --device cpu for a smoke test)")
    env = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
               device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu (interpreter)",
               capability=torch.cuda.get_device_capability() if a.device == "cuda" else None,
               fla=None)
    if fla_chunk_delta_rule is not None or fla_chunk_gdn is not None:
        import fla

        env["fla"] = getattr(fla, "__version__", "?")
    print(json.dumps(env))
    rows, times, ok = [], [], True
    if "delta_rule" in a.rules:
        print("correctness (kernel vs tinyk3.ops.delta_rule.chunked in float64):")
        got, passed = correctness(a.device, a.quick)
        rows += [dict(r, rule="delta_rule") for r in got]
        ok &= passed
        print("forward time (bf16 inputs, C = 64):")
        times += [dict(r, rule="delta_rule") for r in timings(a.device, a.quick, a.sweep)]
    for rule in ("gated_delta_rule", "kda"):
        if rule in a.rules:
            print(f"correctness ({rule} kernel vs tinyk3.ops.{rule}.recurrent in float64):")
            got, passed = gated_correctness(rule, a.device, a.quick)
            rows += got
            ok &= passed
            print(f"forward time ({rule}, bf16 inputs, C = 64):")
            times += gated_timings(rule, a.device, a.quick)
    back_rows, back_times = [], []
    if not a.forward_only:
        for rule in a.rules:
            print(f"backward ({rule}: gradients through the kernels vs the float64 token loop's "
                  "adjoint):")
            got, passed = backward_correctness(rule, a.device, a.quick)
            back_rows += got
            ok &= passed
            print(f"forward + backward time and peak memory ({rule}, bf16 inputs, C = 64):")
            back_times += backward_timings(rule, a.device, a.quick)
    out = a.json
    if out is None and a.device == "cuda":  # the unattended run keeps its record
        import datetime

        day = datetime.date.today().isoformat()
        out = Path(__file__).resolve().parents[1] / "benchmarks" / f"{day}-gpu-kernels" / "gpu_check.json"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(format=RECORD_FORMAT, env=env, rules=a.rules,
                                       correctness=rows, timings=times,
                                       backward_correctness=back_rows, backward_timings=back_times,
                                       passed=ok), indent=1, default=str))
        print(f"wrote {out}")
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

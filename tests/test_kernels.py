"""tinyk3.kernels.delta_rule: the Triton kernels equal the PyTorch chunked form, stage by stage and
end to end, under the Triton interpreter on CPU; they compile for real GPU targets (sm_80, sm_90)
without a GPU; the package imports and fails clearly without Triton; bad inputs fail clearly.

CPU tensors run under the interpreter, chosen per call (no TRITON_INTERPRET needed, so this file
works whatever imported triton first: ``transformers`` does, in test_gpt2.py). One subprocess
checks the usual way too (TRITON_INTERPRET=1 set before triton is imported).

Tolerances, relative to max(1, max |reference|):
* against ``ops.delta_rule.chunked`` in float32, same inputs and chunk size: 2e-6
  (the same products in another order; measured ≤ 5e-7);
* against float64 (``ops.delta_rule.chunked`` on float64 copies): 1e-5, the float32 bound of
  tests/test_delta_rule.py (measured ≤ 4e-7 at these sizes);
* bfloat16 / float16 inputs with ``operands="float32"``: ``o`` within 1e-2 (one rounding of o),
  ``S`` within 1e-5 of the PyTorch form on the same inputs (the state never leaves float32);
* the bfloat16-operand mode (fla's: bf16 tiles into tl.dot, float32 accumulation, W, U, S_[c], U'
  stored in bf16), emulated under the interpreter: ``o`` and ``S`` within 1.5e-2 of float64 on the
  same bf16 inputs (measured ≤ 6e-3 on the cases below; the float32 mode's ``o`` is at 2.4e-3,
  its final rounding to bf16).
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
from tinyk3.ops import delta_rule, wy

if kernels.AVAILABLE:
    import triton.language as tl  # the test kernel below

# Reaches Triton, tinyk3.kernels or fla: rerun with Triton hidden by `make unit-no-triton`.
pytestmark = pytest.mark.triton

needs_triton = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"tinyk3.kernels: {kernels.REASON}")

TOL_F32 = 2e-6  # kernel vs the PyTorch form, both float32
TOL_F64 = 1e-5  # kernel (float32) vs the PyTorch form in float64

# (B, H, T, Dk, Dv, C): T a multiple of C or not, one chunk or several, Dk ≠ Dv, a head size that
# is not a power of two (tiles padded by masks), C = 16, 32, 64.
CASES = [
    (1, 2, 16, 16, 16, 16),  # exactly one chunk
    (2, 2, 37, 16, 32, 16),  # partial last chunk, Dk < Dv, B = 2
    (1, 2, 64, 32, 16, 32),  # T a multiple of C, Dk > Dv
    (1, 2, 100, 32, 32, 32),  # 4 chunks, the last has 4 tokens
    (1, 2, 100, 16, 16, 64),  # C = 64, the second chunk partial
    (1, 1, 45, 20, 12, 16),  # head sizes 20 and 12, padded to 32 and 16
]
CASE_IDS = ["B{}H{}T{}Dk{}Dv{}C{}".format(*c) for c in CASES]
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ROOT = Path(__file__).resolve().parents[1]


def _inputs(B, H, T, Dk, Dv, dtype=torch.float32, seed=0):
    return delta_rule_inputs(B, H, T, Dk, Dv, dtype, seed)


def _rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


# -- availability ---------------------------------------------------------------------------------

@needs_triton
def test_available_here():
    assert kernels.AVAILABLE is True and kernels.REASON is None
    assert kernels.TRITON_VERSION


def test_without_triton_imports_and_fails_clearly():
    """A process where ``import triton`` fails: the package imports, AVAILABLE is False with a
    reason, and a call raises TritonUnavailableError (an ImportError) saying how to install."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch, tinyk3, tinyk3.kernels as K
        from tinyk3.kernels import delta_rule as kd
        assert K.AVAILABLE is False, K.AVAILABLE
        print("REASON:", K.REASON)
        q = torch.randn(1, 1, 4, 16)
        try:
            kd.chunked(q, q, q, torch.rand(1, 1, 4), chunk_size=16)
        except K.TritonUnavailableError as e:
            assert isinstance(e, ImportError)
            print("ERROR:", e)
        else:
            raise SystemExit("no error raised")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=SUBPROCESS_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "REASON: Triton is not installed" in r.stdout
    err = r.stdout.split("ERROR:", 1)[1]
    assert "needs Triton" in err and "pip install" in err and "tinyk3.ops" in err


# -- against the PyTorch chunked form, under the interpreter --------------------------------------

@needs_triton
@pytest.mark.parametrize("fuse_output", [False, True], ids=["output-pass", "fused"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_equals_pytorch_chunked(case, fuse_output):
    B, H, T, Dk, Dv, C = case
    q, k, v, beta, S0 = _inputs(B, H, T, Dk, Dv)
    init = S0 if T != 64 else None  # one case with the zero state
    o, S = kd.chunked(q, k, v, beta, chunk_size=C, initial_state=init, fuse_output=fuse_output)
    assert o.shape == (B, H, T, Dv) and o.dtype == torch.float32
    assert S.shape == (B, H, Dk, Dv) and S.dtype == torch.float32
    ref_o, ref_S = delta_rule.chunked(q, k, v, beta, chunk_size=C, initial_state=init)
    assert _rel_err(o, ref_o) <= TOL_F32, f"o vs float32: {_rel_err(o, ref_o):.2e}"
    assert _rel_err(S, ref_S) <= TOL_F32, f"S vs float32: {_rel_err(S, ref_S):.2e}"
    d = [t.double() for t in (q, k, v, beta)]
    ref64_o, ref64_S = delta_rule.chunked(*d, chunk_size=C,
                                          initial_state=None if init is None else init.double())
    assert _rel_err(o, ref64_o) <= TOL_F64, f"o vs float64: {_rel_err(o, ref64_o):.2e}"
    assert _rel_err(S, ref64_S) <= TOL_F64, f"S vs float64: {_rel_err(S, ref64_S):.2e}"


@needs_triton
def test_each_stage_equals_its_equation():
    """Stage 1 writes W = T K, U = T V of every chunk (ops.wy); stage 2 the state each chunk starts
    from and U' = U − W S_c; stage 3 the output. Checked one stage at a time."""
    B, H, T, Dk, Dv, C = 1, 2, 40, 16, 32, 16
    q, k, v, beta, S0 = _inputs(B, H, T, Dk, Dv, seed=1)
    st = kd.forward_stages(q, k, v, beta, chunk_size=C, initial_state=S0)
    N = -(-T // C)
    pad = N * C - T

    def chunks(x):  # [B, H, T, D] -> [B, H, N, C, D], zero-padded
        return torch.nn.functional.pad(x, (0, 0, 0, pad)).view(B, H, N, C, -1)

    Kc, Vc = chunks(k), chunks(v)
    bc = torch.nn.functional.pad(beta, (0, pad)).view(B, H, N, C)
    W, U = wy.wy_factors(Kc, Vc, bc)
    assert _rel_err(chunks(st["w"]), W) <= TOL_F32
    assert _rel_err(chunks(st["u"]), U) <= TOL_F32
    S = S0.clone()
    for c in range(N):  # the state pass, written out
        assert _rel_err(st["states"][:, :, c], S) <= TOL_F32, f"S_c at chunk {c}"
        u_new = U[:, :, c] - W[:, :, c] @ S
        assert _rel_err(chunks(st["u_new"])[:, :, c], u_new) <= TOL_F32, f"U' at chunk {c}"
        S = S + Kc[:, :, c].transpose(-1, -2) @ u_new
    assert _rel_err(st["S"], S) <= TOL_F32


@needs_triton
@pytest.mark.parametrize("fuse_output", [False, True], ids=["separate", "fused"])
def test_smaller_tiles_split_the_work_and_change_nothing(fuse_output):
    """Tiles smaller than the head: the state's Dv columns split over two programs (BV = 16 of
    Dv = 32, the second block partial for Dv = 24) and Dk walked in two blocks (BK = 16 of 32) in
    stages 1 and 3. The columns of S evolve independently, so the result must not change."""
    B, H, T, Dk, Dv, C = 1, 2, 45, 32, 24, 16
    q, k, v, beta, S0 = _inputs(B, H, T, Dk, Dv, seed=5)
    default = kd.forward_stages(q, k, v, beta, chunk_size=C, initial_state=S0, fuse_output=fuse_output)
    opts = dict(num_warps=4, num_stages=1)
    small = {"wy": dict(BK=16, BV=16, **opts), "state": dict(BK=32, BV=16, **opts),
             "output": dict(BK=16, BV=16, **opts)}
    split = kd.forward_stages(q, k, v, beta, chunk_size=C, initial_state=S0, fuse_output=fuse_output,
                              config=small)
    assert set(split) == set(default)
    for name in default:
        assert _rel_err(split[name], default[name]) <= TOL_F32, name
    o_ref, S_ref = delta_rule.chunked(q, k, v, beta, chunk_size=C, initial_state=S0)
    assert _rel_err(split["o"], o_ref) <= TOL_F32 and _rel_err(split["S"], S_ref) <= TOL_F32


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_inputs_accumulate_in_float32(dtype):
    q, k, v, beta, S0 = _inputs(1, 2, 37, 16, 16, dtype, seed=2)
    o, S = kd.chunked(q, k, v, beta, chunk_size=16, initial_state=S0, operands="float32")
    assert o.dtype == dtype and S.dtype == torch.float32
    ref_o, ref_S = delta_rule.chunked(q, k, v, beta, chunk_size=16, initial_state=S0)
    assert _rel_err(o, ref_o) <= 1e-2
    assert _rel_err(S, ref_S) <= 1e-5
    if dtype == torch.float16:  # float16 inputs default to float32 operands
        o_default, _ = kd.chunked(q, k, v, beta, chunk_size=16, initial_state=S0)
        assert torch.equal(o_default, o)


TOL_BF16 = 1.5e-2  # bfloat16-operand mode vs float64 (measured <= 6e-3, see the module docstring)


@needs_triton
@pytest.mark.parametrize("fuse_output", [False, True], ids=["output-pass", "fused"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_bf16_operands_against_float64(case, fuse_output):
    """bfloat16 inputs default to fla's mode; under the interpreter it is emulated by rounding."""
    B, H, T, Dk, Dv, C = case
    q, k, v, beta, S0 = _inputs(B, H, T, Dk, Dv, torch.bfloat16, seed=7)
    o, S = kd.chunked(q, k, v, beta, chunk_size=C, initial_state=S0, fuse_output=fuse_output)
    explicit, _ = kd.chunked(q, k, v, beta, chunk_size=C, initial_state=S0, fuse_output=fuse_output,
                             operands="bfloat16")
    assert torch.equal(o, explicit)  # the default for bfloat16 inputs
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    ref_o, ref_S = delta_rule.chunked(*(t.double() for t in (q, k, v, beta)), chunk_size=C,
                                      initial_state=S0.double())
    assert _rel_err(o, ref_o) <= TOL_BF16, f"o vs float64: {_rel_err(o, ref_o):.2e}"
    assert _rel_err(S, ref_S) <= TOL_BF16, f"S vs float64: {_rel_err(S, ref_S):.2e}"
    # the modes differ: the float32 mode's state is far closer to float64
    _, S32 = kd.chunked(q, k, v, beta, chunk_size=C, initial_state=S0, fuse_output=fuse_output,
                        operands="float32")
    assert _rel_err(S32, ref_S) <= TOL_F64 < _rel_err(S, ref_S)


@needs_triton
def test_bf16_mode_stores_bfloat16_values():
    """Under the interpreter the intermediates are float32 tensors; in the bf16 mode every value
    in them must be a bfloat16 number (the emulation rounds where the GPU stores bf16)."""
    q, k, v, beta, S0 = _inputs(1, 2, 45, 32, 24, seed=8)  # float32 inputs, bf16 operands asked
    st = kd.forward_stages(q, k, v, beta, chunk_size=16, initial_state=S0, operands="bfloat16")
    for name in ("w", "u", "states", "u_new"):
        assert st[name].dtype == torch.float32, name
        assert torch.equal(st[name], st[name].bfloat16().float()), name
    f32 = kd.forward_stages(q, k, v, beta, chunk_size=16, initial_state=S0, operands="float32")
    assert not torch.equal(f32["w"], f32["w"].bfloat16().float())  # the float32 mode does not round


@needs_triton
def test_interpreter_bf16_rounding_is_emulated_exactly():
    """runtime.to_operand under the interpreter rounds float32 to bfloat16 as torch does (nearest,
    ties to even, signs, tiny and large values); Triton 3.7's own interpreted cast truncates."""
    from triton.runtime.interpreter import InterpretedFunction

    from tinyk3.kernels import runtime

    ks = runtime.KernelSet("test")

    @ks.kernel
    def _round_kernel(x, y, n, BN: tl.constexpr):
        o = tl.arange(0, BN)
        a = tl.load(x + o, mask=o < n, other=0.0)
        tl.store(y + o, to_operand(a, True, True), mask=o < n)  # noqa: F821 (KernelSet adds it)

    @ks.kernel
    def _cast_kernel(x, y, n, BN: tl.constexpr):
        o = tl.arange(0, BN)
        a = tl.load(x + o, mask=o < n, other=0.0)
        tl.store(y + o, a.to(tl.bfloat16).to(tl.float32), mask=o < n)

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(1000, generator=g) * 10.0 ** torch.randint(-30, 30, (1000,), generator=g),
                   torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 0.0, -0.0, 3.0e38])])
    y = torch.empty_like(x)
    ks.get(True)._round_kernel[(1,)](x, y, x.numel(), BN=1024)
    assert torch.equal(y, x.bfloat16().float())
    assert isinstance(ks.get(True)._round_kernel, InterpretedFunction)
    # why the emulation exists (runtime's docstring): the interpreter's own cast truncates
    native = torch.empty_like(x)
    ks.get(True)._cast_kernel[(1,)](x, native, x.numel(), BN=1024)
    truncated = (x.view(torch.int32) & -65536).view(torch.float32)
    assert torch.equal(native, truncated) and not torch.equal(native, y)


@needs_triton
def test_empty_sequence_passes_the_state_through():
    q, k, v, beta, S0 = _inputs(2, 2, 0, 16, 16)
    o, S = kd.chunked(q, k, v, beta, chunk_size=16, initial_state=S0)
    assert o.shape == (2, 2, 0, 16) and torch.equal(S, S0) and S is not S0


@needs_triton
def test_split_sequence_carries_the_state():
    """Two calls, the second starting from the first's state, equal one call (chunk boundaries
    fall in different places, so this also exercises the partial last chunk)."""
    q, k, v, beta, S0 = _inputs(1, 2, 50, 16, 16, seed=3)
    o, S = kd.chunked(q, k, v, beta, chunk_size=16, initial_state=S0)
    o1, mid = kd.chunked(q[:, :, :21], k[:, :, :21], v[:, :, :21], beta[:, :, :21], chunk_size=16,
                         initial_state=S0)
    o2, S2 = kd.chunked(q[:, :, 21:], k[:, :, 21:], v[:, :, 21:], beta[:, :, 21:], chunk_size=16,
                        initial_state=mid)
    assert _rel_err(torch.cat([o1, o2], dim=2), o) <= TOL_F32 and _rel_err(S2, S) <= TOL_F32


# -- gradients through the autograd.Function -------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("with_state", [True, False], ids=["initial-state", "zero-state"])
def test_backward_kernels_equal_the_float64_backward(with_state):
    """The backward runs as Triton kernels (chapter 21): its gradients, through autograd, equal
    the PyTorch form's in float64 (its derived backward) to float32 round-off, with None for
    inputs that need none and the incoming dS used. tests/test_kernels_backward.py has more."""
    q, k, v, beta, S0 = _inputs(1, 2, 37, 16, 16, seed=4)
    g = torch.Generator().manual_seed(5)
    go, gS = torch.randn(1, 2, 37, 16, generator=g), torch.randn(1, 2, 16, 16, generator=g)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v, beta, S0)]
        o, S = fn(*leaves[:4], chunk_size=16, initial_state=leaves[4] if with_state else None)
        ((o * go.to(dtype)).sum() + (S * gS.to(dtype)).sum()).backward()
        return [t.grad for t in leaves]

    got, ref = grads(kd.chunked, torch.float32), grads(delta_rule.chunked, torch.float64)
    for name, a, b in zip(["q", "k", "v", "beta", "S0"], got, ref):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == torch.float32 and _rel_err(a, b) <= TOL_F64, f"d{name}: {_rel_err(a, b):.2e}"


@needs_triton
def test_gradient_for_some_inputs_only():
    q, k, v, beta, _ = _inputs(1, 1, 20, 16, 16, seed=6)
    v = v.clone().requires_grad_()
    o, _ = kd.chunked(q, k, v, beta, chunk_size=16)
    o.sum().backward()
    v_ref = v.detach().double().requires_grad_()
    delta_rule.chunked(q.double(), k.double(), v_ref, beta.double(), chunk_size=16)[0].sum().backward()
    assert q.grad is None and _rel_err(v.grad, v_ref.grad) <= TOL_F64


# -- the usual way: TRITON_INTERPRET=1 before triton is imported ------------------------------------

@needs_triton
def test_with_triton_interpret_set_at_import():
    code = textwrap.dedent("""
        import torch, triton  # triton first, as a notebook would, with TRITON_INTERPRET=1 set
        from tinyk3.kernels import delta_rule as kd
        from tinyk3.ops import delta_rule
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 37, 32, generator=g)
        k = torch.nn.functional.normalize(torch.randn(1, 2, 37, 32, generator=g), dim=-1)
        v, beta = torch.randn(1, 2, 37, 16, generator=g), torch.rand(1, 2, 37, generator=g)
        S0 = torch.randn(1, 2, 32, 16, generator=g)
        o, S = kd.chunked(q, k, v, beta, chunk_size=32, initial_state=S0)
        ro, rS = delta_rule.chunked(q, k, v, beta, chunk_size=32, initial_state=S0)
        print(kd.interpreter_only(), (o - ro).abs().max().item(), (S - rS).abs().max().item())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**SUBPROCESS_ENV, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    flag, err_o, err_S = r.stdout.split()
    assert flag == "True" and float(err_o) <= 1e-5 and float(err_S) <= 1e-5


# -- compiled for real GPUs, without one --------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80", "sm_90"])
def test_compiles_for_gpu_targets(arch, tmp_path, monkeypatch):
    """triton.compile with an explicit target: Triton IR → PTX → cubin (the ptxas in the wheel).
    Small tiles keep it to ~1 s a kernel; tools/gpu_check_kernels.py compiles the full sizes."""
    reason = kd.cannot_compile_reason()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from a cache
    out = kd.compile_for_gpu(arch, chunk_size=16, Dk=32, Dv=32, dtype=torch.bfloat16)
    assert set(out) == {"_wy_kernel", "_state_kernel", "_output_kernel"}
    target = "sm_90a" if arch == 90 else "sm_80"
    for name, compiled in out.items():
        assert f".target {target}" in compiled.asm["ptx"], name
        assert compiled.asm["cubin"][:4] == b"\x7fELF", name  # a real cubin from ptxas
    bf16 = kd.compile_for_gpu(arch, chunk_size=16, Dk=32, Dv=32, dtype=torch.bfloat16,
                              operands="bfloat16")
    for name, compiled in bf16.items():  # bf16 tensor-core products, float32 accumulators
        mma = [line for line in compiled.asm["ptx"].splitlines() if "mma" in line and ".bf16" in line]
        assert mma and all(".f32" in line for line in mma), name
    fused = kd.compile_for_gpu(arch, chunk_size=16, Dk=32, Dv=32, dtype=torch.float32,
                               fuse_output=True, has_initial_state=False)
    assert set(fused) == {"_wy_kernel", "_state_kernel"}
    assert fused["_state_kernel"].asm["cubin"][:4] == b"\x7fELF"


# -- misuse ------------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(chunk_size=48), ValueError, "chunk_size must be one of"),
        (dict(chunk_size=8), ValueError, "chunk_size must be one of"),
        (dict(chunk_size=True), ValueError, "chunk_size must be one of"),
        (dict(input_precision="fast"), ValueError, "input_precision must be one of"),
        (dict(fuse_output=1), TypeError, "fuse_output must be a bool"),
        (dict(operands="bf16"), ValueError, "operands must be one of"),
        (dict(initial_state=torch.zeros(1, 2, 16, 8)), ValueError, "initial_state must have shape"),
    ],
    ids=["C48", "C8", "C-bool", "precision", "fuse", "operands", "state-shape"],
)
def test_bad_options_fail_clearly(kwargs, exc, match):
    q, k, v, beta, _ = _inputs(1, 2, 8, 16, 16)
    with pytest.raises(exc, match=match):
        kd.chunked(q, k, v, beta, **kwargs)


@needs_triton
def test_bad_tensors_fail_clearly():
    q, k, v, beta, _ = _inputs(1, 2, 8, 16, 16)
    with pytest.raises(TypeError, match="float64"):
        kd.chunked(q.double(), k.double(), v.double(), beta.double(), chunk_size=16)
    big = torch.randn(1, 1, 8, 256)
    with pytest.raises(ValueError, match="head dimensions must be 1..128"):
        kd.chunked(big, big, torch.randn(1, 1, 8, 16), torch.rand(1, 1, 8), chunk_size=16)
    with pytest.raises(ValueError, match=r"shape \[B, H, T\]"):
        kd.chunked(q, k, v, beta[:, :, :4], chunk_size=16)
    with pytest.raises(ValueError, match="expected q, k"):
        kd.chunked(q, k[:, :, :4], v, beta, chunk_size=16)
    with pytest.raises(TypeError, match="dtype of q"):
        kd.chunked(q, k, v, beta.half(), chunk_size=16)
    meta = [t.to("meta") for t in (q, k, v, beta)]
    with pytest.raises(ValueError, match="CUDA device .* or the CPU"):
        kd.chunked(*meta, chunk_size=16)


@needs_triton
def test_gpu_check_script_smoke_on_cpu(tmp_path):
    """tools/gpu_check_kernels.py is the check that needs a GPU; its --device cpu mode runs every
    code path but the CUDA-only ones (interpreter, tiny sizes), so the script itself stays working."""
    out = tmp_path / "g.json"
    proc = subprocess.run([sys.executable, "tools/gpu_check_kernels.py", "--device", "cpu", "--quick",
                           "--rules", "delta_rule", "--json", str(out)], cwd=ROOT,
                          env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ALL CHECKS PASSED" in proc.stdout and "sdpa causal" in proc.stdout
    report = json.loads(out.read_text())  # what it measured, with the environment it ran in
    assert report["env"]["device"] == "cpu (interpreter)" and report["correctness"] and report["timings"]
    # the delta rule here; the gated rules' run is tests/test_kernels_gated.py's
    assert report["format"] == 2 and {row["rule"] for row in report["backward_correctness"]} == {
        "delta_rule"}

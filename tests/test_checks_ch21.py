"""Chapter 21's exercise (the adjoint state pass as a Triton kernel) against wrong kernels
written by hand, the way a learner would write them (one bug each, independent of the
registered Mistake functions), against correct variants, and against kernels that raise,
return NaN, store outside their outputs or are not written yet."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import flat, right, wrong
from tinyk3 import checks
from tinyk3.checks import ch21_kernel_backward as ck
from tinyk3.kernels import AVAILABLE as TRITON

pytestmark = pytest.mark.triton

if TRITON:
    import triton.language as tl

needs_triton = pytest.mark.skipif(not TRITON, reason="Triton is not installed")

# the hand-written wrong kernels below, by the mistake each must be matched to
NAMED_ELSEWHERE = {"backward.adjoint_kernel": ("forward_order", "update_before_delta", "plus_w",
                                               "no_output_term", "zero_start",
                                               "p_without_row_mask")}


def _adjoint(k, w, q, p, do, ds_T, du_new, ds0, T, Dk, Dv, NT, BC, BK, BV, BUG):
    """The adjoint pass as a learner writes it, with the bug ``BUG`` ("none": no bug)."""
    i_bh = tl.program_id(0)
    rows = tl.arange(0, BC)
    ck_, cv = tl.arange(0, BK), tl.arange(0, BV)
    kv = (ck_[:, None] < Dk) & (cv[None, :] < Dv)
    ds = tl.full([BK, BV], 0.0, tl.float32)
    if BUG != "zero_start":
        ds += tl.load(ds_T + i_bh * Dk * Dv + ck_[:, None] * Dv + cv[None, :], mask=kv, other=0.0)
    for n in range(0, NT):
        c = n if BUG == "forward" else NT - 1 - n
        t = c * BC + rows
        tk = (t[:, None] < T) & (ck_[None, :] < Dk)
        tv = (t[:, None] < T) & (cv[None, :] < Dv)
        kk = tl.load(k + (i_bh * T + t[:, None]) * Dk + ck_[None, :], mask=tk, other=0.0)
        ww = tl.load(w + (i_bh * T + t[:, None]) * Dk + ck_[None, :], mask=tk, other=0.0)
        qq = tl.load(q + (i_bh * T + t[:, None]) * Dk + ck_[None, :], mask=tk, other=0.0)
        pmask = (cv[None, :] < Dv) & (t[:, None] >= 0) if BUG == "p_no_row_mask" else tv
        pp = tl.load(p + (i_bh * T + t[:, None]) * Dv + cv[None, :], mask=pmask, other=0.0)
        dd = tl.load(do + (i_bh * T + t[:, None]) * Dv + cv[None, :], mask=tv, other=0.0)
        du = pp + tl.dot(kk, ds, input_precision="ieee")
        if BUG == "update_first":  # updates dS, then stores a dU' formed again from the new dS
            ds += tl.dot(tl.trans(qq), dd, input_precision="ieee")
            ds -= tl.dot(tl.trans(ww), du, input_precision="ieee")
            du = pp + tl.dot(kk, ds, input_precision="ieee")
        if BUG == "nan":
            du = du * float("nan")
        smask = (t[:, None] >= 0) & (cv[None, :] < Dv) if BUG == "store_no_mask" else tv
        tl.store(du_new + (i_bh * T + t[:, None]) * Dv + cv[None, :], du, mask=smask)
        if BUG != "update_first":
            if BUG != "no_q":
                ds += tl.dot(tl.trans(qq), dd, input_precision="ieee")
            if BUG == "plus_w":
                ds += tl.dot(tl.trans(ww), du, input_precision="ieee")
            else:
                ds -= tl.dot(tl.trans(ww), du, input_precision="ieee")
    tl.store(ds0 + i_bh * Dk * Dv + ck_[:, None] * Dv + cv[None, :], ds, mask=kv)


_BUGS = ("none", "forward", "update_first", "plus_w", "no_q", "zero_start", "p_no_row_mask",
         "nan", "store_no_mask")
for _bug in _BUGS if TRITON else ():  # module-level kernels (the interpreter drops closures)
    exec(textwrap.dedent(f"""
        def kernel_{_bug}(k, w, q, p, do, ds_T, du_new, ds0, T, Dk, Dv, NT, BC: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr):
            _adjoint(k, w, q, p, do, ds_T, du_new, ds0, T, Dk, Dv, NT, BC, BK, BV, "{_bug}")
    """))


def _kernel(bug):
    return globals()[f"kernel_{bug}"]


@needs_triton
@pytest.mark.parametrize("bug,mistake", [
    ("forward", "forward_order"),
    ("update_first", "update_before_delta"),
    ("plus_w", "plus_w"),
    ("no_q", "no_output_term"),
    ("zero_start", "zero_start"),
    ("p_no_row_mask", "p_without_row_mask"),
])
def test_adjoint_kernel_wrong_answer_is_caught(bug, mistake, capsys):
    result = ck.check_adjoint_kernel(_kernel(bug))
    assert result.status == "failed" and result.mistake == mistake, result.report
    out = flat(capsys.readouterr().out)
    hint = next(m.hint for m in checks.EXERCISES["backward.adjoint_kernel"].mistakes
                if m.name == mistake)
    assert flat(f"Hint: {hint}") in out and f"First failure: case {result.failed_case}" in out


@needs_triton
def test_adjoint_kernel_store_without_mask_is_reported():
    result = ck.check_adjoint_kernel(_kernel("store_no_mask"), verbose=False)
    assert result.status == "error" and not result
    assert "stored" in result.report and "outside du_new" in result.report


@needs_triton
def test_adjoint_kernel_nan_is_reported_not_raised():
    result = ck.check_adjoint_kernel(_kernel("nan"), verbose=False)
    assert result.status == "failed" and "NaN" in result.report, result.report


@needs_triton
@pytest.mark.parametrize("which", ["solution", "written-differently"])
def test_adjoint_kernel_correct_answers_pass(which):
    kernel = ck.adjoint_kernel_solution if which == "solution" else _kernel("none")
    result = ck.check_adjoint_kernel(kernel, verbose=False)
    assert result and result.n_passed == result.n_cases == 5, result.report


@needs_triton
def test_adjoint_kernel_stub_and_compile_error():
    def stub(k, w, q, p, do, ds_T, du_new, ds0, T, Dk, Dv, NT, BC: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr):
        raise NotImplementedError

    def bad(k, w, q, p, do, ds_T, du_new, ds0, T, Dk, Dv, NT, BC: tl.constexpr,
            BK: tl.constexpr, BV: tl.constexpr):
        tl.reshape(tl.arange(0, BC), (2 * BC,))  # another number of elements: refused

    assert ck.check_adjoint_kernel(stub, verbose=False).status == "not attempted"
    result = ck.check_adjoint_kernel(bad, verbose=False)
    assert result.status == "error" and "your function raised" in result.report


def test_adjoint_kernel_mistakes_differ_from_the_reference():
    ex = checks.EXERCISES["backward.adjoint_kernel"]
    for m in ex.mistakes:
        diffs = [max((a - b).abs().nan_to_num(1e9).max().item()
                     for a, b in zip(m.fn(*c.args), ex.reference(*c.args)))
                 for c in ex.cases()]
        assert max(diffs) > 1e-2, m.name


def test_adjoint_kernel_check_without_triton_says_how_to_install():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None
        from tinyk3.checks import ch21_kernel_backward as ck
        r = ck.check_adjoint_kernel(lambda *a: None)
        assert r.status == "error" and not r, r
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "needs Triton" in flat(proc.stdout) and "pip install triton" in flat(proc.stdout)


# -- backward.launch_grids: plain Python, no Triton needed ------------------------------------


@wrong("backward.launch_grids", "adjoint_with_chunk_axis")
def grids_like_the_others(B, H, T, Dk, Dv, C, cfg):
    """Gives every launch a chunk axis, the sequential one too."""
    NT = -(-T // C)
    return ((NT, B * H), (-(-Dv // cfg["dv_local"]["BV"]), NT, B * H),
            (-(-Dv // cfg["adjoint"]["BV"]), NT, B * H), (NT, B * H),
            (-(-Dk // cfg["dqk"]["BK"]), NT, B * H))


@wrong("backward.launch_grids", "floor_chunks")
def grids_floor(B, H, T, Dk, Dv, C, cfg):
    """Counts whole chunks only."""
    NT = T // C
    return ((NT, B * H), (-(-Dv // cfg["dv_local"]["BV"]), NT, B * H),
            (-(-Dv // cfg["adjoint"]["BV"]), B * H), (NT, B * H),
            (-(-Dk // cfg["dqk"]["BK"]), NT, B * H))


@wrong("backward.launch_grids", "dqk_over_dv")
def grids_dqk_by_value_blocks(B, H, T, Dk, Dv, C, cfg):
    """Splits launch 5 over the value dimension, as launches 2 and 3 are."""
    NT = -(-T // C)
    return ((NT, B * H), (-(-Dv // cfg["dv_local"]["BV"]), NT, B * H),
            (-(-Dv // cfg["adjoint"]["BV"]), B * H), (NT, B * H),
            (-(-Dv // cfg["dqk"]["BV"]), NT, B * H))


@right("backward.launch_grids")
def grids_with_math_ceil(B, H, T, Dk, Dv, C, cfg):
    import math

    NT, BH = math.ceil(T / C), B * H
    return ((NT, BH), (math.ceil(Dv / cfg["dv_local"]["BV"]), NT, BH),
            (math.ceil(Dv / cfg["adjoint"]["BV"]), BH), (NT, BH),
            (math.ceil(Dk / cfg["dqk"]["BK"]), NT, BH))


@needs_triton
def test_launch_grids_reference_is_what_the_backward_launches(monkeypatch):
    """The exercise's reference is the kernels' own grids: record every launch of one backward
    call and compare."""
    from tinyk3.kernels import backward as kb
    from tinyk3.kernels import gated

    grids = []
    for ns in (kb.KERNELS.get(True), gated.KERNELS.get(True)):
        for name in ("_wy_kernel", "_dv_local_kernel", "_adjoint_kernel", "_ut_backward_kernel",
                     "_dqk_kernel"):
            if hasattr(ns, name):
                real = getattr(ns, name)

                class Recorder:
                    def __init__(self, real=real):
                        self.real = real

                    def __getitem__(self, grid):
                        grids.append(tuple(grid))
                        return self.real[grid]

                monkeypatch.setattr(ns, name, Recorder())
    B, H, T, Dk, Dv, C = 1, 2, 45, 40, 24, 16
    x = [torch.randn(B, H, T, D) for D in (Dk, Dk, Dv)]
    beta, g = torch.rand(B, H, T), -torch.rand(B, H, T, Dk)
    kb.backward(*x, beta, g, torch.randn(B, H, T, Dv), None, gate=2, chunk_size=C)
    cfg = kb.launch_config(C, Dk, Dv, 2)
    assert tuple(grids) == ck.launch_grids(B, H, T, Dk, Dv, C, cfg)

"""The autograder behind every exercise: run a learner's function against the reference.

An :class:`Exercise` bundles the reference solution, a deterministic list of random cases and
the typical mistakes (each written as a function, with the hint to give when a learner's output
matches it). :func:`run` never raises because of the learner's function: exceptions, wrong
shapes or dtypes, NaN, ``None`` and unwritten stubs are all reported in plain words.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import math
import textwrap
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Case", "Mistake", "Exercise", "CheckResult", "EXERCISES", "register", "run",
           "wrap_report", "REPORT_WIDTH"]

#: Printed reports are wrapped to this many columns: the width of the website's code and
#: output blocks, so a hint or an error is never cut off on the right.
REPORT_WIDTH = 88


@dataclass
class Case:
    """One call: ``fn(*args, **kwargs)``; ``label`` says what is special about it."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    label: str = ""


@dataclass
class Mistake:
    """A typical wrong answer, written as code, and the hint to show when it is matched."""

    name: str
    fn: Callable
    hint: str


@dataclass
class Exercise:
    id: str
    title: str
    signature: str
    reference: Callable
    make_cases: Callable[[torch.Generator], list[Case]]
    mistakes: list[Mistake] = field(default_factory=list)
    atol: float = 1e-5
    rtol: float = 1e-5
    hint: str = ""  # shown when a failure matches none of the known mistakes
    chapter: int = 0

    def cases(self) -> list[Case]:
        """The same cases every time: the generator is seeded by the exercise id."""
        g = torch.Generator().manual_seed(zlib.crc32(self.id.encode()))
        return self.make_cases(g)


EXERCISES: dict[str, Exercise] = {}


def register(exercise: Exercise) -> Exercise:
    if exercise.id in EXERCISES:
        raise ValueError(f"exercise {exercise.id!r} is registered twice")
    EXERCISES[exercise.id] = exercise
    return exercise


@dataclass
class CheckResult:
    """Truthy only when every case passed. ``status``: passed, failed, error, not attempted."""

    exercise_id: str
    status: str
    n_passed: int = 0
    n_cases: int = 0
    max_abs_error: float | None = None
    failed_case: int | None = None  # 1-based index of the first failing case
    mistake: str | None = None  # name of the known mistake the failure matched
    report: str = ""

    def __bool__(self) -> bool:
        return self.status == "passed"

    def __repr__(self) -> str:
        return f"<CheckResult {self.exercise_id}: {self.status} {self.n_passed}/{self.n_cases}>"


# -- comparing outputs ---------------------------------------------------------------------

def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor {list(x.shape)} {str(x.dtype).replace('torch.', '')}"
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of {len(x)}: (" + ", ".join(_describe(e) for e in x) + ")"
    if isinstance(x, (bool, int, float)):
        return repr(x)
    return type(x).__name__


def _as_number(x: Any):
    """0-d tensors and NumPy scalars become Python numbers."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if type(x).__module__ == "numpy" and hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return x.item()
    return x


@dataclass
class _Cmp:
    ok: bool
    reason: str = ""
    max_abs_error: float | None = None


def _compare(expected: Any, got: Any, atol: float, rtol: float, equal_nan: bool = False) -> _Cmp:
    """Does ``got`` match ``expected``? If not, say why in a learner's words."""
    if got is None and expected is not None:
        return _Cmp(False, "your function returned None: did you forget a `return`?")
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return _Cmp(False, f"expected a {_describe(expected)}, got {_describe(got)}")
        if got.shape != expected.shape:
            return _Cmp(
                False, f"wrong shape: expected {list(expected.shape)}, got {list(got.shape)}"
            )
        if got.dtype != expected.dtype:
            return _Cmp(False, f"wrong dtype: expected {expected.dtype}, got {got.dtype}")
        if expected.dtype == torch.bool:
            wrong = (got != expected).sum().item()
            if wrong:
                where = tuple(torch.nonzero(got != expected)[0].tolist())
                return _Cmp(False, f"{wrong} of {got.numel()} entries differ (first at {where})", 1.0)
            return _Cmp(True, max_abs_error=0.0)
        got_d, exp_d = got.detach().double().cpu(), expected.detach().double().cpu()
        exp_bad, got_bad = ~torch.isfinite(exp_d), ~torch.isfinite(got_d)
        if not equal_nan and got_bad.any() and not exp_bad.any():
            n_nan = torch.isnan(got_d).sum().item()
            n_inf = torch.isinf(got_d).sum().item()
            where = tuple(torch.nonzero(got_bad)[0].tolist())
            return _Cmp(False, f"output has {n_nan} NaN and {n_inf} inf values (first at {where})")
        both_nan = torch.isnan(exp_d) & torch.isnan(got_d)
        same_inf = torch.isinf(exp_d) & (exp_d == got_d)
        if (exp_bad != got_bad).any() or not (both_nan | same_inf)[exp_bad].all():
            differs = (exp_bad != got_bad) | (exp_bad & ~(both_nan | same_inf))
            where = tuple(torch.nonzero(differs)[0].tolist())
            return _Cmp(
                False,
                f"expected {exp_bad.sum().item()} non-finite entries (inf or NaN), yours has "
                f"{got_bad.sum().item()}; first difference at {where}: expected "
                f"{exp_d[where].item():.4g}, got {got_d[where].item():.4g}",
                math.inf,
            )
        diff = (got_d - exp_d).abs().masked_fill(exp_bad, 0.0)
        err = diff.max().item() if diff.numel() else 0.0
        tol = atol + rtol * exp_d.abs().masked_fill(exp_bad, 0.0)
        if (diff > tol).any():
            where = tuple(torch.nonzero(diff > tol)[0].tolist())
            worst = tuple(int(j) for j in torch.unravel_index(torch.argmax(diff), diff.shape))
            return _Cmp(
                False,
                f"values differ: max abs error {err:.3g} at index {worst} "
                f"(tolerance {atol:g} + {rtol:g}·|expected|; first bad entry at {where})",
                err,
            )
        return _Cmp(True, max_abs_error=err)
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return _Cmp(False, f"expected {_describe(expected)}, got {_describe(got)}")
        worst = 0.0
        for i, (e, g) in enumerate(zip(expected, got)):
            c = _compare(e, g, atol, rtol, equal_nan)
            if not c.ok:
                return _Cmp(False, f"element {i} of the result: {c.reason}", c.max_abs_error)
            worst = max(worst, c.max_abs_error or 0.0)
        return _Cmp(True, max_abs_error=worst)
    if isinstance(expected, bool):
        got = _as_number(got)
        if isinstance(got, bool) and got == expected:
            return _Cmp(True, max_abs_error=0.0)
        return _Cmp(False, f"expected {expected!r}, got {_describe(got)}")
    if isinstance(expected, int):
        got = _as_number(got)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return _Cmp(False, f"expected an int, got {_describe(got)}")
        if got != got or abs(got) == math.inf:
            return _Cmp(False, f"expected {expected:,}, got {got}", math.inf)
        if got != expected:
            return _Cmp(
                False, f"expected {expected:,}, got {got:,} (off by {got - expected:+,})",
                abs(got - expected),
            )
        return _Cmp(True, max_abs_error=0.0)
    if isinstance(expected, float):
        got = _as_number(got)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return _Cmp(False, f"expected a float, got {_describe(got)}")
        err = abs(got - expected)
        if not err <= atol + rtol * abs(expected):
            return _Cmp(False, f"expected {expected:.6g}, got {got:.6g} (abs error {err:.3g})", err)
        return _Cmp(True, max_abs_error=err)
    ok = got == expected
    return _Cmp(bool(ok), "" if ok else f"expected {expected!r}, got {got!r}", 0.0 if ok else None)


def _clone(x: Any) -> Any:
    """Deep copy, so a learner's in-place edits cannot change later cases or the reference."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, torch.nn.Module):
        return x  # models are shared read-only (they are run under no_grad by the references)
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(e) for e in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return copy.deepcopy(x)


def _describe_inputs(case: Case, reference: Callable) -> str:
    try:
        names = list(inspect.signature(reference).parameters)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        names = []
    names += [f"arg{i}" for i in range(len(names), len(case.args))]
    parts = [f"{n}={_describe(a)}" for n, a in zip(names, case.args)]
    parts += [f"{k}={_describe(v)}" for k, v in case.kwargs.items()]
    return ", ".join(parts)


def _learner_frame(exc: BaseException) -> str:
    """The last traceback line that belongs to the learner (not to torch or tinyk3 itself)."""
    import os

    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, _tinyk3_pkg()))
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if not os.path.abspath(f.filename).startswith(skip)]
    f = (mine or frames)[-1] if frames else None
    if f is None:
        return ""
    where = "your cell" if f.filename.startswith("<") or "ipykernel" in f.filename else f.filename
    code = (f.line or "").strip()
    return f" (in {where}, line {f.lineno}" + (f": `{code}`)" if code else ")")


def _tinyk3_pkg():
    import tinyk3

    return tinyk3


# -- running a check -------------------------------------------------------------------------

def wrap_report(report: str, width: int = REPORT_WIDTH) -> str:
    """The report as printed: each line wrapped to ``width`` columns, continuation lines
    indented like the line they continue (plus three spaces under the first line)."""
    out = []
    for line in report.splitlines():
        body = line.lstrip(" ")
        indent = " " * (len(line) - len(body))
        more = indent if indent else "   "
        out += textwrap.wrap(body, width=width, initial_indent=indent, subsequent_indent=more,
                             break_long_words=True, break_on_hyphens=False) or [""]
    return "\n".join(out)


def run(exercise_id: str, fn: Callable, *, verbose: bool = True) -> CheckResult:
    """Check ``fn`` against the reference of ``exercise_id`` on every case; print a report."""

    def done(result: CheckResult) -> CheckResult:
        if verbose:
            print(wrap_report(result.report))
        return result

    exercise = EXERCISES.get(exercise_id)
    if exercise is None:
        close = difflib.get_close_matches(str(exercise_id), list(EXERCISES), n=3)
        msg = f"? no exercise called {exercise_id!r}."
        msg += f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        return done(CheckResult(str(exercise_id), "error", report=msg))
    head = f"{exercise.id} ({exercise.title})"
    if not callable(fn):
        return done(CheckResult(exercise.id, "error", report=(
            f"✘ {head}: expected a function {exercise.signature}, got {_describe(fn)}."
        )))

    cases = exercise.cases()
    n_passed, worst, outputs = 0, 0.0, []
    first_fail = None  # (index, case, comparison) of the first wrong output
    first_exc = None  # (index, case, exception) of the first case that raised
    for i, case in enumerate(cases, start=1):
        expected = exercise.reference(*_clone(case.args), **_clone(case.kwargs))
        try:
            got = fn(*_clone(case.args), **_clone(case.kwargs))
        except NotImplementedError as exc:
            if i == 1:
                return done(CheckResult(exercise.id, "not attempted", 0, len(cases), report=(
                    f"○ {head}: not attempted yet (the function raises NotImplementedError).\n"
                    f"   Write {exercise.signature} in the cell above, run it, then run this "
                    "cell again."
                )))
            outputs.append(_RAISED)
            first_exc = first_exc or (i, case, exc)
            continue
        except Exception as exc:  # the learner's bug: report it, never raise it
            outputs.append(_RAISED)
            first_exc = first_exc or (i, case, exc)
            continue
        outputs.append(got)
        cmp = _compare(expected, got, exercise.atol, exercise.rtol)
        if cmp.ok:
            n_passed += 1
            worst = max(worst, cmp.max_abs_error or 0.0)
        elif first_fail is None:
            first_fail = (i, case, cmp)

    if first_fail is None and first_exc is None:
        err = f" (max abs error {worst:.1e})" if worst else " (exact)"
        return done(CheckResult(exercise.id, "passed", n_passed, len(cases), max_abs_error=worst,
                                report=f"✔ {head}: passed {n_passed}/{len(cases)} cases{err}."))

    lines = [f"✘ {head}: {n_passed}/{len(cases)} cases passed."]
    mistake, max_err = None, None
    if first_fail is not None:
        i, case, cmp = first_fail
        mistake = _match_mistake(exercise, cases, outputs, i - 1)
        max_err = cmp.max_abs_error
        lines += [
            f"   First failure: case {i}/{len(cases)}" + (f" ({case.label})" if case.label else "")
            + f", inputs {_describe_inputs(case, exercise.reference)}",
            f"   {cmp.reason}",
        ]
    if first_exc is not None:
        j, case, exc = first_exc
        lines += [
            f"   On case {j}/{len(cases)}" + (f" ({case.label})" if case.label else "")
            + f" your function raised {type(exc).__name__}: {exc}{_learner_frame(exc)}",
            f"   inputs {_describe_inputs(case, exercise.reference)}",
        ]
    hint = mistake.hint if mistake else exercise.hint
    if hint:
        lines.append(f"   Hint: {hint}")
    failed_case = min(x[0] for x in (first_fail, first_exc) if x is not None)
    return done(CheckResult(exercise.id, "failed" if first_fail else "error", n_passed,
                            len(cases), max_abs_error=max_err, failed_case=failed_case,
                            mistake=mistake.name if mistake else None, report="\n".join(lines)))


_RAISED = object()  # stands for "this case raised" in the list of the learner's outputs


def _match_mistake(
    exercise: Exercise, cases: list[Case], outputs: list[Any], failed: int
) -> Mistake | None:
    """The known mistake that explains the learner's outputs.

    Preferred: one whose output equals the learner's on every case (two mistakes can agree on
    a single case, e.g. forgetting the layers or the heads when there are 12 of each). Else the
    first that equals it on the first failing case.
    """

    def agrees(mistake: Mistake, j: int) -> bool:
        try:
            wrong = mistake.fn(*_clone(cases[j].args), **_clone(cases[j].kwargs))
        except Exception:
            return False
        return _compare(wrong, outputs[j], exercise.atol, exercise.rtol, equal_nan=True).ok

    on_failure = [m for m in exercise.mistakes if agrees(m, failed)]
    for mistake in on_failure:
        if all(agrees(mistake, j) for j in range(len(outputs))
               if j != failed and outputs[j] is not _RAISED):
            return mistake
    return on_failure[0] if on_failure else None


# -- Triton exercises (chapters 9 and 21) --------------------------------------------------------
# What the Triton exercises share (chapters 9 and 21): the learner's kernel launched under the
# Triton interpreter with every tensor in the middle of a buffer of NaN, so that a load without a
# mask past a tensor's end reads NaN instead of unknown memory and a store without a mask lands in
# an output's margin, where the launcher sees it; and the check's entry point, which says how to
# install Triton where it is missing instead of raising.

MARGIN = 4096  # elements of NaN before and after every tensor handed to the learner's kernel


class NanMargins:
    """Tensors placed inside NaN buffers; remembers the buffers of the outputs."""

    def __init__(self):
        self.outputs: list[torch.Tensor] = []

    def place(self, x: torch.Tensor, output: bool = False) -> torch.Tensor:
        """``x``'s values (float32, contiguous) in the middle of a NaN buffer, as a view."""
        x = x.float().contiguous()
        buf = torch.full((2 * MARGIN + x.numel(),), float("nan"))
        view = buf[MARGIN:MARGIN + x.numel()].view(x.shape)
        view.copy_(x)
        if output:
            self.outputs.append(buf)
        return view

    def stored_outside(self) -> int:
        """How many values a kernel wrote into the outputs' margins."""
        return sum(int((~torch.isnan(b[:MARGIN])).sum() + (~torch.isnan(b[-MARGIN:])).sum())
                   for b in self.outputs)


def interpret(kernel, grid, *args, **constexprs) -> None:
    """Launch the learner's kernel (a plain function or a ``@triton.jit`` one) under the
    interpreter. An unwritten stub's ``NotImplementedError``, wrapped by the interpreter, is
    raised as itself, so that the check reports "not attempted"."""
    from triton.runtime.interpreter import InterpretedFunction

    fn = getattr(kernel, "fn", kernel)  # a @triton.jit function: its Python function
    try:
        InterpretedFunction(fn)[grid](*args, **constexprs)
    except Exception as exc:  # the interpreter wraps errors
        if isinstance(exc.__cause__, NotImplementedError):
            raise NotImplementedError from exc
        raise


def check_kernel(exercise: Exercise, launch, kernel, verbose: bool) -> CheckResult:
    """Run ``exercise`` on ``launch(kernel)`` (a function of a case's arguments), as
    :func:`tinyk3.checks.run` does; without Triton, report that and how to install it."""
    from ..kernels import runtime

    if not runtime.AVAILABLE:
        report = (f"○ {exercise.id} ({exercise.title}): not run: it needs Triton "
                  f"({runtime.REASON}). Install it with `pip install triton` (Linux); the kernel "
                  "then runs under the Triton interpreter on the CPU.")
        if verbose:
            print(wrap_report(report))
        return CheckResult(exercise.id, "error", report=report)
    if not callable(kernel):
        return run(exercise.id, kernel, verbose=verbose)
    return run(exercise.id, launch(kernel), verbose=verbose)

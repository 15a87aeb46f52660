"""What the Triton exercises share (chapters 9 and 21): the learner's kernel launched under the
Triton interpreter with every tensor in the middle of a buffer of NaN, so that a load without a
mask past a tensor's end reads NaN instead of unknown memory and a store without a mask lands in
an output's margin, where the launcher sees it; and the check's entry point, which says how to
install Triton where it is missing instead of raising."""

from __future__ import annotations

import torch

from .core import CheckResult, Exercise, run, wrap_report

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

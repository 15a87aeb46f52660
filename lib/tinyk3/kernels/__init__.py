"""Triton kernels (chapter 9): the same contracts as :mod:`tinyk3.ops`, written as GPU kernels.

* :mod:`tinyk3.kernels.delta_rule` - ``chunked``: chunkwise DeltaNet in three Triton stages

Triton is an **optional** dependency (``pip install "tinyk3[kernels]"`` or ``pip install triton``;
wheels exist for Linux only). Without it this package still imports: :data:`AVAILABLE` is
``False``, :data:`REASON` says why, and calling a kernel raises :class:`TritonUnavailableError`
(an ``ImportError``) saying how to install it. :mod:`tinyk3.ops` has the PyTorch forms.

Where the kernels run:

* CUDA tensors: compiled for the GPU (``@triton.jit``).
* CPU tensors: the Triton interpreter (``TRITON_INTERPRET=1`` semantics, numpy underneath), chosen
  per call, so no environment variable is needed and one process can use both. Slow (each
  program instance is Python), but it runs the kernel's own code, masks and loops included.
* ``TRITON_INTERPRET=1`` set in the environment interprets CUDA tensors too.
"""

from __future__ import annotations

import re

__all__ = ["AVAILABLE", "REASON", "TRITON_VERSION", "MIN_TRITON", "TritonUnavailableError",
           "require_triton", "delta_rule"]

MIN_TRITON = (3, 2)  # tl.dot(input_precision=...), the interpreter's masks and tl.cast as used here
INSTALL_HINT = ('install it with `pip install "tinyk3[kernels]"` or `pip install triton` (Linux wheels; '
                "on a machine without a GPU the kernels run under the Triton interpreter)")


class TritonUnavailableError(ImportError):
    """A Triton kernel was called but Triton cannot be imported (or is too old)."""


def _probe() -> tuple[bool, str | None, str | None]:
    """``(available, reason, version)``: import Triton once, never raise."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install failing while it loads
        return False, f"Triton is not installed ({type(exc).__name__}: {exc})", None
    version = getattr(triton, "__version__", "0")
    parts = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if parts < MIN_TRITON:
        need = ".".join(map(str, MIN_TRITON))
        return False, f"Triton {version} is too old (tinyk3.kernels needs >= {need})", version
    return True, None, version


AVAILABLE, REASON, TRITON_VERSION = _probe()


def require_triton(what: str) -> None:
    """Raise :class:`TritonUnavailableError` naming ``what`` if Triton cannot be used."""
    if not AVAILABLE:
        raise TritonUnavailableError(
            f"{what} needs Triton: {REASON}. To use it, {INSTALL_HINT}. "
            "The PyTorch form with the same contract is in tinyk3.ops."
        )


from . import delta_rule  # noqa: E402  (after AVAILABLE: delta_rule reads it)

"""Triton kernels (chapters 9 to 11): the same contracts as :mod:`tinyk3.ops`, written as GPU kernels.

* :mod:`tinyk3.kernels.delta_rule` - ``chunked``: chunkwise DeltaNet in three Triton stages
* :mod:`tinyk3.kernels.gated_delta_rule` - ``chunked``: chunkwise Gated DeltaNet (chapter 10)
* :mod:`tinyk3.kernels.kda` - ``chunked``: chunkwise Kimi Delta Attention (chapter 11)
* :mod:`tinyk3.kernels.gated` - the gated forms of chapter 9's three stages that both share
  (one constexpr ``GATE``: a gate per head or per key channel)
* :mod:`tinyk3.kernels.backward` - the backward pass of all three as Triton kernels (chapter 21;
  one constexpr ``GATE``: 0 the delta rule, 1 Gated DeltaNet, 2 KDA), launched by each
  ``chunked``'s autograd backward
* :mod:`tinyk3.kernels.runtime` - what every kernel module shares: the availability probe, the
  per-call choice between compiled and interpreted, jitting (``KernelSet``), launch and input
  checks, compiling for a named GPU without one, ptxas reports

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

from .runtime import (  # noqa: F401
    AVAILABLE,
    INSTALL_HINT,
    MIN_TRITON,
    REASON,
    TRITON_VERSION,
    TritonUnavailableError,
    require_triton,
)

__all__ = ["AVAILABLE", "REASON", "TRITON_VERSION", "MIN_TRITON", "TritonUnavailableError",
           "require_triton", "runtime", "delta_rule", "gated", "gated_delta_rule", "kda", "backward"]

from . import backward, delta_rule, gated, gated_delta_rule, kda, runtime  # noqa: E402

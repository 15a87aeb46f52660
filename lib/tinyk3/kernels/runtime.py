"""The Triton runtime shared by every kernel of :mod:`tinyk3.kernels`, apart from any one kernel.

* Availability: :data:`AVAILABLE`, :data:`REASON`, :data:`TRITON_VERSION`, :func:`require_triton`,
  :class:`TritonUnavailableError` (Triton is optional; without it this module imports and
  nothing here touches ``triton``).
* :class:`KernelSet`: a module's kernels kept as plain functions and jitted on first use, once for
  the GPU (``triton.JITFunction``) and once for the Triton interpreter, so one process can run a
  CUDA call compiled and a CPU call interpreted. :func:`interpreting` picks per call.
* Helpers callable from a kernel (added to every :class:`KernelSet`): :func:`to_operand`, the
  cast of a tile to the operand dtype of a ``tl.dot``, with the interpreter's bfloat16 emulated.
* Launch helpers: :func:`tile_size`, :func:`check_device`, :func:`check_grid`,
  :func:`check_choice`, :func:`compile_kernel` (a compile for a named GPU target, without a GPU)
  and :func:`ptxas_report` (registers, spills and stack frame of a compiled kernel).

Why kernels call only Triton *builtins* (``tl.full`` rather than ``tl.zeros``,
``tl.reduce(x, 0, tl.standard._sum_combine)`` rather than ``tl.sum``, ``//`` rather than
``tl.cdiv``): those library helpers are themselves ``@triton.jit`` functions, fixed as compiled or
interpreted when triton is imported (``transformers``, for one, imports triton), so a kernel that
calls them cannot be both. Helpers a kernel calls are registered with :meth:`KernelSet.helper`
instead, and jitted with it.

The interpreter's bfloat16 is silently wrong in Triton 3.7: ``x.to(tl.bfloat16).to(tl.float32)``
under ``InterpretedFunction`` truncates the mantissa instead of rounding to nearest (about half
of random values differ from ``torch``'s rounding by one unit in the last place;
``tests/test_kernels.py::test_interpreter_bf16_rounding_is_emulated_exactly`` checks both), and
numpy has no bfloat16 for loads and stores. So interpreted launches get float32 tensors and
:func:`to_operand` rounds to bfloat16 by integer arithmetic on the float32 bits (round to nearest,
ties to even: the rounding of ``torch.Tensor.bfloat16``), which is exact.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import subprocess
import tempfile
import types
from pathlib import Path
from types import SimpleNamespace

import torch

__all__ = ["AVAILABLE", "REASON", "TRITON_VERSION", "MIN_TRITON", "TritonUnavailableError",
           "require_triton", "KernelSet", "to_operand", "interpreting", "interpreter_only",
           "cannot_compile_reason", "tile_size", "check_device", "check_grid", "check_choice",
           "compile_kernel", "ptxas_report", "GRID_LIMIT"]

MIN_TRITON = (3, 2)  # tl.dot(input_precision=...), the interpreter's masks and tl.cast as used here
INSTALL_HINT = ('install it with `pip install "tinyk3[kernels]"` or `pip install triton` (Linux wheels; '
                "on a machine without a GPU the kernels run under the Triton interpreter)")
GRID_LIMIT = 65535  # CUDA grids allow 65535 programs along their 2nd and 3rd axes


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

if AVAILABLE:
    import triton
    import triton.language as tl
else:  # kernels stay plain functions; nothing below touches triton until require_triton passed
    triton = tl = None


def require_triton(what: str) -> None:
    """Raise :class:`TritonUnavailableError` naming ``what`` if Triton cannot be used."""
    if not AVAILABLE:
        raise TritonUnavailableError(
            f"{what} needs Triton: {REASON}. To use it, {INSTALL_HINT}. "
            "The PyTorch form with the same contract is in tinyk3.ops."
        )


# ---------------------------------------------------------------------------------------------
# Helpers a kernel may call (jitted with the kernels that call them)
# ---------------------------------------------------------------------------------------------

def to_operand(x, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """A float32 tile as the operand of a ``tl.dot`` (or a stored intermediate): unchanged when
    ``BF16`` is false; else cast to bfloat16 (compiled), or rounded to the nearest bfloat16 value
    and kept in float32 (``EMULATE``, for the interpreter: see the module docstring). A float32
    product of two bfloat16 values is exact, so the emulation computes what the tensor cores
    compute up to the order of the float32 accumulation."""
    if BF16:
        if EMULATE:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep the top 16 bits, rounded
            x = bits.to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.bfloat16)
    return x


_RUNTIME_HELPERS = {"to_operand": to_operand}


def _interpreter_range(*bounds):
    """``range`` for interpreted kernels. The interpreter hands runtime integers to a kernel as
    one-element arrays; before Triton 3.7 it turned them into loop bounds with ``int(array)``,
    which NumPy 2.4 refuses (only 0-d arrays convert). Compiled kernels use the builtin."""
    return range(*(int(b.handle.data.reshape(-1)[0]) if hasattr(b, "handle") else int(b) for b in bounds))


_INTERPRETER_USED = False  # set by the first interpreted launch (see cannot_compile_reason)


class KernelSet:
    """The kernels of one module, as plain functions, jitted on demand.

    ``ks = KernelSet("tinyk3.kernels.delta_rule")``; decorate each kernel with ``@ks.kernel``
    (where ``@triton.jit`` would go) and each function a kernel calls with ``@ks.helper``;
    ``ks.get(interpret)`` returns a namespace of launchable kernels. Under the interpreter each
    kernel runs as Python in a copy of its module's namespace (the interpreter adds its own names
    to the namespace it is given); compiled, the helpers are ``JITFunction`` s in that namespace.
    :func:`to_operand` is always available to the kernels; ``uses=(other,)`` adds another
    set's helpers (registered before this set is made)."""

    def __init__(self, owner: str, uses: tuple = ()):
        self.owner = owner
        self.kernels: dict = {}
        self.helpers: dict = dict(_RUNTIME_HELPERS)
        for other in uses:  # another module's helpers, callable from these kernels too
            self.helpers.update(other.helpers)
        self._built: dict = {}

    def kernel(self, fn):
        self.kernels[fn.__name__] = fn
        return fn

    def helper(self, fn):
        self.helpers[fn.__name__] = fn
        return fn

    def get(self, interpret: bool) -> SimpleNamespace:
        require_triton(self.owner)
        if interpret not in self._built:
            self._built[interpret] = self._build(interpret)
        if interpret:
            global _INTERPRETER_USED
            _INTERPRETER_USED = True
        return self._built[interpret]

    def _build(self, interpret: bool) -> SimpleNamespace:
        fns = {**self.helpers, **self.kernels}
        first = next(iter(self.kernels.values()))
        ns = dict(first.__globals__)

        def copy(fn):
            c = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
            c.__annotations__, c.__kwdefaults__ = dict(fn.__annotations__), fn.__kwdefaults__
            return c

        copies = {name: copy(fn) for name, fn in fns.items()}
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            ns["range"] = _interpreter_range
            ns.update({name: copies[name] for name in self.helpers})  # plain Python calls
            return SimpleNamespace(**{name: InterpretedFunction(copies[name]) for name in self.kernels})
        ns.update({name: triton.JITFunction(copies[name]) for name in self.helpers})
        return SimpleNamespace(**{name: triton.JITFunction(copies[name]) for name in self.kernels})


# ---------------------------------------------------------------------------------------------
# Where a call runs
# ---------------------------------------------------------------------------------------------

def _env_interpret() -> bool:
    """``TRITON_INTERPRET`` as Triton reads it (``triton.knobs`` from 3.4, the variable before)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def interpreter_only() -> bool:
    """True if this process can only interpret Triton kernels, not compile them: triton was
    imported with ``TRITON_INTERPRET=1``, so its own library functions are interpreter objects."""
    require_triton("tinyk3.kernels.runtime.interpreter_only")
    return not isinstance(tl.standard._sum_combine, triton.JITFunction)


def interpreting(device: torch.device) -> bool:
    """Whether a launch on ``device`` runs under the interpreter: CPU tensors always, CUDA tensors
    when ``TRITON_INTERPRET`` is set (or was set when triton was imported)."""
    return device.type == "cpu" or _env_interpret() or interpreter_only()


def cannot_compile_reason() -> str | None:
    """Why this process cannot compile kernels for a GPU (``None`` if it can): triton was imported
    with ``TRITON_INTERPRET=1``, or Triton < 3.6 has run the interpreter here (it leaves its
    patches on ``triton.language`` in place; 3.6 restores them)."""
    require_triton("tinyk3.kernels.runtime.cannot_compile_reason")
    if interpreter_only():
        return ("triton was imported with TRITON_INTERPRET=1, so this process can only interpret "
                "kernels; compile in a process without it")
    version = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    if _INTERPRETER_USED and version < (3, 6):
        return (f"Triton {triton.__version__} keeps the interpreter's patches after an interpreted "
                "launch in this process; compile in a fresh process (or use Triton >= 3.6)")
    return None


# ---------------------------------------------------------------------------------------------
# Launch helpers and input validation shared by the kernels
# ---------------------------------------------------------------------------------------------

def tile_size(n: int) -> int:
    """Tile size for a dimension of ``n``: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def check_device(t: torch.Tensor, op: str) -> None:
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: tensors must be on a CUDA device (compiled) or the CPU (Triton "
                         f"interpreter), got {t.device}")


def check_grid(op: str, heads: int, chunks: int) -> None:
    """At most :data:`GRID_LIMIT` heads and chunks per launch (the CUDA grid's 2nd and 3rd axes)."""
    if heads > GRID_LIMIT or chunks > GRID_LIMIT:
        raise ValueError(f"{op}: at most {GRID_LIMIT} heads (B·H = {heads}) and {GRID_LIMIT} chunks "
                         f"(T / chunk_size = {chunks}) per call; split the call")


def check_choice(op: str, name: str, value, choices, why: str = "") -> None:
    """``value`` must be one of ``choices`` (``True`` is not the int 1 here)."""
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{op}: {name} must be one of {tuple(choices)}{why}, got {value!r}")


_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def pointer_type(dtype: torch.dtype) -> str:
    """Triton's signature string for a pointer to ``dtype`` (``"*bf16"``)."""
    return "*" + _TRITON_DTYPE[dtype]


def compile_kernel(fn, signature: dict, constexprs: dict, *, arch: int, num_warps: int,
                   num_stages: int):
    """Compile a jitted kernel (``KernelSet.get(False)``'s) for ``GPUTarget("cuda", arch, 32)``
    **without a GPU**: ``triton.compile`` runs the whole tool chain (Triton IR → TritonGPU IR →
    LLVM IR → PTX → the ptxas inside the Triton wheel → cubin). ``signature`` maps the runtime
    arguments to Triton types (``"*bf16"``, ``"i32"``); ``constexprs`` the compile-time ones."""
    require_triton("tinyk3.kernels.runtime.compile_kernel")
    reason = cannot_compile_reason()
    if reason:
        raise RuntimeError(f"compile_kernel: {reason}")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # The constexpr keyword is ``constexprs`` from Triton 3.3, ``constants`` before.
    key = "constexprs" if "constexprs" in inspect.signature(ASTSource).parameters else "constants"
    full = {**signature, **{c: "constexpr" for c in constexprs}}
    src = ASTSource(fn=fn, signature=full, **{key: constexprs})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def ptxas_report(ptx: str) -> dict:
    """Run the ptxas shipped with Triton (``-v``) on a PTX listing and return what it reports:
    ``registers`` per thread, ``spill_stores`` / ``spill_loads`` and ``stack_frame`` (bytes per
    thread of local memory), and the ``text`` of the report. A thread can use at most 255
    registers; what does not fit is spilled to local memory (off-chip, cached)."""
    require_triton("tinyk3.kernels.runtime.ptxas_report")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    arch = re.search(r"[.]target (\S+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), "-v", f"--gpu-name={arch}", str(src), "-o",
                              str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True,
                             check=True)
    text = out.stdout + out.stderr

    def num(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack_frame": num(r"(\d+) bytes stack frame"),
            "text": text}

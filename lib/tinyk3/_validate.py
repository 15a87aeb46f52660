"""Argument validation shared by the library: one helper per kind of argument, one message style.

Python's ``bool`` is a subclass of ``int`` (``True == 1``), so ``isinstance(True, int)`` holds;
sizes and counts reject it explicitly, because ``chunk_size=True`` is always a mistake.
"""

from __future__ import annotations

import numbers

__all__ = ["positive_int", "nonnegative_int", "is_int"]


def is_int(x) -> bool:
    """Whether ``x`` is an integer (a Python or numpy int, or a 0-d integer tensor's ``.item()``),
    and not a ``bool``."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def positive_int(x, name: str, op: str | None = None) -> int:
    """``int(x)`` if ``x`` is an integer >= 1, else ``ValueError`` naming ``op`` and ``name``."""
    if not is_int(x) or x < 1:
        where = f"{op}: " if op else ""
        raise ValueError(f"{where}{name} must be a positive int, got {x!r}")
    return int(x)


def nonnegative_int(x, name: str, op: str | None = None) -> int:
    """``int(x)`` if ``x`` is an integer >= 0, else ``ValueError`` naming ``op`` and ``name``."""
    if not is_int(x) or x < 0:
        where = f"{op}: " if op else ""
        raise ValueError(f"{where}{name} must be a non-negative int, got {x!r}")
    return int(x)

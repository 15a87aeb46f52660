"""The one timing helper of the course, and its one statistic.

Every time printed in a chapter, and every row of ``python -m tinyk3.bench``, comes from
:func:`time_fn`: it runs ``fn`` ``warmup`` times unmeasured (first-call costs: allocation, caches,
compilation), then ``repeats`` times measured, and returns the **median** of the measured runs
as a :class:`Timing`. A ``Timing`` is a ``float`` (seconds), so it prints and divides like one, and it
keeps its runs: ``low`` and ``high`` are the first and third quartiles of the runs (for 5 runs,
the 2nd and 4th fastest), the **spread** the book reports when two forms are close.
:func:`distinguishable` says whether two timings' quartile ranges are apart; where they are not,
a chapter says "within the spread" instead of ranking them.

Why the median: on a shared machine the slow tail of a run comes from other work (another
process, the OS), and the median ignores it, where a mean follows it; unlike the minimum it
does not reward one lucky run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ._validate import nonnegative_int, positive_int

__all__ = ["Timing", "time_fn", "distinguishable", "STATISTIC"]

STATISTIC = "median of the measured runs after warm-up runs; spread = first to third quartile"


class Timing(float):
    """Median seconds of a set of runs (a ``float``), with the runs and their quartiles."""

    runs: tuple[float, ...]

    def __new__(cls, runs):
        runs = tuple(sorted(float(r) for r in runs))
        if not runs:
            raise ValueError("Timing needs at least one run")
        n = len(runs)
        median = runs[n // 2] if n % 2 else 0.5 * (runs[n // 2 - 1] + runs[n // 2])
        self = super().__new__(cls, median)
        self.runs = runs
        return self

    @property
    def seconds(self) -> float:
        return float(self)

    @property
    def low(self) -> float:
        """First quartile of the runs (the fastest run for fewer than 4 runs)."""
        return self.runs[(len(self.runs) - 1) // 4]

    @property
    def high(self) -> float:
        """Third quartile of the runs (the slowest run for fewer than 4 runs)."""
        return self.runs[len(self.runs) - 1 - (len(self.runs) - 1) // 4]

    @property
    def spread(self) -> float:
        """``(high - low) / median``: the relative width of the middle of the runs."""
        return (self.high - self.low) / float(self) if float(self) > 0 else 0.0

    def ms(self, digits: int = 1) -> str:
        """``"median (low-high)"`` in milliseconds, each with ``digits`` decimals: how the
        chapters print a time with its spread."""
        return (f"{float(self) * 1e3:.{digits}f} "
                f"({self.low * 1e3:.{digits}f}-{self.high * 1e3:.{digits}f})")

    def __repr__(self) -> str:
        return (f"Timing({float(self):.4g} s, quartiles {self.low:.4g}-{self.high:.4g} s, "
                f"{len(self.runs)} runs)")

    def __str__(self) -> str:  # prints as the number it is (CSV cells, f"{t}")
        return float.__repr__(self)

    def __reduce__(self):
        return (Timing, (self.runs,))


def time_fn(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1,
            min_seconds: float = 0.0, max_seconds: float | None = None,
            cuda: bool = False) -> Timing:
    """Time ``fn()``: ``warmup`` unmeasured runs, then ``repeats`` measured ones; their median.

    ``min_seconds``: keep measuring past ``repeats`` until this much time has been measured (for
    very fast functions). ``max_seconds``: stop adding runs once this much has been measured (at
    least one run is always made), so that a slow configuration costs a bounded time; the
    statistic is then the median of the runs made. ``cuda=True`` synchronises after each run
    (GPU work is asynchronous).
    """
    positive_int(repeats, "repeats", "time_fn")
    nonnegative_int(warmup, "warmup", "time_fn")
    if cuda:
        import torch

        inner = fn

        def fn():
            inner()
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    runs: list[float] = []
    measured = 0.0
    while len(runs) < repeats or measured < min_seconds:
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
        measured += runs[-1]
        if max_seconds is not None and measured >= max_seconds:
            break
    return Timing(runs)


def distinguishable(a: Timing, b: Timing) -> bool:
    """Whether the quartile ranges of two timings do not overlap (so ranking them is fair)."""
    return a.high < b.low or b.high < a.low

"""Autograded exercises. ``run(exercise_id, fn)`` checks a learner's function.

>>> from tinyk3 import checks
>>> ok = checks.run("gpt2.param_count", my_param_count)   # doctest: +SKIP
✔ gpt2.param_count (GPT-2 parameter count): passed 6/6 cases (exact).
"""

from . import gpt2 as _gpt2  # noqa: F401  (registers chapter 1's exercises)
from . import kv_cache as _kv_cache  # noqa: F401  (registers chapter 2's exercises)
from .core import EXERCISES, Case, CheckResult, Exercise, Mistake, register, run

__all__ = ["run", "EXERCISES", "Exercise", "Case", "Mistake", "CheckResult", "register"]

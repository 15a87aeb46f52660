"""Autograded exercises. ``run(exercise_id, fn)`` checks a learner's function.

>>> from tinyk3 import checks
>>> ok = checks.run("gpt2.param_count", my_param_count)   # doctest: +SKIP
✔ gpt2.param_count (GPT-2 parameter count): passed 6/6 cases (exact).

Each chapter's exercises live in a module named after the chapter (``ch01_gpt2``,
``ch02_kv_cache``, ..., ``ch09_kernel``) that registers them on import; every such module is
imported here, so the registry is complete. Exercise ids (``"gpt2.param_count"``) name the topic,
and ``Exercise.chapter`` the chapter.
"""

import importlib
import pkgutil

from .core import EXERCISES, Case, CheckResult, Exercise, Mistake, register, run

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "core":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["run", "EXERCISES", "Exercise", "Case", "Mistake", "CheckResult", "register"]

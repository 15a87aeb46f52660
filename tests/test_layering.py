"""The package's layering, held as import rules (read from the source with ``ast``, so a
function-level import counts too):

* ``tinyk3.ops`` imports no layer, model, check, timing or benchmark: the maths stands alone;
* ``tinyk3.kernels`` imports no layer and no model;
* ``tinyk3.layers`` imports no model and no check;
* ``tinyk3.models`` imports no check;
* no mixer module of ``tinyk3.layers`` imports another mixer module: what two layers share lives
  in ``layers/parts.py``, ``layers/base.py``, ``layers/forms.py`` or ``_validate.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tinyk3
from tinyk3.layers import MIXERS

ROOT = Path(tinyk3.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (``from x import y`` gives ``x`` and
    ``x.y``, since ``y`` may be a submodule)."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


MODULES = {_module_name(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}
RULES = [  # (package, packages it must not import)
    ("tinyk3.ops", ("tinyk3.layers", "tinyk3.models", "tinyk3.checks", "tinyk3.timing",
                    "tinyk3.bench")),
    ("tinyk3.kernels", ("tinyk3.layers", "tinyk3.models")),
    ("tinyk3.layers", ("tinyk3.models", "tinyk3.checks")),
    ("tinyk3.models", ("tinyk3.checks",)),
]


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("package, forbidden", RULES, ids=[r[0] for r in RULES])
def test_layers_import_only_downward(package, forbidden):
    bad = sorted((mod, imp) for mod, imps in MODULES.items() if _under(mod, package)
                 for imp in imps if any(_under(imp, f) for f in forbidden))
    assert not bad, f"{package} imports what it must not: {bad}"


def test_no_mixer_module_imports_another():
    mixers = {cls.__module__ for cls in MIXERS.values()}
    assert len(mixers) == 7
    bad = sorted((m, imp) for m in mixers for imp in MODULES[m]
                 if imp in mixers - {m} or any(imp.startswith(x + ".") for x in mixers - {m}))
    assert not bad, f"mixer modules importing a sibling mixer module: {bad}"


def test_the_rules_see_imports():
    """The parser finds relative and function-level imports (else the rules assert nothing)."""
    assert "tinyk3.ops.attention" in MODULES["tinyk3.layers.mla"]
    assert "tinyk3.layers.forms" in MODULES["tinyk3.layers.kda"]
    assert "tinyk3.kernels" in MODULES["tinyk3.layers.forms"]  # imported inside a function

"""Every module of the package imports, with Triton or without it (`make unit-no-triton`
runs this with `import triton` failing: Triton is optional)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tinyk3

pytestmark = pytest.mark.triton

MODULES = sorted(m.name for m in pkgutil.walk_packages(tinyk3.__path__, "tinyk3."))


def test_the_package_has_modules():
    assert {"tinyk3.widgets", "tinyk3.kernels", "tinyk3.bench", "tinyk3.checks", "tinyk3.layers",
            "tinyk3.layers.conv", "tinyk3.models", "tinyk3.models.presets"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(name)

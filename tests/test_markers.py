"""The `triton` marker is complete: `make unit-no-triton` reruns only the tests marked
`triton` with Triton hidden, so a test module that reaches Triton, ``tinyk3.kernels``,
``tinyk3.bench`` or fla without the marker would never be tried without Triton."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REACHES = re.compile(
    r"^\s*(import triton|from triton|import fla|from fla|import tinyk3\.(kernels|bench)"
    r"|from tinyk3\.(kernels|bench)|from tinyk3 import [\w ,(]*\b(kernels|bench)\b)", re.M)
MARKED = re.compile(r"^pytestmark = .*pytest\.mark\.triton", re.M)
# Hides Triton itself (a stub package first on the kernel's path), in every run.
EXEMPT = {"test_without_triton.py", "test_markers.py"}


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.stem)
def test_modules_that_reach_triton_are_marked(path):
    if path.name in EXEMPT:
        pytest.skip("exempt")
    text = path.read_text(encoding="utf-8")
    if REACHES.search(text):
        assert MARKED.search(text), (
            f"{path.name} reaches Triton/kernels/bench/fla: add `pytestmark = pytest.mark.triton`")


def test_the_marker_pattern_sees_what_it_should():
    assert REACHES.search("import tinyk3.kernels as kernels")
    assert REACHES.search("from tinyk3 import bench")
    assert REACHES.search("    from fla.ops.delta_rule.naive import delta_rule_recurrence")
    assert not REACHES.search("from tinyk3 import checks  # kernels are elsewhere")

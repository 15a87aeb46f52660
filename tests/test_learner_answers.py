"""The learner answers of every chapter, in one harness. Each ``tests/test_checks_chNN.py``
(and ``tests/test_checks.py`` for chapters 1 and 2) labels answers where it writes them:
``@wrong(exercise_id, mistake)`` on one written the way a learner gets the exercise wrong
(independently of the registered Mistake functions), ``@right(exercise_id)`` on one written
differently from the reference (answers made by a factory are listed in ``REALISTIC`` and
``CORRECT``, see ``helpers``). Here, for every chapter:

* each wrong answer fails, is matched to the mistake it names (or to none: the exercise's
  general hint), and the printed report shows that hint and the first failing case;
* each correct answer passes every case;
* each exercise has at least two wrong answers matched to named mistakes (here, or by name
  in a chapter file's ``NAMED_ELSEWHERE`` where another test catches them).

That a raising or NaN-returning answer is reported, never raised, is tested for every exercise
of the registry in ``tests/test_checks.py``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from helpers import assert_caught, assert_passes, labelled
from tinyk3 import checks

SOURCES = ["test_checks"] + sorted(p.stem for p in Path(__file__).parent.glob("test_checks_ch*.py"))
ANSWERS = [importlib.import_module(name) for name in SOURCES]


def _chapter(exercise_id: str) -> int:
    return checks.EXERCISES[exercise_id].chapter


WRONG = [(_chapter(e), e, fn, m) for mod in ANSWERS
         for (e, m), fn in labelled(mod, "wrong_for")
         + [((e, m), fn) for e, fn, m in getattr(mod, "REALISTIC", [])]]
RIGHT = [(_chapter(e), e, fn) for mod in ANSWERS
         for e, fn in labelled(mod, "right_for")
         + [(e, fn) for e, fns in getattr(mod, "CORRECT", {}).items() for fn in fns]]
# Wrong answers tested elsewhere, by name: {exercise_id: {mistake names}} (Triton kernels, say)
ELSEWHERE = {e: set(ms) for mod in ANSWERS for e, ms in getattr(mod, "NAMED_ELSEWHERE", {}).items()}
CHAPTERS = sorted({e.chapter for e in checks.EXERCISES.values()})


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


@pytest.mark.parametrize("chapter, exercise_id, fn, mistake", WRONG,
                         ids=[f"ch{c}:{e}:{_name(f)}:{i}" for i, (c, e, f, _) in enumerate(WRONG)])
def test_realistic_wrong_answer_is_caught(chapter, exercise_id, fn, mistake, capsys):
    assert_caught(exercise_id, fn, mistake, capsys)


@pytest.mark.parametrize("chapter, exercise_id, fn", RIGHT,
                         ids=[f"ch{c}:{e}:{_name(f)}:{i}" for i, (c, e, f) in enumerate(RIGHT)])
def test_realistic_correct_answer_passes(chapter, exercise_id, fn):
    assert_passes(exercise_id, fn)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exercise_has_two_hand_written_wrong_answers(chapter):
    ids = sorted(e.id for e in checks.EXERCISES.values() if e.chapter == chapter)
    for exercise_id in ids:
        named = {m for c, e, _, m in WRONG if e == exercise_id} | ELSEWHERE.get(exercise_id, set())
        assert len(named - {None}) >= 2, exercise_id

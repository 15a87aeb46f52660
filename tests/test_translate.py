"""The Japanese edition's machinery (tools/translate.py): blocks, catalogs, the merge that
marks changed English stale, the checks that `make translations` runs, and the generated
notebooks. The real catalogs are checked by `make translations` itself; here each check is
shown to fail on the mistake it exists for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import translate as tr  # noqa: E402

CELL = """# A title

A paragraph with $x_t$ and `code`,
wrapped over two lines.

$$
S_t = S_{t-1} + k_t^\\top v_t
$$

```python
print("not prose")
```

````{exercise} Write it
:label: ex-test

Write `f(x)`: return $2x$.
````

```{solution-start} ex-test
:class: dropdown
```
"""


def test_split_gives_the_text_back_and_keeps_fences_and_displays_whole():
    pieces = tr.split(CELL)
    assert "".join(text for _, text in pieces) == CELL
    blocks = [text for is_block, text in pieces if is_block]
    assert blocks[0] == "# A title"
    assert blocks[1].count("\n") == 1  # the wrapped paragraph is one block
    assert blocks[2].startswith("$$") and blocks[2].endswith("$$")
    assert any(b.startswith("````{exercise}") and b.endswith("````") for b in blocks)
    # a blank line inside a fence does not end the block
    fenced = "```{note}\nOne.\n\nTwo.\n```"
    assert [t for b, t in tr.split(fenced) if b] == [fenced]


def test_only_prose_needs_a_translation():
    needs = {text: tr.needs_translation(text) for b, text in tr.split(CELL) if b}
    assert [t.split("\n")[0] for t, n in needs.items() if n] == [
        "# A title", "A paragraph with $x_t$ and `code`,", "````{exercise} Write it"]
    assert not tr.needs_translation("$$\na + b\n$$")
    assert not tr.needs_translation("```{solution-end}\n```")
    assert not tr.needs_translation("(label-only)=")


def test_keep_spans_catches_a_changed_formula_code_link_or_option():
    en = ("See {doc}`../notebooks/05_deltanet` and [the paper](https://arxiv.org/abs/1) for "
          "$S_t$ and `f(x)`.\n:label: ex-a")
    good = ("{doc}`../notebooks/05_deltanet` と[論文](https://arxiv.org/abs/1)で $S_t$ と "
            "`f(x)` を見る。\n:label: ex-a")
    assert tr.keep_spans(en) == tr.keep_spans(good)
    for bad in (good.replace("$S_t$", "$S$"), good.replace("`f(x)`", "`f(y)`"),
                good.replace("abs/1", "abs/2"), good.replace("ex-a", "ex-b"),
                good.replace("{doc}`../notebooks/05_deltanet`", "第 5 章")):
        assert tr.keep_spans(en) != tr.keep_spans(bad), bad


def _entry(en, ja, was=None):
    return {"where": "cell x, block 1", "en": en, "ja": ja, "was": was}


def test_entry_problems_name_missing_stale_english_and_changed_maths():
    en = "The state $S_t$ holds every pair."
    assert tr.entry_problems("c", _entry(en, "状態 $S_t$ はすべての対を保持する。")) == []
    assert "missing translation" in tr.entry_problems("c", _entry(en, ""))[0]
    stale = tr.entry_problems("c", _entry(en, "状態 $S_t$ は対を保持する。",
                                          was="The state $S_t$ holds pairs."))
    assert "stale" in stale[0] and "-The state $S_t$ holds pairs." in stale[0]
    assert "no Japanese" in tr.entry_problems("c", _entry(en, en))[0]
    assert "math spans differ" in tr.entry_problems("c", _entry(en, "状態 $S$ は対を持つ。"))[0]


def test_emphasis_that_would_show_its_asterisks_is_reported():
    en = "The **state** is kept."
    assert tr.entry_problems("c", _entry(en, "**状態**は保持される。")) == []
    problems = tr.entry_problems("c", _entry(en, "**「状態」**は保持される。"))
    assert problems and "asterisks" in problems[0]


def test_merge_keeps_moved_blocks_marks_changed_ones_stale_and_adds_new_ones():
    old = [{"where": "cell a, block 1", "en": "First paragraph of the chapter, long enough.",
            "ja": "章の最初の段落。"},
           {"where": "cell a, block 2", "en": "Second paragraph, about chunks and states.",
            "ja": "第二の段落。"}]
    blocks = [tr.Block("cell b, block 1", "Second paragraph, about chunks and states."),
              tr.Block("cell b, block 2", "First paragraph of the chapter, long enough!"),
              tr.Block("cell b, block 3", "A completely new block about experts.")]
    merged = tr.merge(blocks, old)
    assert merged[0]["ja"] == "第二の段落。" and merged[0].get("was") is None
    assert merged[1]["ja"] == "章の最初の段落。"
    assert merged[1]["was"] == "First paragraph of the chapter, long enough."
    assert merged[2]["ja"] == "" and merged[2]["where"] == "cell b, block 3"


def test_catalog_round_trip(tmp_path):
    entries = [{"where": "block 1", "en": "  Indented first line\nsecond", "ja": "字下げ\n二行目"},
               {"where": "block 2", "en": "Quotes \" and back\\slashes: $\\beta$", "ja": ""},
               {"where": "block 3", "en": "x", "ja": "旧訳", "was": "y"}]
    path = tmp_path / "c.yml"
    tr.dump_catalog(path, "test", entries)
    back = tr.load_catalog(path)
    assert [(e["en"], e["ja"], e.get("was")) for e in back] == \
        [(e["en"], e["ja"], e.get("was")) for e in entries]


def test_exercise_statements_get_the_note_that_checks_print_english():
    ja = "````{exercise} 書く\n:label: ex-test\n\n`f(x)` を書く。\n````"
    out = tr._with_exercise_note(ja)
    assert out.endswith(f"\n\n{tr.EXERCISE_NOTE}\n````")
    assert tr._with_exercise_note("ただの段落。") == "ただの段落。"


def test_generated_notebook_keeps_every_code_cell_and_translates_captions(monkeypatch, tmp_path):
    nb = {"cells": [
        {"cell_type": "markdown", "id": "m1", "metadata": {},
         "source": ["# A title\n", "\n", "A paragraph with $x_t$."]},
        {"cell_type": "code", "id": "c1", "execution_count": 1, "outputs": [
            {"output_type": "stream", "name": "stdout", "text": ["English output\n"]}],
         "metadata": {"mystnb": {"figure": {"caption": "A plot of $x$.", "name": "fig"},
                                 "image": {"alt": "A line going up"}}},
         "source": ["print('English output')"]}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "x.ipynb").write_text(json.dumps(nb))
    monkeypatch.setattr(tr, "ROOT", tmp_path)
    monkeypatch.setattr(tr, "JA", tmp_path / "ja")
    monkeypatch.setattr(tr, "CATALOGS", tmp_path / "ja" / "translations")
    blocks = tr.extract("notebooks/x")
    assert [b.where for b in blocks] == ["cell m1, block 1", "cell m1, block 2",
                                         "cell c1, figure caption", "cell c1, figure alt"]
    answers = ["# 題", "段落 $x_t$。", "$x$ のプロット。", "右上がりの線"]
    entries = [{"where": b.where, "en": b.en, "ja": a} for b, a in zip(blocks, answers)]
    tr.dump_catalog(tr.catalog_path("notebooks/x"), "x", entries)
    problems: list[str] = []
    path, text = tr.generate("notebooks/x", problems)
    assert problems == [] and path == tmp_path / "ja" / "notebooks" / "x.ipynb"
    ja = json.loads(text)
    assert "".join(ja["cells"][0]["source"]) == "# 題\n\n段落 $x_t$。"
    assert ja["cells"][1]["source"] == nb["cells"][1]["source"]
    assert ja["cells"][1]["outputs"] == nb["cells"][1]["outputs"]
    assert ja["cells"][1]["metadata"]["mystnb"]["figure"]["caption"] == "$x$ のプロット。"
    # a missing translation is named, never silently left English
    tr.dump_catalog(tr.catalog_path("notebooks/x"), "x", entries[:1])
    problems = []
    tr.generate("notebooks/x", problems)
    assert len(problems) == 3 and "no translation" in problems[0]


@pytest.mark.parametrize("lang, page, href", [
    ("en", "notebooks/01_gpt2", "../ja/notebooks/01_gpt2.html"),
    ("en", "index", "ja/index.html"),
    ("ja", "notebooks/01_gpt2", "../../notebooks/01_gpt2.html"),
    ("ja", "book/intro", "../../book/intro.html"),
])
def test_language_switch_links_the_same_page_in_the_other_edition(lang, page, href):
    sys.path.insert(0, str(REPO / "book" / "_ext"))
    import tinyk3_site

    assert tinyk3_site.other_edition_href(page, lang) == href


def test_japanese_search_terms_are_the_same_for_the_index_and_a_compound_query():
    sys.path.insert(0, str(REPO / "book" / "_ext"))
    import tinyk3_site

    text = tinyk3_site.japanese_terms("線形注意（linear attention）の状態 $S$")
    query = tinyk3_site.japanese_terms("線形注意")
    assert set(query) <= set(text) and query == ["線形", "形注", "注意"]
    assert "linear" in text and "attention" in text
    assert tinyk3_site.japanese_terms("状") == ["状"]


def test_first_uses_lists_a_bracketless_first_use_only(monkeypatch, tmp_path):
    (tmp_path / "ja" / "translations" / "notebooks").mkdir(parents=True)
    (tmp_path / "ja" / "terms.yml").write_text(
        "- {en: linear attention, ja: 線形注意}\n- {en: attention, ja: 注意}\n"
        "- {en: state, ja: 状態}\n- {bracket: false, en: summary, ja: まとめ}\n")
    monkeypatch.setattr(tr, "JA", tmp_path / "ja")
    monkeypatch.setattr(tr, "CATALOGS", tmp_path / "ja" / "translations")
    entries = [{"where": "cell a, block 1", "en": "# Linear attention", "ja": "# 状態と線形注意"},
               {"where": "cell a, block 2", "en": "x",
                "ja": "線形注意（linear attention）は状態を持つ。まとめると、状態（state）である。"}]
    tr.dump_catalog(tr.catalog_path("notebooks/x"), "x", entries)
    found = tr.first_uses("notebooks/x")
    # the heading does not count; 注意 inside 線形注意 is not a use of 注意; まとめ is exempt
    assert len(found) == 1 and found[0].startswith("状態 (state)")

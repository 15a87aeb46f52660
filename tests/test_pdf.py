"""The whole-book PDF (`make pdf`, before the browser step): tools/book_pdf.py printed Sphinx's
single-page build in Chromium and wrote a record beside the PDF. Every page of _toc.yml is in
it, every formula typeset, no raw TeX and no block wider than the page, and the PDF is a real
file of the recorded number of pages."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import book_pdf  # noqa: E402

VERSION = re.search(r'__version__ = "([^"]+)"', (REPO / "lib/tinyk3/__init__.py").read_text())[1]
PDF = REPO / "dist" / f"tinyk3-book-{VERSION}.pdf"


@pytest.fixture(scope="module")
def record():
    if not PDF.is_file():
        pytest.fail(f"no {PDF.relative_to(REPO)}: run `make pdf` first", pytrace=False)
    return json.loads(PDF.with_suffix(".json").read_text())


@pytest.mark.browser
def test_the_pdf_holds_every_page_of_the_book(record):
    titles = book_pdf.toc_titles(REPO)
    assert len(titles) >= 25  # 18 chapters, an appendix, the prose pages
    assert record["missing"] == []
    assert record["chapters_found"] >= len(titles)
    assert record["version"] == VERSION


@pytest.mark.browser
def test_the_pdf_is_typeset_and_nothing_is_cut(record):
    assert record["formulas"] > 3000 and record["unrendered_formulas"] == 0
    assert record["raw_tex"] == []
    assert record["cut_off"] == []


@pytest.mark.browser
def test_the_pdf_file_has_its_recorded_pages(record):
    data = PDF.read_bytes()
    assert data.startswith(b"%PDF-") and data.rstrip().endswith(b"%%EOF")
    assert book_pdf.pdf_pages(PDF) == record["pages"]
    assert 300 < record["pages"] < 1500  # the book, outputs, figures and solutions
    assert record["bytes"] == len(data)


def test_plain_titles_drop_numbers_and_markup():
    assert book_pdf.plain("10. Gated DeltaNet") == "Gated DeltaNet"
    assert book_pdf.plain("The `LMConfig` of $D_k$") == "The LMConfig of D_k"
    assert book_pdf.plain("Associative memory: how much can a D×D state hold?") == (
        "Associative memory: how much can a D×D state hold?")

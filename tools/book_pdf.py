"""The whole book as one PDF: Sphinx's single-page build printed by the Chromium the browser
tests drive (no LaTeX toolchain).

    python tools/book_pdf.py _build/singlehtml dist/tinyk3-book-VERSION.pdf --version VERSION

``make pdf`` builds ``_build/singlehtml`` (``jupyter-book build --builder singlehtml``) and runs
this. The page is printed with every solution unfolded and every folded output opened (the PDF
is also the answer key), a title page in front of the book's own contents, and page numbers.
Before printing it is measured in print media at the width of the A4 text block, and a record
lands beside the PDF (``.json``): the chapters found, the formulas typeset, raw TeX left in the
text, blocks wider than the page, and the page count. The tool fails if a chapter of
``_toc.yml`` is missing, MathJax did not typeset, raw TeX is left, or a block is cut off.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from site_browser import RAW_TEX, chromium, serve, toc_files  # noqa: E402

A4_TEXT_PX = 680  # 210 mm less 2 × 15 mm margins, at 96 px per inch

PREPARE = """(args) => {
  const [title, version] = args;
  // the answer key: every solution unfolded, every folded output open, no toggle buttons
  document.querySelectorAll('.toggle-hidden').forEach(e => e.classList.remove('toggle-hidden'));
  document.querySelectorAll('.toggle-button').forEach(e => e.remove());
  document.querySelectorAll('details').forEach(d => d.open = true);
  // chrome that means nothing on paper
  document.querySelectorAll('.bd-header, .bd-sidebar-primary, .bd-sidebar-secondary, '
    + '.header-article, .prev-next-area, footer, .tinyk3-launch-bar, #pst-back-to-top, '
    + '.headerlink').forEach(e => e.remove());
  const main = document.querySelector('article') || document.body;
  const page = document.createElement('section');
  page.className = 'tinyk3-title-page';
  page.innerHTML = `<h1>${title}</h1><p>Every mechanism built, derived and checked</p>`
    + `<p>The course book, version ${version}: every chapter with its outputs and figures, `
    + `and the solutions to the exercises unfolded.</p>`;
  page.style.cssText = 'break-after: page; padding-top: 30%; text-align: center;';
  main.prepend(page);
  return true;
}"""

MEASURE = """(width) => {
  const root = document.querySelector('article') || document.body;
  // each page of the book follows a <span id="document-…"> marker; its title is the first heading
  const chapters = [...root.querySelectorAll('span[id^="document-"] + section')].map(
    s => s.querySelector('h1, h2, h3').textContent.replace('#', '').trim());
  const clone = root.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, textarea, mjx-container, .highlight, '
                         + '.widget-subarea').forEach(e => e.remove());
  const cut = [];
  for (const b of root.querySelectorAll('pre, table, mjx-container[display="true"], img')) {
    if (!b.checkVisibility()) continue;
    const w = Math.max(b.scrollWidth, b.getBoundingClientRect().width);
    if (w > width + 1) cut.push(`${b.tagName.toLowerCase()}: ${b.textContent.trim().slice(0, 60)}`);
  }
  return {chapters, text: clone.textContent, formulas: root.querySelectorAll('mjx-container').length,
          unrendered: [...root.querySelectorAll('.math')].filter(
            e => !e.querySelector('mjx-container') && !e.closest('mjx-container')).length,
          cut};
}"""

PRINT_CSS = """
@page { size: A4; margin: 16mm 15mm 18mm 15mm; }
html, body { background: #fff !important; }
.bd-main, .bd-content, .bd-article-container, article { max-width: none !important; width: auto !important;
  margin: 0 !important; padding: 0 !important; }
span[id^="document-"] + section { break-before: page; }
.tinyk3-title-page h1 { font-size: 2.2rem; }
.tinyk3-title-page + * { break-before: page; }
pre, table, figure, .admonition { break-inside: avoid-page; }
mjx-container[display="true"] { font-size: 92% !important; }
.pst-scrollable-table-container { overflow: visible !important; }
table { font-size: 0.8rem; }
"""


def toc_titles(book: Path) -> list[str]:
    """The files of _toc.yml (chapters, appendices, prose pages), as the page titles to find:
    read from each source's first heading."""
    titles = []
    for stem in toc_files(book / "_toc.yml")[1:]:  # the root is the title page's place
        for suffix in (".ipynb", ".md"):
            path = book / f"{stem}{suffix}"
            if not path.is_file():
                continue
            text = path.read_text(encoding="utf-8")
            if suffix == ".ipynb":
                cells = json.loads(text)["cells"]
                text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
            m = re.search(r"^# (.+)$", text, re.M)
            if m:
                titles.append(m.group(1).strip())
            break
    return titles


def pdf_pages(path: Path) -> int:
    """Pages of a PDF as Chromium writes it (one ``/Type /Page`` object per page)."""
    return len(re.findall(rb"/Type\s*/Page(?![s\w])", path.read_bytes()))


def plain(title: str) -> str:
    """A heading's text as the page shows it: markdown and TeX markers dropped."""
    title = re.sub(r"^\d+\.\s+", "", title.strip())  # the chapter number the page adds
    return re.sub(r"[`*$\\{}]", "", title).strip()


def build(single: Path, out: Path, version: str, book: Path = REPO) -> dict:
    page_src = single / "book" / "intro.html"
    if not page_src.is_file():
        raise SystemExit(f"no single-page build at {page_src}: run `make pdf`")
    # The single page lives in book/ but its links are written relative to the build's root.
    printable = single / "book-print.html"
    shutil.copyfile(page_src, printable)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with chromium() as browser, serve(single) as url:
        context = browser.new_context(viewport={"width": 1100, "height": 1400})
        page = context.new_page()
        page.set_default_timeout(300_000)
        page.goto(url + printable.name, wait_until="load")
        page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
        page.evaluate("() => MathJax.startup.promise.then(() => true)")
        page.wait_for_function("() => [...document.images].every(i => i.complete)")
        page.evaluate(PREPARE, ["GPT-2 to Kimi K3", version])
        page.add_style_tag(content=PRINT_CSS)
        page.emulate_media(media="print")
        page.set_viewport_size({"width": A4_TEXT_PX, "height": 1000})
        info = page.evaluate(MEASURE, A4_TEXT_PX)
        page.pdf(path=str(out), prefer_css_page_size=True, print_background=False,
                 display_header_footer=True, header_template="<span></span>",
                 footer_template='<div style="font-size:8px;width:100%;text-align:center;">'
                                 '<span class="pageNumber"></span> / '
                                 '<span class="totalPages"></span></div>')
        context.close()
    printable.unlink()
    found = {plain(t) for t in info["chapters"]}
    missing = [t for t in toc_titles(book) if plain(t) not in found]
    raw = [info["text"][max(0, m.start() - 30):m.end() + 30]
           for m in RAW_TEX.finditer(info["text"])][:5]
    record = {"pdf": out.name, "version": version, "pages": pdf_pages(out),
              "bytes": out.stat().st_size, "chapters_found": len(info["chapters"]),
              "missing": missing, "formulas": info["formulas"],
              "unrendered_formulas": info["unrendered"], "raw_tex": raw,
              "cut_off": info["cut"][:10], "seconds": round(time.perf_counter() - start, 1)}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("single", type=Path, help="the singlehtml build folder")
    ap.add_argument("out", type=Path, help="the PDF to write")
    ap.add_argument("--version", required=True)
    args = ap.parse_args(argv)
    r = build(args.single, args.out, args.version)
    print(f"wrote {args.out} ({r['pages']} pages, {r['bytes'] / 2**20:.1f} MiB, "
          f"{r['formulas']:,} formulas, {r['seconds']} s)")
    problems = []
    if r["missing"]:
        problems.append(f"pages of _toc.yml not in the PDF: {r['missing']}")
    if r["unrendered_formulas"] or not r["formulas"]:
        problems.append(f"formulas not typeset: {r['unrendered_formulas']} (typeset {r['formulas']})")
    if r["raw_tex"]:
        problems.append(f"raw TeX in the text: {r['raw_tex']}")
    if r["cut_off"]:
        problems.append(f"blocks wider than the page: {r['cut_off']}")
    for p in problems:
        print(f"book_pdf: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The built website in a real browser (`make browser`, after `make html`), at a desktop
width (1280 px) and a phone width (390 px, touch), with every outside request blocked.

Serves _build/html on 127.0.0.1, opens every page listed in _toc.yml in headless Debian
Chromium (driven by Playwright; no browser is ever downloaded), and fails a page on:

* any failed request, any response with status >= 400, any request to another host;
* any console error or uncaught page error;
* math that MathJax did not render, or raw TeX left in the text (any ``$``, ``\\(``, ``\\[``);
* a page wider than the screen (it would scroll sideways as a whole);
* a table cell squeezed narrower than a few characters of its text; an inline formula cut
  off at the right with no way to scroll; an output of more than 30 lines not folded;
* code, output or display-math blocks that scroll sideways: none on a desktop (code is at
  most 88 columns, long equations are broken into lines,
  outputs wrap, except aligned ones: tables, listings and diffs, which site.js marks); on a
  phone only code, aligned outputs and wide tables or equations scroll, inside their own box
  with a shadow that shows it (counted per page in
  _build/screenshots/<view>/<page>.overflow.json); none in print;
* on a phone: the chapter menu (☰) and the in-page contents do not open when tapped; the
  chapter menu opens with the current page's entry off-screen; the contents stay open after
  an entry is tapped; the title fills more than half of the first screen;
* on a desktop: ☰ does not collapse the sidebar or shows no keyboard focus; a launch badge
  below WCAG AA contrast (4.5 : 1); a solution that is not folded or does not
  unfold; a chapter (``notebooks/NN_…``, not an appendix notebook) without a solution;
* on chapter pages: no figure; a figure without a caption or with alt text that is a file
  name; a figure shown smaller than its size (squeezed); no "Open in Colab" badge in the
  first screen; a widget that did not render or does not respond to its sliders, shows
  indices instead of values, does not fit a phone, or whose picture has no alt text.

The Japanese edition (_build/html/ja, built from ja/): a sample of its pages (JA_SAMPLE:
the landing page, chapters heavy in maths, tables, widgets and kernels, the glossary) gets
the same checks in the browser, plus: no untranslated paragraph in the rendered page, and the
language switch. Without a browser, every page of both editions: the switch leads to the
same page in the other edition, no Japanese page has a paragraph left in English, every
Japanese chapter's badges open the Japanese notebook. Japanese search finds a compound term.

A page that fails leaves a full-page screenshot in _build/screenshots/<view>/;
TINYK3_SCREENSHOTS=1 takes one of every page (about 3 s each, the largest single cost of
this check). TINYK3_SITE=/path/to/_build/html checks another build (its book root is two
levels up).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from site_browser import (
    JAPANESE,
    JS_WIDGETS_DONE,
    RAW_TEX,
    VIEWPORTS,
    WIDGET_STATE,
    WIDGET_VIEW,
    PageLog,
    check_widgets,
    chromium,
    first,
    prose_blocks,
    serve,
    toc_files,
    untranslated,
    wait,
    widget_labels,
)

REPO = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("TINYK3_SITE", REPO / "_build" / "html")).resolve()
BOOK = SITE.parents[1] if (SITE.parents[1] / "_toc.yml").is_file() else REPO
SHOTS = SITE.parent / "screenshots"
CONFIG = yaml.safe_load((BOOK / "_config.yml").read_text()) if (BOOK / "_config.yml").is_file() else {}

# Errors that are not the site's fault and that nothing in the repository can switch off.
KNOWN_HARMLESS = (
    # Jupyter Book 1 (Sphinx 7.4) emits sphinx-thebe's inline `const THEBE_JS_URL = ...`
    # script twice on every page; the second copy throws. Thebe is not used by this site.
    "Identifier 'THEBE_JS_URL' has already been declared",
)

# Math in a page source: $$, $...$, \( \[, {math} roles/directives, amsmath environments.
SOURCE_MATH = re.compile(
    r"\$\$|(?<![\\$\w])\$[^$\s][^$\n]*?(?<![\\\s])\$|\\\(|\\\[|\{math\}|\\begin\{[a-z]+\*?\}"
)
# The Colab / Kaggle links of a chapter, as book/_ext/tinyk3_site.py writes them.
REPO_SLUG = CONFIG.get("repository", {}).get("url", "").removeprefix("https://github.com/")
BRANCH = CONFIG.get("repository", {}).get("branch", "main")


# ------------------------------------------------------------------------------------------
# pages


def source_of(page: str, book: Path = BOOK) -> Path | None:
    for suffix in (".ipynb", ".md", ".rst"):
        path = book / f"{page}{suffix}"
        if path.is_file():
            return path
    return None


def prose_of(source: Path) -> str:
    """The text of a page source in which math can appear (markdown, not code)."""
    text = source.read_text(encoding="utf-8")
    if source.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        text = "\n".join(
            "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in cells if c["cell_type"] == "markdown"
        )
    # Drop fenced code (but keep {directive} fences such as {math}) and inline code.
    text = re.sub(r"^(```+|~~~+)(?!\s*\{)[^\n]*\n.*?^\1\s*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]+`", "", text)


PAGES = toc_files(BOOK / "_toc.yml") if (BOOK / "_toc.yml").is_file() else []

# The Japanese edition: its book (ja/, generated by tools/translate.py) and its site.
JA_BOOK = BOOK / "ja"
JA_SITE = SITE / "ja"
JA_PAGES = toc_files(JA_BOOK / "_toc.yml") if (JA_BOOK / "_toc.yml").is_file() else []
# Checked in the browser at both widths (make test's time: each page-view costs 3-10 s).
JA_SAMPLE = ["book/intro", "notebooks/03_linear_attention", "notebooks/08_chunkwise_deltanet",
             "notebooks/14_mixture_of_experts", "notebooks/18_the_road_compared",
             "book/glossary"]
EDITIONS = {"en": (BOOK, SITE, ""), "ja": (JA_BOOK, JA_SITE, "ja/")}
SCREENSHOTS = os.environ.get("TINYK3_SCREENSHOTS") == "1"


def launch_urls(page_file: str, edition: str = "en") -> dict[str, str]:
    path = f"{EDITIONS[edition][2]}{page_file}.ipynb"
    repo = f"https://github.com/{REPO_SLUG}"
    return {
        "colab": f"https://colab.research.google.com/github/{REPO_SLUG}/blob/{BRANCH}/{path}",
        "kaggle": f"https://kaggle.com/kernels/welcome?src={repo}/blob/{BRANCH}/{path}",
    }


# ------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def base():
    """Base URL of the built site, served on a free local port."""
    if not (SITE / "index.html").is_file():
        pytest.fail(f"no built site at {SITE}: run `make html` first", pytrace=False)
    for view in VIEWPORTS:
        (SHOTS / view).mkdir(parents=True, exist_ok=True)
    with serve(SITE) as url:
        yield url


# ------------------------------------------------------------------------------------------
# what is measured on a page

JS_MATH_STATE = """() => {
  const root = document.querySelector('article') || document.body;
  const unrendered = [...root.querySelectorAll('.math')]
    .filter(e => !e.querySelector('mjx-container') && !e.closest('mjx-container'))
    .map(e => e.textContent.trim().slice(0, 80));
  const clone = root.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, textarea, mjx-container, .highlight, '
                         + '.widget-subarea').forEach(e => e.remove());
  return {rendered: root.querySelectorAll('mjx-container').length, unrendered,
          text: clone.textContent};
}"""

# Every image; for cell outputs (not widget pictures) also its figure, caption, alt text and
# the width it asks for (retina output metadata: the width attribute) against its shown one.
JS_IMAGES = """() => [...document.images].map(i => {
  const fig = i.closest('figure');
  const cap = fig && fig.querySelector('figcaption');
  return {src: (i.currentSrc || i.src).slice(0, 120), ok: i.complete && i.naturalWidth > 0,
          output: !!i.closest('.cell_output') && !i.closest('.widget-subarea'),
          alt: i.getAttribute('alt') || '', caption: cap ? cap.textContent.trim() : '',
          wanted: parseFloat(i.style.width) || parseFloat(i.getAttribute('width')) || 0,
          shown: i.getBoundingClientRect().width};
})"""

# sphinx-togglebutton folds an admonition by giving it `toggle-hidden`: its children after
# the title get visibility: hidden and height 0.
JS_SHOWN = """(s) => [...s.children].some(c => !c.classList.contains('admonition-title')
  && c.checkVisibility({visibilityProperty: true}) && c.getBoundingClientRect().height > 0)"""

JS_SOLUTIONS = f"""() => [...document.querySelectorAll('.solution')].map(s => ({{
  id: s.id, cls: s.className,
  button: !!s.querySelector(':scope > .admonition-title .toggle-button'),
  shown: ({JS_SHOWN})(s)}}))"""

# Blocks that scroll sideways, by kind, and how wide the page itself is.
JS_OVERFLOW = """() => {
  const root = document.querySelector('article') || document.body;
  const kind = b => b.closest('.cell_input') ? 'code'
    : b.closest('.widget-subarea') ? 'widget'
    : b.matches('.cell_output pre.tinyk3-aligned') ? 'aligned'
    : b.closest('.cell_output') ? 'output'
    : b.matches('.pst-scrollable-table-container') ? 'table'
    : b.matches('mjx-container') ? 'math' : 'listing';
  const blocks = [...root.querySelectorAll(
    'pre, .pst-scrollable-table-container, mjx-container[display="true"]')];
  const counts = {code: 0, output: 0, aligned: 0, widget: 0, table: 0, math: 0, listing: 0};
  const examples = [];
  const unmarked = [];
  for (const b of blocks) {
    if (!(b.scrollWidth > b.clientWidth + 1) || !b.checkVisibility()) continue;
    const k = kind(b);
    counts[k] += 1;
    if (examples.length < 4) examples.push(`${k}: ${b.textContent.trim().slice(0, 70)}`);
    const cs = getComputedStyle(b);
    if ((k === 'table' || k === 'math' || k === 'aligned') && !(cs.overflowX === 'auto'
        && cs.backgroundImage.includes('gradient'))) unmarked.push(k);
  }
  const de = document.documentElement;
  return {counts, examples, unmarked, blocks: blocks.length,
          page: de.scrollWidth, screen: de.clientWidth};
}"""

# What a reader cannot read on a page: table cells squeezed narrower than a few characters
# (their longest word, at most 4), inline formulas cut off with no way to scroll, and outputs
# of more than 30 lines not folded (site.js folds them behind a summary).
JS_LAYOUT = """() => {
  const root = document.querySelector('article') || document.body;
  const ctx = document.createElement('canvas').getContext('2d');
  const squeezed = [];
  for (const cell of root.querySelectorAll('td, th')) {
    const text = cell.textContent.trim();
    if (!text || !cell.checkVisibility()) continue;
    const cs = getComputedStyle(cell);
    ctx.font = cs.font;
    const ch = ctx.measureText('0').width;
    const width = cell.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
    const need = Math.min(4, Math.max(...text.split(/\\s+/).map(w => w.length)));
    if (width < need * ch - 1) squeezed.push(`${text.slice(0, 30)} (${(width / ch).toFixed(1)} ch)`);
  }
  const clipped = [];
  for (const c of root.querySelectorAll('mjx-container:not([display="true"])')) {
    if (!c.checkVisibility()) continue;
    const r = c.getBoundingClientRect();
    const inner = c.firstElementChild ? c.firstElementChild.getBoundingClientRect() : r;
    const scrolls = o => o === 'auto' || o === 'scroll';
    let cut = inner.width > r.width + 1 && !scrolls(getComputedStyle(c).overflowX);
    for (let a = c.parentElement; a && a !== root && !cut; a = a.parentElement) {
      const s = getComputedStyle(a);
      if (s.overflowX === 'visible') continue;
      cut = r.right > a.getBoundingClientRect().right + 1 && !scrolls(s.overflowX);
      break;
    }
    if (cut) clipped.push(c.textContent.slice(0, 50));
  }
  const long = [...root.querySelectorAll('div.cell_output pre')]
    .filter(p => p.textContent.replace(/\\n+$/, '').split('\\n').length > 30
                 && !p.closest('details'))
    .map(p => p.textContent.trim().slice(0, 60));
  return {squeezed, clipped, long};
}"""

# Keyboard focus on ☰ (after a key press, so that :focus-visible applies) and the launch
# badges' contrast (WCAG AA: 4.5 : 1 for their text size).
JS_FOCUS_AND_CONTRAST = """() => {
  const toggle = [...document.querySelectorAll('.primary-toggle')].find(b => b.checkVisibility());
  let focus = null;
  if (toggle) {
    toggle.focus();
    const cs = getComputedStyle(toggle);
    focus = {visible: toggle.matches(':focus-visible'),
             outline: cs.outlineStyle !== 'none' && parseFloat(cs.outlineWidth) >= 2,
             shadow: cs.boxShadow !== 'none'};
    toggle.blur();
  }
  const rgb = c => (c.match(/[\\d.]+/g) || []).slice(0, 3).map(Number);
  const lum = c => { const v = rgb(c).map(x => { x /= 255;
    return x <= 0.03928 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4); });
    return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]; };
  const badges = [...document.querySelectorAll('a.tinyk3-launch')].map(a => {
    const cs = getComputedStyle(a);
    const [l1, l2] = [lum(cs.color), lum(cs.backgroundColor)].sort((x, y) => y - x);
    return {text: a.textContent.trim(), ratio: (l1 + 0.05) / (l2 + 0.05)};
  });
  return {focus, badges};
}"""

JS_SIDEBARS = """() => {
  const box = e => { if (!e || !e.checkVisibility()) return null;
    const r = e.getBoundingClientRect(); return r.width > 0 && r.right > 0 && r.left < innerWidth; };
  const primary = document.getElementById('pst-primary-sidebar-modal');
  const secondary = document.getElementById('pst-secondary-sidebar-modal');
  return {primaryModal: !!(primary && primary.open),
          primaryLinks: primary ? primary.querySelectorAll('a').length : 0,
          secondaryModal: !!(secondary && secondary.open),
          secondaryLinks: secondary ? secondary.querySelectorAll('a').length : 0,
          sidebar: box(document.querySelector('.bd-sidebar-primary'))};
}"""

# The alt text of every visible picture in a widget (site.js writes it from the sliders).
JS_WIDGET_ALT = """() => [...document.querySelectorAll('.widget-subarea img')]
  .filter(im => im.checkVisibility()).map(im => im.getAttribute('alt') || '')"""

# In the opened chapter menu: is the current page's entry on screen? (None: no such entry.)
JS_CURRENT_IN_MENU = """() => {
  const menu = document.getElementById('pst-primary-sidebar-modal');
  const cur = menu ? [...menu.querySelectorAll('li.current > a, a.current')].pop() : null;
  if (!cur) return null;
  const r = cur.getBoundingClientRect();
  return r.top >= 0 && r.bottom <= innerHeight;
}"""

JS_LAUNCH = """() => [...document.querySelectorAll('a.tinyk3-launch')].map(a => ({
  href: a.href, text: a.textContent.trim(), visible: a.checkVisibility(),
  top: a.getBoundingClientRect().top}))"""


def settle(page, problems: list[str]) -> None:
    """Wait for widgets, MathJax, images and the network to finish."""
    if page.locator(WIDGET_VIEW).count() and page.locator(WIDGET_STATE).count():
        wait(page, problems, JS_WIDGETS_DONE, "widgets did not finish rendering")
    if page.locator('script[src*="mathjax/"]').count():
        if wait(page, problems, "() => window.MathJax && MathJax.startup"
                " && MathJax.startup.promise && MathJax.typesetPromise",
                "MathJax did not start"):
            try:
                page.evaluate("() => MathJax.startup.promise.then(() => true)")
            except Exception as exc:
                problems.append(f"MathJax failed: {str(exc).splitlines()[0]}")
    wait(page, problems, "() => [...document.images].every(i => i.complete)",
         "images did not finish loading")
    page.wait_for_load_state("networkidle")


def check_text(page, source: Path, problems: list[str]) -> None:
    math = page.evaluate(JS_MATH_STATE)
    if SOURCE_MATH.search(prose_of(source)) and not math["rendered"]:
        problems.append("the source has math but MathJax rendered none (no mjx-container)")
    problems += first(f"math element not rendered by MathJax: {t!r}" for t in math["unrendered"])
    text = math["text"]
    problems += first(f"raw TeX in the page text: {text[max(0, m.start() - 40):m.end() + 40]!r}"
                      for m in RAW_TEX.finditer(text))
    for placeholder in ("@REPO_URL@", "@REPO_DIR@", "<the repository URL>", "<the folder>"):
        if placeholder in page.content():
            problems.append(f"placeholder {placeholder!r} left in the page")


def check_overflow(page, view: str, page_file: str, problems: list[str]) -> dict:
    info = page.evaluate(JS_OVERFLOW)
    if info["page"] > info["screen"] + 1:
        problems.append(f"the page is {info['page']} px wide on a {info['screen']} px screen "
                        "(it scrolls sideways as a whole)")
    c = info["counts"]
    scrolling_allowed = {"desktop": {"table", "aligned"},
                         "phone": {"code", "table", "math", "listing", "aligned"}}[view]
    for k, n in c.items():
        if n and k not in scrolling_allowed:
            problems.append(f"{n} {k} block(s) scroll sideways at {view} width; e.g. "
                            + " | ".join(e for e in info["examples"] if e.startswith(k))[:300])
    for k in info["unmarked"]:
        problems.append(f"a wide {k} scrolls with no shadow showing that it does")
    # Beside the page's screenshot (one file per test: the browser tests may run in parallel).
    record = SHOTS / view / f"{page_file.replace('/', '-')}.overflow.json"
    record.write_text(json.dumps({"page": page_file, "view": view, "blocks": info["blocks"],
                                  "scrolling_sideways": c, "page_width": info["page"],
                                  "screen_width": info["screen"]}, indent=1))
    return info


def check_layout(page, problems: list[str]) -> None:
    info = page.evaluate(JS_LAYOUT)
    if info["squeezed"]:
        problems.append(f"{len(info['squeezed'])} table cell(s) squeezed narrower than their "
                        "text (a column a few characters wide): "
                        + "; ".join(info["squeezed"][:4]))
    if info["clipped"]:
        problems.append(f"{len(info['clipped'])} inline formula(s) cut off at the right with "
                        "no way to scroll: " + "; ".join(info["clipped"][:3]))
    if info["long"]:
        problems.append(f"{len(info['long'])} output(s) of more than 30 lines not folded: "
                        + "; ".join(info["long"][:3]))


JS_ICONS = """async () => {
  await document.fonts.ready;
  const out = {script: [...document.scripts].filter(s => /fontawesome\\.js/.test(s.src)).length,
               svg: document.querySelectorAll("svg.svg-inline--fa").length, bad: [], shown: 0};
  for (const el of document.querySelectorAll("i[class*='fa-'], span[class*='fa-']")) {
    if (!el.checkVisibility()) continue;
    out.shown++;
    const before = getComputedStyle(el, "::before");
    const drawn = before.content && !["none", "normal", '""'].includes(before.content);
    const font = `${before.fontWeight} 16px ${before.fontFamily}`;
    if (!drawn || !document.fonts.check(font) || el.getBoundingClientRect().width < 4)
      out.bad.push(`${el.className} (${before.fontFamily}, content ${before.content})`);
  }
  return out;
}"""


def check_icons(page, problems: list[str]) -> None:
    """The theme's icons are drawn by the Font Awesome web fonts its stylesheet names; the
    1.5 MB Font Awesome script is not loaded (book/_ext/tinyk3_site.py removes it)."""
    info = page.evaluate(JS_ICONS)
    if info["script"] or info["svg"]:
        problems.append(f"Font Awesome's script is loaded ({info['script']} script tag(s), "
                        f"{info['svg']} icon(s) replaced by SVG): 1.5 MB the web fonts make "
                        "unnecessary")
    if not info["shown"]:
        problems.append("no visible icon found (the header's search, menu, download?)")
    for bad in info["bad"][:4]:
        problems.append(f"an icon is not drawn: {bad}")


def check_focus_and_contrast(page, problems: list[str]) -> None:
    page.keyboard.press("Shift")  # the last input is the keyboard: focus is focus-visible
    info = page.evaluate(JS_FOCUS_AND_CONTRAST)
    focus = info["focus"]
    if focus is None:
        problems.append("no visible ☰ to focus")
    elif not (focus["visible"] and (focus["outline"] or focus["shadow"])):
        problems.append(f"☰ shows no keyboard focus (an outline of 2 px or more): {focus}")
    for badge in info["badges"]:
        if badge["ratio"] < 4.5:
            problems.append(f"the {badge['text']!r} badge's contrast is {badge['ratio']:.2f} : 1 "
                            "(WCAG AA needs 4.5 : 1)")


def check_print(page, problems: list[str]) -> None:
    """At a sheet of paper's width (A4 at 96 dpi, less margins), in print media: no block
    cuts text off on the right."""
    page.set_viewport_size({"width": 700, "height": 900})
    page.emulate_media(media="print")
    info = page.evaluate(JS_OVERFLOW)
    cut = {k: n for k, n in info["counts"].items()
           if n and k in ("code", "output", "aligned", "listing")}
    if cut:
        problems.append(f"in print, blocks wider than the page (text lost): {cut}; e.g. "
                        + " | ".join(info["examples"])[:300])
    page.emulate_media(media="screen")
    page.set_viewport_size(VIEWPORTS["desktop"]["viewport"])


def check_figures(images: list[dict], notebook: bool, view: str, problems: list[str]) -> None:
    for img in images:
        if not img["ok"]:
            problems.append(f"image did not load: {img['src']}")
    figures = [i for i in images if i["ok"] and i["output"]]
    if notebook and not figures:
        problems.append("chapter page has no figure (no loaded <img> in a cell output)")
    for img in figures:
        alt = img["alt"].strip()
        if not img["caption"]:
            problems.append(f"figure without a caption (mystnb.figure.caption): alt {alt[:60]!r}")
        if len(alt.split()) < 3 or re.search(r"\.(png|svg|jpe?g)$|_images/", alt):
            problems.append(f"figure alt text {alt[:80]!r} does not describe it "
                            "(mystnb.image.alt)")
        if not img["wanted"]:
            problems.append(f"figure {alt[:40]!r} has no display width (stored without the "
                            "retina metadata of tinyk3.setup())")
        elif view == "desktop" and img["shown"] < 0.9 * img["wanted"]:
            problems.append(f"figure {alt[:40]!r} squeezed to {img['shown']:.0f} px of its "
                            f"{img['wanted']:.0f} (make it at most 6.8 in wide)")


def check_solutions(page, notebook: bool, problems: list[str]) -> None:
    solutions = page.evaluate(JS_SOLUTIONS)
    if notebook and not solutions:
        problems.append("chapter page has no solution (expected `{solution-start}` with "
                        "`:class: dropdown` after the exercises)")
    for s in solutions:
        if "dropdown" not in s["cls"].split():
            problems.append(f"solution {s['id']} is not a dropdown (add `:class: dropdown`)"
                            f"; classes: {s['cls']}")
        elif not s["button"]:
            problems.append(f"solution {s['id']} has no toggle button (sphinx-togglebutton "
                            "did not fold it)")
        elif s["shown"]:
            problems.append(f"solution {s['id']} is not folded by default")
    if solutions and solutions[0]["button"]:
        sid = solutions[0]["id"]
        page.locator(".solution .toggle-button").first.click()
        if not wait(page, [], f"(id) => ({JS_SHOWN})(document.getElementById(id))", "",
                    arg=sid):
            problems.append(f"solution {sid} does not unfold when its button is clicked")


def check_menus(page, view: str, problems: list[str]) -> None:
    """Phone: tapping ☰ opens the chapter menu, tapping the contents button opens the page's
    contents. Desktop: clicking ☰ collapses the sidebar and clicking it again restores it."""
    toggles = page.locator(".primary-toggle").filter(visible=True)
    if not toggles.count():
        problems.append(f"no visible ☰ (primary sidebar toggle) at {view} width")
        return
    if view == "phone":
        toggles.first.tap()
        if not wait(page, [], f"() => ({JS_SIDEBARS})().primaryModal", ""):
            problems.append("tapping ☰ on a phone does not open the chapter menu")
        else:
            state = page.evaluate(JS_SIDEBARS)
            if not state["sidebar"] or state["primaryLinks"] < 3:
                problems.append(f"the chapter menu opened but shows {state['primaryLinks']} "
                                "links / is off-screen")
            current = page.evaluate(JS_CURRENT_IN_MENU)
            if current is not None and not current:
                problems.append("the chapter menu opened with the current page's entry "
                                "off-screen")
        page.keyboard.press("Escape")
        wait(page, problems, f"() => !({JS_SIDEBARS})().primaryModal",
             "the chapter menu did not close on Escape")
        contents = page.locator(".secondary-toggle").filter(visible=True)
        if page.locator("#pst-page-toc-nav a").count() and contents.count():
            contents.first.tap()
            if not wait(page, [], f"() => ({JS_SIDEBARS})().secondaryModal", ""):
                problems.append("tapping the contents button on a phone does not open the "
                                "page's contents")
            else:
                entries = page.locator("#pst-secondary-sidebar-modal a[href^='#']")
                if entries.count() > 1:
                    entries.nth(1).tap()
                    if not wait(page, [], f"() => !({JS_SIDEBARS})().secondaryModal", ""):
                        problems.append("the page's contents stay open after tapping an "
                                        "entry")
            page.keyboard.press("Escape")
        elif page.locator("#pst-page-toc-nav a").count():
            problems.append("the page has contents but no visible contents button on a phone")
    else:
        toggles.first.click()
        if not wait(page, [], f"() => !({JS_SIDEBARS})().sidebar", ""):
            problems.append("clicking ☰ on a desktop does not collapse the sidebar")
        toggles.first.click()
        if not wait(page, [], f"() => ({JS_SIDEBARS})().sidebar", ""):
            problems.append("clicking ☰ again on a desktop does not bring the sidebar back")


def check_japanese(page, page_file: str, problems: list[str]) -> None:
    """A Japanese page as rendered: no paragraph left in English (code, maths and outputs
    aside), the page declared Japanese, and a visible switch to the same English page."""
    for text in first(untranslated(page.content()), 6):
        problems.append(f"untranslated paragraph: {text[:120]!r}")
    if page.evaluate("document.documentElement.lang") != "ja":
        problems.append("the Japanese page does not declare lang=\"ja\"")
    switch = page.locator("p.tinyk3-lang-switch a[hreflang=en]")
    if not switch.count() or not switch.first.is_visible():
        problems.append("no visible switch to the English page")
    else:
        href = switch.first.evaluate("(a) => a.href")
        if not href.endswith(f"/{page_file}.html") or "/ja/" in href:
            problems.append(f"the switch leads to {href}")


def check_launch(page, page_file: str, view: str, problems: list[str],
                 edition: str = "en") -> None:
    links = page.evaluate(JS_LAUNCH)
    height = VIEWPORTS[view]["viewport"]["height"]
    want = launch_urls(page_file, edition)
    for host, url in want.items():
        found = [a for a in links if a["href"] == url]
        if not found:
            problems.append(f"no {host.title()} badge linking to {url}")
        elif not found[0]["visible"] or found[0]["top"] > height:
            problems.append(f"the {host.title()} badge is not in the first screen "
                            f"at {view} width (top {found[0]['top']:.0f} px)")


# ------------------------------------------------------------------------------------------
# the tests


@pytest.mark.browser
@pytest.mark.parametrize("view", list(VIEWPORTS))
@pytest.mark.parametrize("edition, page_file",
                         [("en", p) for p in PAGES] + [("ja", p) for p in JA_SAMPLE])
def test_page(browser, base, edition, page_file, view):
    book, site, prefix = EDITIONS[edition]
    source = source_of(page_file, book)
    assert source is not None, f"{page_file} is in _toc.yml but has no source under {book}"
    notebook = source.suffix == ".ipynb"
    html = site / f"{page_file}.html"
    assert html.is_file(), f"{html} missing: rebuild the site (`make html`)"

    context = browser.new_context(service_workers="block", **VIEWPORTS[view])
    page = context.new_page()
    page.set_default_timeout(15_000)
    log = PageLog(page, context, harmless=KNOWN_HARMLESS)
    problems: list[str] = []
    url = base + f"{prefix}{page_file}.html"
    shot = SHOTS / view / f"{prefix.replace('/', '-')}{page_file.replace('/', '-')}.png"
    try:
        page.goto(url, wait_until="load")
        settle(page, problems)
        if SCREENSHOTS:
            page.screenshot(path=str(shot), full_page=True)
        check_text(page, source, problems)
        if edition == "ja":
            check_japanese(page, page_file, problems)
        check_overflow(page, view, page_file, problems)
        check_layout(page, problems)
        check_icons(page, problems)
        check_figures(page.evaluate(JS_IMAGES), notebook, view, problems)
        if notebook:
            check_launch(page, page_file, view, problems, edition)
        if view == "phone":
            title = page.locator("article h1").first
            if title.count() and title.bounding_box()["height"] > 0.5 * 844:
                problems.append("the title fills more than half of a phone's first screen")
        labels = None
        if notebook:
            nb = json.loads(source.read_text(encoding="utf-8"))
            state = nb.get("metadata", {}).get("widgets", {}).get(
                "application/vnd.jupyter.widget-state+json", {})
            labels = widget_labels(state)
        check_widgets(page, problems, labels=labels, phone=view == "phone")
        page.wait_for_timeout(100)  # site.js describes a moved widget's frame after 50 ms
        for alt in page.evaluate(JS_WIDGET_ALT):
            if len(alt.split()) < 3:
                problems.append(f"a widget's picture has no alt text describing it: {alt!r}")
        check_menus(page, view, problems)
        if view == "desktop":  # a chapter has exercises; an appendix notebook (A1_…) need not
            chapter = notebook and re.match(r"notebooks/\d\d_", page_file) is not None
            check_solutions(page, chapter, problems)
            check_focus_and_contrast(page, problems)
            check_print(page, problems)
        page.wait_for_load_state("networkidle")
        problems = log.report() + problems
        if problems and not SCREENSHOTS:
            page.screenshot(path=str(shot), full_page=True)
    finally:
        context.close()

    assert not problems, f"{url} at {view} width ({source.relative_to(BOOK)}; screenshot " \
        f"{shot.relative_to(SITE.parent)}):\n  " + "\n  ".join(problems)


@pytest.mark.browser
def test_a_figure_opens_enlarged_on_a_phone(browser, base):
    """Tapping a multi-panel figure on a phone (chapter 18's nine-panel Fig. 18.2) opens it at
    least 680 px wide in a layer that scrolls sideways, with the focus on its Close button;
    Escape closes it and gives the focus back to the figure; a tap on the layer closes it."""
    page_file = "notebooks/18_the_road_compared"
    context = browser.new_context(service_workers="block", **VIEWPORTS["phone"])
    page = context.new_page()
    try:
        page.goto(base + f"{page_file}.html", wait_until="load")
        link = page.locator("figure a.image-reference").nth(1)
        link.scroll_into_view_if_needed()
        page.wait_for_function("(a) => a.querySelector('img').complete", arg=link.element_handle())
        shown = link.locator("img").bounding_box()["width"]
        link.click()
        layer = page.locator("div.tinyk3-zoom")
        assert layer.is_visible(), "tapping a figure opened no enlarged view"
        geo = layer.evaluate("(l) => ({img: l.querySelector('img').getBoundingClientRect()"
                             ".width, scroll: l.scrollWidth, client: l.clientWidth, focus: "
                             "document.activeElement.textContent})")
        assert geo["img"] >= 680 > 1.5 * shown, (shown, geo)
        assert geo["scroll"] > geo["client"], f"the enlarged figure does not scroll: {geo}"
        assert geo["focus"] == "Close", geo
        page.keyboard.press("Escape")
        assert layer.count() == 0, "Escape left the enlarged figure open"
        assert page.evaluate("document.activeElement.classList.contains('image-reference')")
        link.click()
        page.locator("div.tinyk3-zoom").click(position={"x": 20, "y": 400})
        assert page.locator("div.tinyk3-zoom").count() == 0, "a tap left it open"
    finally:
        context.close()


@pytest.mark.browser
@pytest.mark.parametrize("edition, page_file",
                         [(e, p) for e, pages in (("en", PAGES), ("ja", JA_PAGES))
                          for p in pages if p.startswith("notebooks/")])
def test_notebook_page_links_its_own_notebook_in_colab_and_kaggle(edition, page_file):
    """The badges (and the theme's launch menu) open this very notebook, from the repository
    set in _config.yml: a Japanese page opens the Japanese notebook (ja/notebooks/)."""
    html = (EDITIONS[edition][1] / f"{page_file}.html").read_text()
    for host, url in launch_urls(page_file, edition).items():
        assert url.replace("&", "&amp;") in html or url in html, f"no {host} link {url}"


SWITCH = re.compile(r'<p class="tinyk3-lang-switch"><a href="([^"]+)" hreflang="(en|ja)"')


@pytest.mark.browser
def test_every_page_links_the_same_page_in_the_other_edition():
    """Both ways, every page of the table of contents: the switch under the title points at
    the same page of the other edition, and that page exists."""
    assert JA_PAGES == PAGES, "the Japanese table of contents differs from the English one"
    for edition, other in (("en", "ja"), ("ja", "en")):
        site = EDITIONS[edition][1]
        for page_file in PAGES:
            html = (site / f"{page_file}.html").read_text()
            found = SWITCH.findall(html)
            assert len(found) == 1, f"{edition} {page_file}: {len(found)} language switches"
            href, lang = found[0]
            target = ((site / page_file).parent / href).resolve()
            assert lang == other and target == (EDITIONS[other][1] / f"{page_file}.html"
                                                 ).resolve(), (edition, page_file, href)
            assert target.is_file(), f"{edition} {page_file}: the switch leads to no page"


@pytest.mark.browser
def test_no_japanese_page_has_a_paragraph_left_in_english():
    """Every page of the Japanese site, as built (code, maths and outputs aside): no
    paragraph, list item, heading, caption or table cell that has no Japanese and reads as
    English, and none that shows the asterisks of an emphasis that did not render.
    tools/translate.py checks the catalogs; this checks what reaches the reader, including
    what the theme and the extensions write."""
    assert JA_PAGES, "no Japanese book (ja/_toc.yml): run tools/translate.py build"
    found = {}
    for page_file in JA_PAGES + ["search"]:
        html = (JA_SITE / f"{page_file}.html").read_text(encoding="utf-8")
        assert '<html lang="ja"' in html, f"ja/{page_file}.html is not declared Japanese"
        left = untranslated(html)
        # Emphasis that did not render (punctuation just inside ** in Japanese text).
        left += [f"literal asterisks: {t}" for t in prose_blocks(html) if "**" in t]
        if left:
            found[page_file] = left
    assert not found, "untranslated paragraphs in the Japanese site:\n  " + "\n  ".join(
        f"{p}: {t[:100]!r}" for p, texts in found.items() for t in texts[:3])


@pytest.mark.browser
@pytest.mark.parametrize("query, page_file", [("線形注意", "notebooks/03_linear_attention"),
                                              ("専門家の混合", "notebooks/14_mixture_of_experts"),
                                              ("チャンク", "notebooks/06_chunked_linear_attention")])
def test_japanese_search_finds_a_term_offline(browser, base, query, page_file):
    """The Japanese site's search, offline: a term typed whole (a compound of several
    characters, with no spaces, as Japanese is written) finds the chapter that teaches it."""
    from urllib.parse import quote

    context = browser.new_context(service_workers="block", **VIEWPORTS["desktop"])
    page = context.new_page()
    log = PageLog(page, context, harmless=KNOWN_HARMLESS)
    try:
        page.goto(base + f"ja/search.html?q={quote(query)}", wait_until="load")
        # Results are listed one by one (each fetches its page for the context shown) and
        # the summary comes last: wait for the chapter's link, or for the summary.
        wanted = f"{page_file}.html"
        page.wait_for_function(
            "(w) => [...document.querySelectorAll('#search-results li a')].some("
            "a => a.getAttribute('href').split(/[?#]/)[0].endsWith(w))"
            " || document.querySelector('#search-results p.search-summary')"
            "?.textContent.trim()", arg=wanted, timeout=30_000)
        hrefs = page.evaluate("() => [...document.querySelectorAll('#search-results li a')]"
                              ".map(a => a.getAttribute('href'))")
        summary = page.evaluate("() => document.querySelector('#search-results h2')"
                                "?.textContent || ''")
    finally:
        context.close()
    assert not log.report(), log.report()
    assert any(h.split("?")[0].split("#")[0].endswith(wanted) for h in hrefs), \
        f"searching {query!r} did not find {page_file} ({hrefs[:8]})"
    assert JAPANESE.search(summary), f"the search page speaks English: {summary!r}"


@pytest.mark.browser
def test_every_page_declares_the_favicon():
    for page_file in PAGES:
        html = (SITE / f"{page_file}.html").read_text()
        icons = re.findall(r'<link rel="icon" href="([^"]+)"', html)
        assert icons, f"{page_file}.html declares no favicon"
        assert (SITE / page_file).parent.joinpath(icons[0]).resolve().is_file(), icons[0]


@pytest.mark.browser
def test_the_404_page_is_self_contained_and_links_home():
    page = (SITE / "404.html").read_text()
    owner, name = REPO_SLUG.split("/")
    assert f'href="https://{owner.lower()}.github.io/{name}/"' in page
    # GitHub Pages serves it at any depth: it must load nothing by a relative path.
    assert not re.search(r'<(script|link|img)\b', page), "404.html loads other files"


@pytest.mark.browser
def test_landing_page_guide_states_the_stored_run_times():
    """The at-a-glance chapter table lists every chapter with the time its stored full run
    printed (read here independently of the extension that wrote the table)."""
    html = (SITE / "book" / "intro.html").read_text()
    for needed in ("Prerequisites", "Start with", "Colab"):
        assert needed in html, f"the landing page has no {needed!r}"
    chapters = [p for p in PAGES if p.startswith("notebooks/")]
    rows = re.findall(r'<tr class="row-(?:odd|even)"><td><p>(\d+)</p></td>\s*<td><p>'
                      r'<a class="reference internal" href="([^"]+)">', html)
    assert [href.split("/")[-1].removesuffix(".html") for _, href in rows] == \
        [p.split("/")[-1] for p in chapters]
    for page_file in chapters:
        nb = json.loads((BOOK / f"{page_file}.ipynb").read_text())
        last = [c for c in nb["cells"] if c["cell_type"] == "code"][-1]
        text = "".join("".join(o.get("text", "")) for o in last["outputs"])
        seconds = int(re.search(r"ran in (\d+) s", text).group(1))
        shown = f"{seconds} s" if seconds < 90 else f"{seconds / 60:.1f} min"
        assert f"<td><p>{shown}</p></td>" in html, f"{page_file}: {shown} not in the guide"


# ------------------------------------------------------------------------------------------
# the release's site archive (make site-archive), opened from disk

ARCHIVE_PAGES = ["book/intro", "notebooks/05_deltanet", "notebooks/04_associative_memory",
                 "notebooks/18_the_road_compared", "book/glossary"]


def _version() -> str:
    text = (REPO / "lib" / "tinyk3" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


@pytest.mark.browser
def test_the_site_archive_opens_from_disk(browser, tmp_path):
    """The zip of `make dist`, unpacked in a temporary folder and opened with file:// URLs (no
    server): pages load with no failed request and no console error, the math renders, the
    widgets render and respond, and every link between pages points at a file in the
    archive."""
    import zipfile
    from urllib.parse import unquote, urlparse

    archive = REPO / "dist" / f"tinyk3-site-{_version()}.zip"
    if not archive.is_file():
        pytest.fail(f"no {archive.relative_to(REPO)}: run `make site-archive` (after `make "
                    "html`)", pytrace=False)
    with zipfile.ZipFile(archive) as z:
        z.extractall(tmp_path)
    top = tmp_path / f"tinyk3-site-{_version()}"
    assert (top / "README.txt").is_file() and (top / "index.html").is_file()
    failures = []
    for page_file in ARCHIVE_PAGES:
        source = source_of(page_file)
        assert source is not None and (top / f"{page_file}.html").is_file(), page_file
        context = browser.new_context(service_workers="block", **VIEWPORTS["desktop"])
        page = context.new_page()
        problems: list[str] = []
        blocked: list[str] = []

        def route(r, request, blocked=blocked):  # the disk, and nothing else
            if urlparse(request.url).scheme == "file":
                r.continue_()
            else:
                blocked.append(request.url)
                r.abort("blockedbyclient")

        context.route("**/*", route)
        page.on("requestfailed", lambda r, p=problems: p.append(f"failed: {r.url}"))
        page.on("console", lambda m, p=problems: m.type == "error" and not any(
            k in m.text for k in KNOWN_HARMLESS) and p.append(f"console: {m.text[:300]}"))
        page.on("pageerror", lambda e, p=problems: not any(
            k in str(e) for k in KNOWN_HARMLESS) and p.append(f"page error: {str(e)[:300]}"))
        try:
            page.goto((top / f"{page_file}.html").as_uri(), wait_until="load")
            settle(page, problems)
            check_text(page, source, problems)
            labels = None
            if source.suffix == ".ipynb":
                nb = json.loads(source.read_text(encoding="utf-8"))
                labels = widget_labels(nb.get("metadata", {}).get("widgets", {}).get(
                    "application/vnd.jupyter.widget-state+json", {}))
            check_widgets(page, problems, labels=labels)
            hrefs = page.evaluate("() => [...document.querySelectorAll('a[href]')]"
                                  ".map(a => a.href)")
        finally:
            context.close()
        for href in hrefs:
            url = urlparse(href)
            if url.scheme == "file":
                target = Path(unquote(url.path))
                if not target.exists():
                    problems.append(f"link to a missing file: {target.relative_to(tmp_path)}")
        problems += [f"request off the disk (blocked): {u}" for u in blocked]
        if problems:
            failures.append(f"{page_file}:\n    " + "\n    ".join(first(problems, 8)))
    assert not failures, "site archive opened from disk:\n  " + "\n  ".join(failures)

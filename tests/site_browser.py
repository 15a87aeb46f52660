"""What the browser tests share: a local static server, headless Debian Chromium driven by
Playwright (no browser is ever downloaded), the two viewports, a log of everything that went
wrong on a page, and the check that a precomputed-image widget responds to its sliders.

Used by tests/test_site.py (the built website, ipywidgets 8) and
tests/test_widgets_ipywidgets7.py (the Colab-image run's widgets, ipywidgets 7.7).
"""

from __future__ import annotations

import contextlib
import functools
import html.parser
import http.server
import os
import re
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

CHROMIUM = os.environ.get("TINYK3_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--metrics-recording-only",
    "--no-default-browser-check",
]
TIMEOUT_MS = 15_000

# A desktop window and a phone (390 CSS px wide, touch, the width of most current phones).
VIEWPORTS = {
    "desktop": {"viewport": {"width": 1280, "height": 900}},
    "phone": {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True},
}

# Raw TeX left in the rendered text (code, scripts and rendered math removed first): any
# dollar sign, \( or \[, an environment, or a command such as \Gamma (a section title with
# math, quoted by {ref}, lands in link text as TeX). The course's prose has no prices.
RAW_TEX = re.compile(r"\$|\\\(|\\\[|\\begin\{[A-Za-z*]+\}|\\[A-Za-z]{2,}\b")

WIDGET_VIEW = 'script[type="application/vnd.jupyter.widget-view+json"]'
WIDGET_STATE = 'script[type="application/vnd.jupyter.widget-state+json"]'
# The slider handle: noUiSlider in ipywidgets 8, jQuery UI in ipywidgets 7.
HANDLE = ".noUi-handle, .ui-slider-handle"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - signature fixed by the base class
        pass


@contextlib.contextmanager
def serve(directory: Path):
    """Serve ``directory`` on a free port of 127.0.0.1; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def chromium():
    """A headless Debian Chromium under Playwright, or a clear failure saying what is missing."""
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: run `python3 tools/check_prereqs.py test` "
                    "for the command that installs it", pytrace=False)
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                     headless=True)
        try:
            yield browser
        finally:
            browser.close()


class PageLog:
    """Everything that went wrong on the network and in the console of one page.

    Requests to any host but 127.0.0.1 are blocked and reported, so a CDN reference shows up
    here instead of hanging. ``harmless``: console/page error texts nothing in the
    repository can switch off.
    """

    def __init__(self, page, context, harmless: tuple[str, ...] = ()):
        self.problems: list[str] = []
        self.blocked: list[str] = []
        self.bad_urls: set[str] = set()  # reported once, not again as console/failed
        self.harmless = harmless

        def route(route):
            url = route.request.url
            if urlparse(url).hostname == "127.0.0.1":
                route.continue_()
            else:
                self.blocked.append(url)
                route.abort("blockedbyclient")

        context.route("**/*", route)
        page.on("requestfailed", self._failed)
        page.on("response", self._response)
        page.on("console", self._console)
        page.on("pageerror", self._pageerror)

    def _failed(self, request):
        url = request.url
        if url in self.blocked or url in self.bad_urls:
            return
        self.bad_urls.add(url)
        self.problems.append(f"request failed ({request.failure}): {url}")

    def _response(self, response):
        url = response.url
        if response.status >= 400 and url not in self.bad_urls:
            self.bad_urls.add(url)
            self.problems.append(f"HTTP {response.status}: {url}")

    def _console(self, msg):
        if msg.type != "error":
            return
        where = (msg.location or {}).get("url", "")
        if any(k in msg.text for k in self.harmless):
            return
        if msg.text.startswith("Failed to load resource") and (
                where in self.bad_urls or where in self.blocked):
            return  # the request itself is reported
        self.problems.append(f"console error: {msg.text[:500]} (at {where})")

    def _pageerror(self, error):
        text = str(error)
        if any(k in text for k in self.harmless):
            return
        self.problems.append(f"uncaught page error: {text[:500]}")

    def report(self) -> list[str]:
        return [f"request to another host (blocked): {u}" for u in self.blocked] + self.problems


def first(messages, n: int = 5) -> list[str]:
    """The first n messages, and how many more there were."""
    messages = list(messages)
    more = [f"... and {len(messages) - n} more like that"] if len(messages) > n else []
    return messages[:n] + more


def wait(page, problems: list[str], expression: str, what: str, arg=None) -> bool:
    try:
        page.wait_for_function(expression, arg=arg, timeout=TIMEOUT_MS)
        return True
    except Exception as exc:  # Playwright's TimeoutError, or an error inside the expression
        problems.append(f"{what} (waited {TIMEOUT_MS // 1000} s): {str(exc).splitlines()[0]}")
        return False


JS_WIDGETS_DONE = f"""() => [...document.querySelectorAll('{WIDGET_VIEW}')].every(s => {{
  const area = s.previousElementSibling;
  return area && area.classList.contains('widget-subarea') && area.childElementCount > 0;
}})"""

JS_WIDGETS = f"""() => {{
  const views = document.querySelectorAll('{WIDGET_VIEW}').length;
  const state = document.querySelectorAll('{WIDGET_STATE}').length;
  const areas = [...document.querySelectorAll('.widget-subarea')];
  return {{views, state, areas: areas.length,
    empty: areas.filter(a => !a.querySelector('.jupyter-widgets')).length,
    visible: areas.filter(a => a.checkVisibility()).length,
    errors: [...document.querySelectorAll('.jupyter-widgets-error-widget')]
             .map(e => e.textContent.slice(0, 200))}};
}}"""

# The pictures a reader sees in widget area i (the stacks' hidden children are not visible).
JS_VISIBLE_IMAGES = """(i) => {
  const area = [...document.querySelectorAll('.widget-subarea')][i];
  return [...area.querySelectorAll('img')].filter(im => im.checkVisibility())
    .map(im => im.src).join(' ');
}"""

# Geometry of widget area i: its sliders (track width, right edge, the readout's text), the
# visible pictures (shown width against the width they ask for), any visible tab bar.
JS_WIDGET_GEOMETRY = """(i) => {
  const area = [...document.querySelectorAll('.widget-subarea')][i];
  const vw = document.documentElement.clientWidth;
  const sliders = [...area.querySelectorAll('.widget-slider, .widget-hslider')]
    .filter(s => s.checkVisibility()).map(s => {
      const track = s.querySelector('.noUi-target, .ui-slider, .slider-container') || s;
      const readout = s.querySelector('.widget-readout');
      return {track: track.getBoundingClientRect().width,
              right: s.getBoundingClientRect().right,
              readout: readout ? (readout.value || readout.textContent || '').trim() : null};
    });
  const images = [...area.querySelectorAll('img')].filter(im => im.checkVisibility()).map(im => {
      const wanted = parseFloat(im.style.width) || parseFloat(im.getAttribute('width')) || 0;
      return {shown: im.getBoundingClientRect().width, wanted, natural: im.naturalWidth};
    });
  const bars = [...area.querySelectorAll('.tinyk3-stack > .p-TabBar, .tinyk3-stack > .lm-TabBar')]
    .filter(b => b.checkVisibility() && b.getBoundingClientRect().height > 0).length;
  return {vw, sliders, images, bars};
}"""


def widget_labels(state: dict) -> list[list[str]]:
    """The labels of every SelectionSlider in a stored widget state (ipywidgets 7 or 8)."""
    return [m["state"].get("_options_labels", []) for m in state.get("state", {}).values()
            if m.get("model_name") == "SelectionSliderModel"]


def check_widgets(page, problems: list[str], labels: list[list[str]] | None = None,
                  phone: bool = False, min_handle: float | None = 24.0) -> None:
    """Widgets rendered, and each visible one with sliders and pictures responds to them.

    In every visible widget area with a slider and pictures: the tab bars of the picture
    stacks are hidden; each slider's readout shows one of the labels the notebook gave
    (``labels``: the SelectionSliders' options in the stored state), not an index; on a
    phone each track is wide enough to drag and ends inside the screen; each handle is at
    least ``min_handle`` px each way (24: WCAG 2.5.8; the site's CSS sets it, None where the
    page is not the course's site, e.g. Colab's rendering); pictures are not
    shown smaller than they ask for on a desktop; pressing End on a slider handle changes
    the visible picture (the jslinks work without a kernel)."""
    info = page.evaluate(JS_WIDGETS)
    if not info["views"]:
        return
    if not info["state"]:
        problems.append(
            f"{info['views']} widget views but no saved widget state: execute the notebook "
            "with nbclient/`make run-notebooks` (store_widget_state) before building")
        return
    if info["areas"] < info["views"] or info["empty"]:
        problems.append(f"widgets not rendered: {info['views']} views, {info['areas']} areas, "
                        f"{info['empty']} empty")
    if not info["visible"]:
        problems.append("no rendered widget is visible")
    for err in info["errors"]:
        problems.append(f"widget error view: {' '.join(err.split())}")
    known = {label for options in (labels or []) for label in options}

    areas = page.locator(".widget-subarea")
    for i in range(areas.count()):
        area = areas.nth(i)
        handles = area.locator(HANDLE)
        # Folded outputs (hide-output, solutions) stay folded: only visible areas are tried.
        if not area.is_visible() or not handles.count() or not area.locator("img").count():
            continue
        area.scroll_into_view_if_needed()
        geo = page.evaluate(JS_WIDGET_GEOMETRY, i)
        if geo["bars"]:
            problems.append(f"widget area {i}: {geo['bars']} tab bar(s) of a picture stack "
                            "visible (the tinyk3-stack style did not apply)")
        for s in geo["sliders"]:
            if labels is not None and s["readout"] is not None and s["readout"] not in known:
                problems.append(f"widget area {i}: a slider reads {s['readout']!r}, not one of "
                                "the values the notebook gave it")
            if phone and s["track"] < 150:
                problems.append(f"widget area {i}: a slider track is {s['track']:.0f} px wide "
                                "on a phone (too short to drag)")
            if s["right"] > geo["vw"] + 1:
                problems.append(f"widget area {i}: a slider ends at {s['right']:.0f} px, "
                                f"outside the {geo['vw']} px screen")
        if not phone:
            for im in geo["images"]:
                if im["wanted"] and im["shown"] < 0.9 * im["wanted"]:
                    problems.append(f"widget area {i}: a picture is shown {im['shown']:.0f} px "
                                    f"wide, asks for {im['wanted']:.0f} (squeezed)")
        for h in range(handles.count() if min_handle else 0):
            box = handles.nth(h).bounding_box() if handles.nth(h).is_visible() else None
            if box and min(box["width"], box["height"]) < min_handle - 0.5:
                problems.append(f"widget area {i}: a slider handle is {box['width']:.0f} x "
                                f"{box['height']:.0f} px (under {min_handle:.0f} px: small "
                                "for a finger)")
        before = page.evaluate(JS_VISIBLE_IMAGES, i)
        changed = False
        for h in range(handles.count()):
            handle = handles.nth(h)
            if not handle.is_visible():
                continue
            handle.focus()
            handle.press("End")
            try:
                page.wait_for_function(f"(b) => ({JS_VISIBLE_IMAGES})({i}) !== b",
                                       arg=before, timeout=2_000)
                changed = True
                handle.press("Home")
                break
            except Exception:
                handle.press("Home")
        if not changed:
            problems.append(f"widget area {i}: moving its sliders did not change the picture "
                            "(jslink to a stack of images not working?)")


def toc_files(toc_path: Path) -> list[str]:
    """Every `file:` entry of a jb-book _toc.yml (root first), without its suffix."""
    toc = yaml.safe_load(toc_path.read_text())
    files = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("file"), str):
                files.append(node["file"])
            for key, value in node.items():
                if key != "file":
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk({k: v for k, v in toc.items() if k != "root"})
    stripped = [re.sub(r"\.(md|ipynb|rst|py)$", "", f) for f in files]
    return list(dict.fromkeys(stripped))


# -- the Japanese edition ------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from translate import JAPANESE  # noqa: E402  (one definition of "has Japanese")

# Four English words in a row: a sentence, not a name (DeltaNet, Kimi K3, `tinyk3.models`).
ENGLISH_RUN = re.compile(r"\b[A-Za-z][a-z]+(?:[ ,;:'-]+[A-Za-z][a-z]+){3,}\b")


class _Prose(html.parser.HTMLParser):
    """The text of each prose element (paragraph, list item, heading, caption, definition,
    table cell, quotation) of a page's article, without code, maths, outputs, widgets and
    italics."""

    BLOCKS = {"p", "li", "h1", "h2", "h3", "h4", "h5", "h6", "figcaption", "dt", "dd", "th",
              "td", "caption", "summary"}
    # Italics are titles (papers, books) and quoted names: left as written.
    SKIP_TAGS = {"pre", "code", "script", "style", "mjx-container", "math", "svg", "kbd", "em",
                 "cite"}
    # The terms table's English column is English by design.
    SKIP_CLASSES = {"cell_output", "math", "highlight", "widget-subarea", "tinyk3-lang-switch",
                    "tinyk3-launch-bar", "headerlink", "output", "tinyk3-term-table"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipping, collecting)
        self.in_article = 0
        self.texts: list[list[str]] = []
        self.blocks: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "hr", "input", "meta", "link", "wbr", "source"):
            return
        classes = set((dict(attrs).get("class") or "").split())
        skipping = (tag in self.SKIP_TAGS or bool(classes & self.SKIP_CLASSES)
                    or bool(self.stack and self.stack[-1][1]))
        if tag == "article":
            self.in_article += 1
        # A quotation is one block: an English quote with its Japanese rendering passes.
        quoted = any(t == "blockquote" for t, _, _ in self.stack)
        collecting = ((tag in self.BLOCKS and not quoted) or tag == "blockquote") \
            and self.in_article > 0 and not skipping
        if collecting:
            self.texts.append([])
        self.stack.append((tag, skipping, collecting))

    def handle_endtag(self, tag):
        if all(open_tag != tag for open_tag, _, _ in self.stack):
            return  # a stray end tag
        while self.stack:
            open_tag, _, collecting = self.stack.pop()
            if collecting:
                text = " ".join("".join(self.texts.pop()).split())
                if text:
                    self.blocks.append(text)
                    if self.texts:
                        self.texts[-1].append(" ")
            if open_tag == "article":
                self.in_article -= 1
            if open_tag == tag:
                break

    def handle_data(self, data):
        if self.stack and not self.stack[-1][1] and self.texts:
            self.texts[-1].append(data)


def prose_blocks(page_html: str) -> list[str]:
    parser = _Prose()
    parser.feed(page_html)
    parser.close()
    return parser.blocks


def untranslated(page_html: str) -> list[str]:
    """The prose elements of a Japanese page that read as English: no Japanese character and
    four or more English words in a row."""
    return list(dict.fromkeys(t for t in prose_blocks(page_html)
                              if not JAPANESE.search(t) and ENGLISH_RUN.search(t)))

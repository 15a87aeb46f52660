"""The built website works offline in a real browser (`make browser`, after `make html`).

Serves _build/html on 127.0.0.1, opens every page listed in _toc.yml in headless Debian
Chromium (driven by Playwright; no browser is ever downloaded), and fails a page on:

* any failed request, any response with status >= 400, any request to another host
  (those are blocked, so a CDN reference shows up here instead of hanging);
* any console error or uncaught page error;
* math that MathJax did not render (no ``mjx-container``, or raw TeX left in the text);
* on chapter (notebook) pages: an image that did not load, no figure at all, no folded
  solution, a solution that is not folded, or a widget that did not render or does not
  respond to its slider.

A full-page screenshot of every page lands in _build/screenshots/ (notebooks-01_gpt2.png).
TINYK3_SITE=/path/to/_build/html checks another build (its book root is two levels up).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("TINYK3_SITE", REPO / "_build" / "html")).resolve()
BOOK = SITE.parents[1] if (SITE.parents[1] / "_toc.yml").is_file() else REPO
SHOTS = SITE.parent / "screenshots"
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

# Errors that are not the site's fault and that nothing in the repository can switch off.
KNOWN_HARMLESS = [
    # Jupyter Book 1 (Sphinx 7.4) emits sphinx-thebe's inline `const THEBE_JS_URL = ...`
    # script twice on every page; the second copy throws. Thebe is not used by this site.
    "Identifier 'THEBE_JS_URL' has already been declared",
]

WIDGET_VIEW = 'script[type="application/vnd.jupyter.widget-view+json"]'
WIDGET_STATE = 'script[type="application/vnd.jupyter.widget-state+json"]'

# Raw TeX that should have become math: a delimited span, an environment, a $...$ span
# holding TeX syntax (plain prices like "$5" do not match), or a lone delimiter.
RAW_TEX = re.compile(
    r"\$\$[\s\S]{0,300}?\$\$|\\\([\s\S]{0,300}?\\\)|\\\[[\s\S]{0,300}?\\\]"
    r"|\\begin\{[A-Za-z*]+\}|\$[^$\n]{0,80}(?:\\[A-Za-z]+|[\^_])[^$\n]{0,80}\$"
    r"|\$\$|\\\(|\\\["
)
# Math in a page source: $$, $...$, \( \[, {math} roles/directives, amsmath environments.
SOURCE_MATH = re.compile(
    r"\$\$|(?<![\\$\w])\$[^$\s][^$\n]*?(?<![\\\s])\$|\\\(|\\\[|\{math\}|\\begin\{[a-z]+\*?\}"
)


# ------------------------------------------------------------------------------------------
# pages


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


def source_of(page: str) -> Path | None:
    for suffix in (".ipynb", ".md", ".rst"):
        path = BOOK / f"{page}{suffix}"
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


# ------------------------------------------------------------------------------------------
# fixtures


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - signature fixed by the base class
        pass


@pytest.fixture(scope="module")
def site():
    """(base URL, Playwright browser) for the built site, served on a free local port."""
    if not (SITE / "index.html").is_file():
        pytest.fail(f"no built site at {SITE}: run `make html` first", pytrace=False)
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM} (Debian package `chromium`)", pytrace=False)
    sync_api = pytest.importorskip("playwright.sync_api")

    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                yield base, browser
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------------------
# the check


class PageLog:
    """Everything that went wrong on the network and in the console of one page."""

    def __init__(self, page, context):
        self.problems: list[str] = []
        self.blocked: list[str] = []
        self.bad_urls: set[str] = set()  # reported once, not again as console/failed

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

    @staticmethod
    def _ignored(url: str) -> bool:
        # The browser asks for /favicon.ico by itself when a page declares no icon.
        return urlparse(url).path == "/favicon.ico"

    def _failed(self, request):
        url = request.url
        if url in self.blocked or url in self.bad_urls or self._ignored(url):
            return
        self.bad_urls.add(url)
        self.problems.append(f"request failed ({request.failure}): {url}")

    def _response(self, response):
        url = response.url
        if response.status >= 400 and not self._ignored(url) and url not in self.bad_urls:
            self.bad_urls.add(url)
            self.problems.append(f"HTTP {response.status}: {url}")

    def _console(self, msg):
        if msg.type != "error":
            return
        where = (msg.location or {}).get("url", "")
        if self._ignored(where) or any(k in msg.text for k in KNOWN_HARMLESS):
            return
        if msg.text.startswith("Failed to load resource") and (
                where in self.bad_urls or where in self.blocked):
            return  # the request itself is reported
        self.problems.append(f"console error: {msg.text[:500]} (at {where})")

    def _pageerror(self, error):
        text = str(error)
        if any(k in text for k in KNOWN_HARMLESS):
            return
        self.problems.append(f"uncaught page error: {text[:500]}")

    def report(self) -> list[str]:
        return [f"request to another host (blocked): {u}" for u in self.blocked] + self.problems


def _first(messages, n: int = 5) -> list[str]:
    """The first n messages, and how many more there were."""
    messages = list(messages)
    more = [f"... and {len(messages) - n} more like that"] if len(messages) > n else []
    return messages[:n] + more


def _wait(page, problems: list[str], expression: str, what: str, arg=None) -> bool:
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

JS_MATH_STATE = """() => {
  const root = document.querySelector('article') || document.body;
  const unrendered = [...root.querySelectorAll('.math')]
    .filter(e => !e.querySelector('mjx-container') && !e.closest('mjx-container'))
    .map(e => e.textContent.trim().slice(0, 80));
  const clone = root.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, textarea, mjx-container, .highlight')
    .forEach(e => e.remove());
  return {rendered: root.querySelectorAll('mjx-container').length, unrendered,
          text: clone.textContent};
}"""

JS_IMAGES = """() => [...document.images].map(i => ({
  src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0,
  output: !!i.closest('.cell_output')}))"""

# sphinx-togglebutton folds an admonition by giving it `toggle-hidden`: its children after
# the title get visibility: hidden and height 0.
JS_SHOWN = """(s) => [...s.children].some(c => !c.classList.contains('admonition-title')
  && c.checkVisibility({visibilityProperty: true}) && c.getBoundingClientRect().height > 0)"""

JS_SOLUTIONS = f"""() => [...document.querySelectorAll('.solution')].map(s => ({{
  id: s.id, cls: s.className,
  button: !!s.querySelector(':scope > .admonition-title .toggle-button'),
  shown: ({JS_SHOWN})(s)}}))"""

JS_WIDGETS = f"""() => {{
  const views = document.querySelectorAll('{WIDGET_VIEW}').length;
  const state = document.querySelectorAll('{WIDGET_STATE}').length;
  const areas = [...document.querySelectorAll('.widget-subarea')];
  return {{views, state, areas: areas.length,
    empty: areas.filter(a => !a.querySelector('.jupyter-widgets')).length,
    visible: areas.filter(a => a.checkVisibility()).length,
    errors: [...document.querySelectorAll('.jupyter-widgets-error-widget')]
             .map(e => e.textContent.slice(0, 200)),
    sliders: document.querySelectorAll('.widget-subarea .widget-slider').length}};
}}"""

# In each widget area that has a slider and images, press End on each slider handle until
# the visible picture changes: the jslinks work without a kernel.
JS_VISIBLE_IMAGES = """(i) => {
  const area = [...document.querySelectorAll('.widget-subarea')][i];
  return [...area.querySelectorAll('img')].filter(im => im.checkVisibility())
    .map(im => im.src).join(' ');
}"""


def check_widgets(page, problems: list[str]) -> None:
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

    areas = page.locator(".widget-subarea")
    for i in range(areas.count()):
        area = areas.nth(i)
        handles = area.locator(".widget-slider .noUi-handle")
        # Folded outputs (hide-output, solutions) stay folded: only visible areas are tried.
        if not area.is_visible() or not handles.count() or not area.locator("img").count():
            continue
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
                            "(jslink to a Stack of images not working?)")


@pytest.mark.browser
@pytest.mark.parametrize("page_file", PAGES)
def test_page(site, page_file):
    base, browser = site
    source = source_of(page_file)
    assert source is not None, f"{page_file} is in _toc.yml but has no source under {BOOK}"
    notebook = source.suffix == ".ipynb"
    html = SITE / f"{page_file}.html"
    assert html.is_file(), f"{html} missing: rebuild the site (`make html`)"

    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  service_workers="block")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    log = PageLog(page, context)
    problems: list[str] = []
    url = base + f"{page_file}.html"
    try:
        page.goto(url, wait_until="load")

        # Widgets render after the load event; then MathJax has every typeset queued.
        if page.locator(WIDGET_VIEW).count() and page.locator(WIDGET_STATE).count():
            _wait(page, problems, JS_WIDGETS_DONE, "widgets did not finish rendering")
        if page.locator('script[src*="mathjax/"]').count():
            if _wait(page, problems, "() => window.MathJax && MathJax.startup"
                     " && MathJax.startup.promise && MathJax.typesetPromise",
                     "MathJax did not start"):
                try:
                    page.evaluate("() => MathJax.startup.promise.then(() => true)")
                except Exception as exc:
                    problems.append(f"MathJax failed: {str(exc).splitlines()[0]}")
        _wait(page, problems, "() => [...document.images].every(i => i.complete)",
              "images did not finish loading")
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(SHOTS / f"{page_file.replace('/', '-')}.png"),
                        full_page=True)

        # Math: every math element rendered, no TeX left in the text.
        math = page.evaluate(JS_MATH_STATE)
        if SOURCE_MATH.search(prose_of(source)) and not math["rendered"]:
            problems.append("the source has math but MathJax rendered none (no mjx-container)")
        problems += _first(f"math element not rendered by MathJax: {t!r}"
                           for t in math["unrendered"])
        problems += _first(f"raw TeX in the page text: {m.group(0)[:100]!r}"
                           for m in RAW_TEX.finditer(math["text"]))

        # Images: all loaded; chapters show at least one figure.
        images = page.evaluate(JS_IMAGES)
        for img in images:
            if not img["ok"]:
                problems.append(f"image did not load: {img['src'][:200]}")
        if notebook and not any(i["ok"] and i["output"] for i in images):
            problems.append("chapter page has no figure (no loaded <img> in a cell output)")

        # Solutions: folded by sphinx-togglebutton; a click unfolds them.
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
            if not _wait(page, [], f"(id) => ({JS_SHOWN})(document.getElementById(id))", "",
                         arg=sid):
                problems.append(f"solution {sid} does not unfold when its button is clicked")

        check_widgets(page, problems)
        page.wait_for_load_state("networkidle")
    finally:
        context.close()

    problems = log.report() + problems
    assert not problems, f"{url} ({source.relative_to(BOOK)}):\n  " + "\n  ".join(problems)


@pytest.mark.browser
@pytest.mark.parametrize("page_file", [p for p in PAGES if p.startswith("notebooks/")])
def test_notebook_page_has_a_colab_button_for_its_own_notebook(page_file):
    """The launch button opens this very notebook, from the repository set in _config.yml."""
    config = yaml.safe_load((BOOK / "_config.yml").read_text())
    repo = config["repository"]["url"].removeprefix("https://github.com/")
    branch = config["repository"].get("branch", "main")
    html = (SITE / f"{page_file}.html").read_text()
    want = f"https://colab.research.google.com/github/{repo}/blob/{branch}/{page_file}.ipynb"
    assert want in html, f"{page_file}.html has no Colab link {want}"

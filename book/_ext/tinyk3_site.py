"""The course's own Sphinx extension (loaded by _config.yml, `sphinx.local_extensions`).

What the themes do not do for this site, in one place:

* ``site.css`` / ``site.js`` on every page (book/_ext/static/): outputs, autograder reports
  and printed pages wrap instead of being cut off; wide tables and equations scroll inside
  their box with a visible shadow; a smaller title on phones; and the fix for the sidebar
  buttons of pydata-sphinx-theme 0.17 / sphinx-book-theme 1.3 (pydata-sphinx-theme issue
  2451: only the first ``.primary-toggle`` / ``.secondary-toggle`` on a page gets the
  themes' click handlers, and on sphinx-book-theme that is a hidden one).
* An "Open in Colab" and an "Open in Kaggle" badge under the title of every chapter,
  linking to the chapter's own notebook in the repository named in _config.yml
  (``repository.url``, the one place the URL is written; no outside image is loaded).
* ``@REPO_URL@`` and ``@REPO_DIR@`` in a page's source become that URL and the folder a
  ``git clone`` of it makes (code blocks included), so no page spells the URL itself;
  ``@VERSION@`` becomes the release (``__version__`` in lib/tinyk3/__init__.py, the one
  place it is written), which the footer of every page also shows.
* The ``{chapter-guide}`` directive: one row per chapter in the table of contents, with the
  time its stored full-size run took (read from the notebook's last output, "This notebook
  ran in N s.") and its number of exercises, so the landing page states measured times.
* A language switch under the title of every page, linking to the same page in the other
  edition: the English site is at the root, the Japanese one (generated into ``ja/`` by
  tools/translate.py, built with ``language: ja``) under ``ja/``; links are relative, so they
  work from the site archive opened from disk too. The texts this extension writes itself
  (badges, the exercises' how-to, the chapter guide) are in the page's language (``TEXT``).
* Japanese search that works offline and finds compound terms: the index and the query are
  both cut into overlapping pairs of Japanese characters (``JapaneseBigrams``), so a query
  such as 線形注意 matches wherever those four characters stand together. (Sphinx's own ``ja``
  indexes TinySegmenter words but splits a query only at spaces and punctuation, so a
  compound typed whole matched nothing.)
* A self-contained ``404.html`` (GitHub Pages serves it for any missing path, at any depth,
  so it links to the site by absolute URL and loads nothing).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.application import Sphinx
from sphinx.search import SearchLanguage

STATIC = Path(__file__).parent / "static"
RAN_IN = re.compile(r"This notebook ran in (\d+) s\.")


# What this extension writes on a page, in each edition's language.
TEXT = {
    "en": {
        "open_in": "Open in {host}",
        "exercises": "Exercises",
        "howto": (
            "How to do them: open this chapter as a notebook, in Colab or Kaggle from the badges "
            "under its title, or locally ({how_to}). Write your function in the cell marked "
            "<code>your code here</code> and run the check under it: it says which case failed, "
            "by how much, and gives a hint. The solutions are folded below each exercise."),
        "how_to_title": "How to use this book",
        "guide_head": ["", "Chapter", "Runs in", "Exercises"],
        "guide_note": (
            "Run times are those of the stored full-size runs on two CPU cores "
            "({minutes:.0f} minutes for all {n} chapters); with SMOKE = True a chapter runs in "
            "seconds. Reading and the exercises take longer: plan an evening per chapter."),
        "other": "日本語", "other_lang": "ja", "other_title": "このページの日本語版",
        "terms_head": ["English", "Japanese"], "version": "Version",
    },
    "ja": {
        "open_in": "{host} で開く",
        "exercises": "演習",
        "howto": (
            "取り組み方: この章をノートブックとして開く（タイトルの下のバッジから Colab か "
            "Kaggle で、または手元で。{how_to}を参照）。<code>your code here</code> と書かれた"
            "セルに関数を書き、その下のチェックを実行する。チェックは、どのケースで、どれだけ"
            "外れたかを示し、ヒントを出す（メッセージは英語）。解答は各演習の下に折りたたんで"
            "ある。"),
        "how_to_title": "この本の使い方",
        "guide_head": ["", "章", "実行時間", "演習"],
        "guide_note": (
            "実行時間は、保存されたフルサイズ実行を 2 CPU コアで計測したもの（全 {n} 章で "
            "{minutes:.0f} 分）。SMOKE = True なら各章は数秒で終わる。読んで演習に取り組むには"
            "もっとかかる。1 章に一晩を見込んでほしい。"),
        "other": "English", "other_lang": "en", "other_title": "This page in English",
        "terms_head": ["英語", "日本語"], "version": "バージョン",
    },
}


def _lang(app: Sphinx) -> str:
    return "ja" if (app.config.language or "en").startswith("ja") else "en"


def _text(app: Sphinx, key: str):
    return TEXT[_lang(app)][key]


def _repo(app: Sphinx) -> tuple[str, str]:
    opts = app.config.html_theme_options or {}
    url = str(opts.get("repository_url", "")).rstrip("/")
    if not url.startswith("https://github.com/"):
        raise ValueError(f"_config.yml repository.url must be a GitHub URL, got {url!r}")
    return url, str(opts.get("repository_branch", "main"))


def site_url(repo_url: str) -> str:
    """Where GitHub Pages publishes the repository's site: https://OWNER.github.io/NAME/."""
    owner, name = repo_url.removeprefix("https://github.com/").split("/")[:2]
    return f"https://{owner.lower()}.github.io/{name}/"


def launch_links(repo_url: str, branch: str, path: str) -> dict[str, str]:
    """Colab and Kaggle links that open the notebook at ``path`` (repository-relative)."""
    slug = repo_url.removeprefix("https://github.com/")
    return {
        "Colab": f"https://colab.research.google.com/github/{slug}/blob/{branch}/{path}",
        "Kaggle": f"https://kaggle.com/kernels/welcome?src={repo_url}/blob/{branch}/{path}",
    }


# -- sources ---------------------------------------------------------------------------------

def version() -> str:
    """The release, read from the package without importing it (it imports torch)."""
    text = (Path(__file__).resolve().parents[2] / "lib" / "tinyk3" / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    if match is None:
        raise ValueError("lib/tinyk3/__init__.py has no __version__ line")
    return match.group(1)


def _substitute(app: Sphinx, docname: str, source: list[str]) -> None:
    url, _ = _repo(app)
    source[0] = (source[0].replace("@REPO_URL@", url).replace("@REPO_DIR@", url.rsplit("/", 1)[1])
                 .replace("@SITE_URL@", site_url(url)).replace("@VERSION@", version()))


# -- badges ----------------------------------------------------------------------------------

def _badges(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    if not docname.startswith("notebooks/"):
        return
    source = Path(app.env.doc2path(docname))
    url, branch = _repo(app)
    path = source.relative_to(Path(app.srcdir)).as_posix()
    book = str((app.config.html_theme_options or {}).get("path_to_docs", "")).strip("/")
    if book:  # the Japanese book lives in ja/ of the repository
        path = f"{book}/{path}"
    opens = _text(app, "open_in")
    links = "".join(
        f'<a class="tinyk3-launch tinyk3-launch-{host.lower()}" href="{html.escape(href)}" '
        f'target="_blank" rel="noopener">{opens.format(host=host)}</a>'
        for host, href in launch_links(url, branch, path).items())
    raw = nodes.raw("", f'<p class="tinyk3-launch-bar">{links}</p>', format="html")
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None or not isinstance(section[0], nodes.title):
        return
    section.insert(1, raw)
    _exercise_howto(app, doctree, docname)


def _exercise_howto(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    """Under a chapter's "Exercises" heading, unless its first paragraph already says how:
    where to do the exercises and what the check tells you (the site shows no cell to run)."""
    heading = _text(app, "exercises")
    for section in doctree.findall(nodes.section):
        if not (isinstance(section[0], nodes.title) and section[0].astext() == heading):
            continue
        first = section[1] if len(section) > 1 else None
        if isinstance(first, nodes.paragraph) and ("autograder" in first.astext()
                                                   or "自動採点" in first.astext()):
            return
        try:
            href = app.builder.get_relative_uri(docname, "book/how-to-use")
        except Exception:  # a builder without page URIs
            href = "../book/how-to-use.html"
        link = f'<a href="{html.escape(href)}">{_text(app, "how_to_title")}</a>'
        text = _text(app, "howto").format(how_to=link)
        section.insert(1, nodes.raw("", f'<p class="tinyk3-exercise-howto">{text}</p>',
                                    format="html"))
        return


# -- the language switch --------------------------------------------------------------------

def other_edition_href(docname: str, lang: str) -> str:
    """The same page in the other edition, relative to this page: the Japanese site is the
    English one's ``ja/`` folder."""
    up = "../" * docname.count("/")
    if lang == "en":
        return f"{up}ja/{docname}.html"
    return f"../{up}{docname}.html"


def _language_switch(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    if app.builder.name != "html":
        return
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None or not isinstance(section[0], nodes.title):
        return
    lang = _lang(app)
    href = html.escape(other_edition_href(docname, lang))
    other = _text(app, "other_lang")
    raw = (f'<p class="tinyk3-lang-switch"><a href="{href}" hreflang="{other}" lang="{other}" '
           f'title="{html.escape(_text(app, "other_title"))}">{_text(app, "other")}</a></p>')
    section.insert(1, nodes.raw("", raw, format="html"))


# -- Japanese search -------------------------------------------------------------------------

# Hiragana, katakana (with the prolonged sound mark), CJK ideographs, half-width katakana:
# the same ranges in Python and in the page's JavaScript.
CJK_RANGES = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
_CJK_RUN = re.compile(f"[{CJK_RANGES}]+|[^{CJK_RANGES}]+")


def japanese_terms(text: str) -> list[str]:
    """Search terms of ``text``: words as Sphinx splits them (``\\w+``), each run of Japanese
    characters inside one cut into overlapping pairs (a single character stays whole)."""
    terms = []
    for word in re.findall(r"\w+", text):
        for run in _CJK_RUN.findall(word):
            if re.match(f"[{CJK_RANGES}]", run):
                terms += [run] if len(run) == 1 else [run[i:i + 2]
                                                      for i in range(len(run) - 1)]
            else:
                terms.append(run)
    return terms


class JapaneseBigrams(SearchLanguage):
    """Sphinx's search language for ``ja``, replaced: the index and the query split alike."""

    lang = "ja"
    language_name = "Japanese"
    js_splitter_code = """
function splitQuery(query) {
  const cjk = "@CJK@";
  const run = new RegExp("[" + cjk + "]+|[^" + cjk + "]+", "gu");
  const isCjk = new RegExp("^[" + cjk + "]");
  const terms = [];
  for (const word of query.split(/[^\\p{Letter}\\p{Number}_]+/gu)) {
    for (const part of word.match(run) || []) {
      if (!isCjk.test(part)) { terms.push(part); continue; }
      if (part.length === 1) { terms.push(part); continue; }
      for (let i = 0; i + 1 < part.length; i++) terms.push(part.slice(i, i + 2));
    }
  }
  return terms.filter(term => term);
}
""".replace("@CJK@", CJK_RANGES)

    def split(self, input: str) -> list[str]:
        return japanese_terms(input)

    def word_filter(self, word: str) -> bool:
        return len(word) > 0

    def stem(self, word: str) -> str:
        return word.lower()


# -- the terms table --------------------------------------------------------------------------

TERMS = Path(__file__).resolve().parents[2] / "ja" / "terms.yml"


class TermTable(Directive):
    """The Japanese edition's terminology (ja/terms.yml) as a two-column table, English and
    Japanese, in both editions' glossary."""

    has_content = False

    def run(self):
        import yaml

        env = self.state.document.settings.env
        terms = yaml.safe_load(TERMS.read_text(encoding="utf-8")) or []
        if not terms or not all({"en", "ja"} <= set(t) for t in terms):
            raise self.error(f"term-table: {TERMS} must list entries with `en` and `ja`")
        table = nodes.table(classes=["tinyk3-term-table"])
        group = nodes.tgroup(cols=2)
        table += group
        for width in (50, 50):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        head += ChapterGuide._row(_text(env.app, "terms_head"))
        body = nodes.tbody()
        group += body
        for t in sorted(terms, key=lambda t: t["en"].lower()):
            body += ChapterGuide._row([t["en"], t["ja"]])
        return [table]


# -- the chapter guide -----------------------------------------------------------------------

def chapter_rows(srcdir: Path, toc_files: list[str]) -> list[dict]:
    """Title, run time (s) and exercise count of each notebook in the table of contents."""
    rows = []
    for file in toc_files:
        path = srcdir / f"{file}.ipynb"
        if not path.is_file():
            continue
        nb = json.loads(path.read_text(encoding="utf-8"))
        markdown = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
        title = next((line[2:].strip() for text in markdown for line in text.splitlines()
                      if line.startswith("# ")), file)
        outputs = "".join(o.get("text", "") if isinstance(o.get("text", ""), str)
                          else "".join(o["text"])
                          for c in nb["cells"] if c["cell_type"] == "code"
                          for o in c.get("outputs", []))
        times = RAN_IN.findall(outputs)
        exercises = sum(text.count("```{exercise}") for text in markdown)
        rows.append({"file": file, "title": title,
                     "seconds": int(times[-1]) if times else None, "exercises": exercises})
    return rows


def _toc_files(app: Sphinx) -> list[str]:
    import yaml

    toc = yaml.safe_load((Path(app.srcdir) / "_toc.yml").read_text())
    return [c["file"] for part in toc.get("parts", []) for c in part.get("chapters", [])]


class ChapterGuide(Directive):
    """A table: chapter (linked), run time at full size, exercises."""

    has_content = False

    def run(self):
        env = self.state.document.settings.env
        app = env.app
        rows = chapter_rows(Path(app.srcdir), _toc_files(app))
        if not rows:
            raise self.error("chapter-guide: no chapter notebooks in _toc.yml")
        missing = [r["file"] for r in rows if r["seconds"] is None]
        if missing:
            raise self.error(f"chapter-guide: no stored 'This notebook ran in N s.' in {missing}"
                             " (store a full run: make book)")
        table = nodes.table(classes=["tinyk3-chapter-guide"])
        group = nodes.tgroup(cols=4)
        table += group
        for width in (6, 60, 18, 16):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        head += self._row(_text(app, "guide_head"))
        body = nodes.tbody()
        group += body
        here = env.docname
        for n, r in enumerate(rows, start=1):
            ref = nodes.reference("", r["title"], internal=True,
                                  refuri=app.builder.get_relative_uri(here, r["file"]))
            minutes = r["seconds"] / 60
            took = f"{r['seconds']} s" if r["seconds"] < 90 else f"{minutes:.1f} min"
            body += self._row([str(n), ref, took, str(r["exercises"])])
        total = sum(r["seconds"] for r in rows)
        note = nodes.paragraph(text=_text(app, "guide_note").format(minutes=total / 60,
                                                                   n=len(rows)))
        return [table, note]

    @staticmethod
    def _row(cells) -> nodes.row:
        row = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            para = nodes.paragraph()
            para += cell if isinstance(cell, nodes.Node) else nodes.Text(cell)
            entry += para
            row += entry
        return row


# -- 404 -------------------------------------------------------------------------------------

PAGE_404 = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Page not found · {title}</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; max-width: 36rem;
       margin: 4rem auto; padding: 0 1.25rem; line-height: 1.5; color: #222; }}
h1 {{ font-size: 1.6rem; }} a {{ color: #0a58ca; }}
</style></head>
<body>
<h1>Page not found</h1>
<p>There is no page at this address in <em>{title}</em>. Chapters are numbered
<code>notebooks/NN_name.html</code>; a page may have moved when the book grew.</p>
<p><a href="{home}">Go to the start of the book</a> or use its search.</p>
</body></html>
"""


def _write_404(app: Sphinx, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    url, _ = _repo(app)
    title = html.escape(app.config.html_title or app.config.project)
    home = html.escape(site_url(url))
    (Path(app.outdir) / "404.html").write_text(PAGE_404.format(title=title, home=home),
                                             encoding="utf-8")


# Font Awesome twice: the theme's stylesheet already carries Font Awesome's web-font CSS (every
# icon the site shows: search, menu, download, launch, GitHub, theme switch), and the theme
# also loads Font Awesome's 1.5 MB SVG script on every page, "so that users can add custom
# icons". The book adds none, so the script goes: each page gets 1.5 MB lighter and the
# icons are drawn by the 0.1-0.3 MB web fonts the stylesheet already names.
FONTAWESOME_JS = re.compile(r'[ \t]*<script defer src="[^"]*_static/scripts/fontawesome\.js'
                            r'[^"]*"></script>\n?')


def _drop_fontawesome_js(app: Sphinx, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    out = Path(app.outdir)
    for page in out.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        lighter = FONTAWESOME_JS.sub("", text)
        if lighter != text:
            page.write_text(lighter, encoding="utf-8")
    for name in ("fontawesome.js", "fontawesome.js.map", "fontawesome.js.LICENSE.txt"):
        (out / "_static" / "scripts" / name).unlink(missing_ok=True)


# -- setup -----------------------------------------------------------------------------------

def _static(app: Sphinx, config) -> None:
    config.html_static_path = [*config.html_static_path, str(STATIC)]
    opts = dict(config.html_theme_options or {})
    word = _text(app, "version")
    opts["extra_footer"] = f"{opts.get('extra_footer', '')} {word} {version()}.".strip()
    if _lang(app) == "ja":
        # What the themes and myst-nb write in English whatever the language.
        opts["search_bar_text"] = "この本を検索..."
        config.nb_code_prompt_show = "コードを表示"
        config.nb_code_prompt_hide = "コードを隠す"
    config.html_theme_options = opts


def _singlehtml_handlers(app: Sphinx) -> None:
    """The whole book on one page (``singlehtml``, printed to the PDF): an extension that
    registers a node for ``html`` only (myst-nb's hidden code cells) is looked up under
    ``singlehtml`` as soon as any other extension has registered a handler there, and fails.
    Reuse the html handlers."""
    if app.builder.name != "singlehtml":
        return
    handlers = app.registry.translation_handlers
    single = handlers.setdefault("singlehtml", {})
    for node, pair in handlers.get("html", {}).items():
        single.setdefault(node, pair)


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", _singlehtml_handlers)
    app.connect("config-inited", _static)
    app.add_css_file("tinyk3/site.css")
    app.add_js_file("tinyk3/site.js")
    app.connect("source-read", _substitute)
    app.connect("doctree-resolved", _badges)
    app.connect("doctree-resolved", _language_switch)
    app.connect("build-finished", _write_404)
    app.connect("build-finished", _drop_fontawesome_js)
    app.add_directive("chapter-guide", ChapterGuide)
    app.add_directive("term-table", TermTable)
    app.add_search_language(JapaneseBigrams)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}

"""The Japanese edition (ja/): translation catalogs, the generated Japanese book, the checks.

The English book is the one source of code and structure. The Japanese book in ``ja/`` is
*generated* from it: the same notebooks (same cells, same ids, same code, same stored outputs)
with every markdown paragraph replaced by its translation, and the same pages. Translations
live in catalogs, one per English file, under ``ja/translations/`` (``notebooks/01_gpt2.yml``
for ``notebooks/01_gpt2.ipynb``, ``book/intro.yml``, and ``_site.yml`` for the titles of the
table of contents and the site).

A catalog is a list of entries, one per paragraph-sized *block* of English (markdown split at
blank lines; a fenced directive or a display equation stays whole; a figure's caption and alt
text are blocks of their own)::

    - where: cell 5d1e9a3c, block 2      # orientation only
      en: |-
        The English block, verbatim.
      ja: |-
        その日本語訳。

Entries are found by their English text, as gettext finds ``msgid`` (a moved or re-ordered
cell keeps its translation). Blocks with nothing to translate (code, maths only, labels) need
no entry. Why YAML and not gettext ``.po`` files: the course's prose is dense with TeX, and
``.po`` strings must escape every backslash and quote (``\\mathbf``, ``\\"``), which makes the
catalogs hard to read in a review and easy to break by hand; a YAML block scalar holds the
text exactly as written. The semantics are gettext's: ``update`` works like ``msgmerge``.

    python tools/translate.py update   # after editing English: new blocks get empty entries,
                                       # changed ones keep the old translation marked stale
                                       # (``was:`` holds the English it translated)
    python tools/translate.py build    # write ja/notebooks/*.ipynb, ja/book/*.md, ja/_toc.yml,
                                       # ja/_config.yml from the English and the catalogs
    python tools/translate.py check    # make test: fails on a missing, empty or stale
                                       # translation, a translation whose maths, code, links or
                                       # directive options differ from the English, and on
                                       # generated files that are not up to date
    python tools/translate.py status   # per file: blocks, translated, stale, missing
    python tools/translate.py fill notebooks/01_gpt2 mine.yml   # translations by `where`
    python tools/translate.py terms    # terms whose first use in a chapter lacks the English
                                       # in brackets (a reading aid: it can be wrong)

A translation must keep every maths span, inline code span, link target, role target, label
and directive option of its English block (``check`` compares them as sets), so only the
words change.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import fcntl
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
JA = ROOT / "ja"
CATALOGS = JA / "translations"
SITE_CATALOG = CATALOGS / "_site.yml"

# The sentence added to every exercise statement of the Japanese edition (the checks print
# English).
EXERCISE_NOTE = "チェックが表示するメッセージ（失敗したケース、誤差、ヒント）は英語である。"

JAPANESE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uff01-\uff60]")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,}|:{3,})\s*(.*)$")
# Directives whose whole fence is structure, never prose.
VERBATIM_DIRECTIVES = {"solution-start", "solution-end", "math", "code-cell", "chapter-guide",
                       "term-table"}


# -- blocks -----------------------------------------------------------------------------------

def _normal(text: str) -> str:
    """The form blocks are stored and compared in: no trailing spaces, no outer blank lines."""
    return "\n".join(line.rstrip() for line in text.strip("\n").split("\n"))


def split(text: str) -> list[tuple[bool, str]]:
    """``text`` as pieces ``(is_block, text)``: blocks, and the runs of blank lines between
    them (kept as they are, so joining the pieces gives ``text`` back). A fenced block
    (```, ~~~ or :::) is kept whole, blank lines included; so is a ``$$`` display."""
    pieces: list[tuple[bool, str]] = []
    current: list[str] = []
    gap: list[str] = []
    fence: tuple[str, int] | None = None
    in_math = False
    for line in text.split("\n"):
        stripped = line.strip()
        if fence is None and not in_math and stripped == "":
            if current:
                pieces.append((True, "\n".join(current)))
                current = []
            gap.append(line)
            continue
        if gap:
            pieces.append((False, "\n".join(gap)))
            gap = []
        current.append(line)
        if fence is not None:
            char, length = fence
            if re.fullmatch(rf"{re.escape(char)}{{{length},}}", stripped):
                fence = None
        elif in_math:
            if stripped.endswith("$$"):
                in_math = False
        else:
            m = FENCE.match(line)
            if m:
                fence = (m.group(2)[0], len(m.group(2)))
            elif stripped.startswith("$$") and (stripped == "$$" or not stripped.endswith("$$")
                                                or len(stripped) < 4):
                in_math = True
    if current:
        pieces.append((True, "\n".join(current)))
    if gap:
        pieces.append((False, "\n".join(gap)))
    # ``split("\n")`` then ``"\n".join`` loses the separators between pieces: put them back.
    out: list[tuple[bool, str]] = []
    for i, (is_block, piece) in enumerate(pieces):
        out.append((is_block, piece))
        if i < len(pieces) - 1:
            out.append((False, "\n"))
    return _merge_gaps(out)


def _merge_gaps(pieces):
    merged: list[tuple[bool, str]] = []
    for is_block, piece in pieces:
        if merged and not is_block and not merged[-1][0]:
            merged[-1] = (False, merged[-1][1] + piece)
        else:
            merged.append((is_block, piece))
    return merged


INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
DISPLAY_MATH = re.compile(r"\$\$.+?\$\$", re.S)
INLINE_MATH = re.compile(r"(?<![\\$])\$(?!\$)(.+?)(?<![\\$])\$", re.S)
LINK_TARGET = re.compile(r"\]\(([^)\s]*)\)")
ROLE = re.compile(r"\{[a-z:-]+\}`[^`]*`")
LABEL = re.compile(r"^\s*\([A-Za-z0-9_:.-]+\)=\s*$", re.M)
OPTION = re.compile(r"^\s*:[a-z-]+:.*$", re.M)
DIRECTIVE = re.compile(r"^\s*(?:`{3,}|~{3,}|:{3,})\s*(\{[a-z-]+\})", re.M)
URL = re.compile(r"<?https?://[^\s)>]+>?")
HTML_TAG = re.compile(r"<[^>]+>")
FENCE_MARK = re.compile(r"^\s*(?:`{3,}|~{3,}|:{3,})\s*(?:\{[a-z-]+\})?", re.M)


def _without_fences(text: str) -> str:
    """``text`` with its fence markers and directive names taken out (a directive's title
    and body stay), so that inline-code patterns never pair up fence backticks."""
    return FENCE_MARK.sub(" ", text)


def keep_spans(text: str) -> dict[str, set[str]]:
    """What a translation must keep: maths, inline code, roles, link targets, labels,
    directive names and options, URLs."""
    spans: dict[str, set[str]] = {}
    rest = _without_fences(text)
    # A role's target must stay; its link text, where it has one (`text <target>`), is prose.
    spans["role"] = {re.sub(r"`[^`<]*<([^>]+)>`$", r"`<\1>`", r) for r in ROLE.findall(rest)}
    rest = ROLE.sub(" ", rest)
    spans["code"] = {" ".join(m.group(0).split()) for m in INLINE_CODE.finditer(rest)}
    rest = INLINE_CODE.sub(" ", rest)
    spans["math"] = {" ".join(m.split()) for m in DISPLAY_MATH.findall(rest)}
    rest = DISPLAY_MATH.sub(" ", rest)
    spans["math"] |= {" ".join(m.group(0).split()) for m in INLINE_MATH.finditer(rest)}
    spans["link"] = set(LINK_TARGET.findall(rest))
    spans["label"] = {m.strip() for m in LABEL.findall(text)}
    spans["option"] = {m.strip() for m in OPTION.findall(text)}
    spans["directive"] = set(DIRECTIVE.findall(text))
    return spans


def prose(text: str) -> str:
    """``text`` without what is never translated (code, maths, targets, markup)."""
    m = FENCE.match(text.split("\n", 1)[0])
    if m:
        info = m.group(3)
        name = re.match(r"\{([a-z-]+)\}", info)
        if name is None or name.group(1) in VERBATIM_DIRECTIVES:
            return ""  # a code fence or a structural directive
    rest = ROLE.sub(" ", _without_fences(text))
    rest = INLINE_CODE.sub(" ", rest)
    rest = DISPLAY_MATH.sub(" ", rest)
    rest = INLINE_MATH.sub(" ", rest)
    rest = LINK_TARGET.sub("] ", rest)
    rest = LABEL.sub(" ", rest)
    rest = OPTION.sub(" ", rest)
    rest = URL.sub(" ", rest)
    rest = HTML_TAG.sub(" ", rest)
    return re.sub(r"@[A-Z_]+@", " ", rest)


def needs_translation(block: str) -> bool:
    return re.search(r"[A-Za-z]{2,}", prose(block)) is not None


# -- sources ----------------------------------------------------------------------------------

@dataclass
class Block:
    where: str
    en: str


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [c["file"] for c in part.get("chapters", [])]
    return files


def source_path(file: str) -> Path:
    for suffix in (".ipynb", ".md"):
        path = ROOT / f"{file}{suffix}"
        if path.is_file():
            return path
    raise FileNotFoundError(f"_toc.yml names {file!r}, which is neither .ipynb nor .md")


def catalog_path(file: str) -> Path:
    return CATALOGS / f"{file}.yml"


def _cell_text(cell) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def _metadata_texts(cell) -> list[tuple[str, str]]:
    """A code cell's figure caption and alt text: (key, text)."""
    meta = cell.get("metadata", {}).get("mystnb", {})
    out = []
    caption = meta.get("figure", {}).get("caption")
    if caption:
        out.append(("caption", caption))
    alt = meta.get("image", {}).get("alt")
    if alt:
        out.append(("alt", alt))
    return out


def extract(file: str) -> list[Block]:
    """The blocks of one English file that need a translation, in document order."""
    path = source_path(file)
    blocks: list[Block] = []
    if path.suffix == ".md":
        n = 0
        for is_block, text in split(path.read_text(encoding="utf-8")):
            if is_block:
                n += 1
                if needs_translation(text):
                    blocks.append(Block(f"block {n}", _normal(text)))
        return blocks
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        cid = cell.get("id", "?")
        if cell["cell_type"] == "markdown":
            n = 0
            for is_block, text in split(_cell_text(cell)):
                if is_block:
                    n += 1
                    if needs_translation(text):
                        blocks.append(Block(f"cell {cid}, block {n}", _normal(text)))
        elif cell["cell_type"] == "code":
            for key, text in _metadata_texts(cell):
                blocks.append(Block(f"cell {cid}, figure {key}", _normal(text)))
    return blocks


def site_blocks() -> list[Block]:
    """The table of contents' part captions and the site's title and footer."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    blocks = [Block("_config.yml title", config["title"]),
              Block("_config.yml html.extra_footer", config["html"]["extra_footer"])]
    blocks += [Block(f"_toc.yml caption {n}", part["caption"])
               for n, part in enumerate(toc.get("parts", []), start=1)]
    return blocks


# -- catalogs ---------------------------------------------------------------------------------

def _scalar(key: str, text: str) -> str:
    if text == "":
        return f'  {key}: ""\n'
    indicator = "2" if text[:1] in (" ", "\t") else ""
    body = "".join(f"    {line}\n" if line else "\n" for line in text.split("\n"))
    return f"  {key}: |{indicator}-\n{body}"


def dump_catalog(path: Path, english: str, entries: list[dict]) -> None:
    out = [f"# Japanese translation of {english}: see tools/translate.py (one entry per block;\n"
           "# `en` is the English exactly, `ja` its translation; `was` marks a stale one).\n"]
    for e in entries:
        out.append(f"- where: {e['where']}\n")
        out.append(_scalar("en", e["en"]))
        if e.get("was") is not None:
            out.append(_scalar("was", e["was"]))
        out.append(_scalar("ja", e.get("ja", "")))
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(out)
    yaml.load(text, Loader=yaml.CSafeLoader)  # never write what cannot be read back
    path.write_text(text, encoding="utf-8")


def load_catalog(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    except yaml.YAMLError as exc:
        raise SystemExit(f"{path.relative_to(ROOT)}: not valid YAML: {exc}") from None
    if data is None:
        return []
    if not isinstance(data, list) or not all(isinstance(e, dict) and "en" in e for e in data):
        raise SystemExit(f"{path.relative_to(ROOT)}: expected a list of entries with `en`")
    for e in data:
        e["en"] = _normal(str(e["en"]))
        e["ja"] = _normal(str(e.get("ja") or ""))
        if e.get("was") is not None:
            e["was"] = _normal(str(e["was"]))
    return data


@contextlib.contextmanager
def locked(path: Path):
    """Hold an exclusive lock for a read-modify-write of one catalog (several translators may
    fill catalogs at once)."""
    lock = path.parent / f".{path.name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def merge(blocks: list[Block], old: list[dict]) -> list[dict]:
    """``msgmerge``: keep exact matches, carry a changed block's old translation as stale,
    give new blocks an empty entry; entries whose English is gone are dropped."""
    by_en = {}
    for e in old:
        if e["ja"] or e["en"] not in by_en:
            by_en[e["en"]] = e
    current = {b.en for b in blocks}
    orphans = [e for e in old if e["en"] not in current and e["ja"]]
    used: set[int] = set()
    entries = []
    for b in blocks:
        hit = by_en.get(b.en)
        if hit is not None:
            entries.append({"where": b.where, "en": b.en, "ja": hit["ja"],
                            "was": hit.get("was")})
            continue
        best, score = None, 0.0
        for i, e in enumerate(orphans):
            if i in used:
                continue
            r = difflib.SequenceMatcher(None, e["en"], b.en, autojunk=False).ratio()
            if r > score:
                best, score = i, r
        if best is not None and score >= 0.6:
            used.add(best)
            e = orphans[best]
            entries.append({"where": b.where, "en": b.en, "ja": e["ja"],
                            "was": e.get("was") or e["en"]})
        else:
            entries.append({"where": b.where, "en": b.en, "ja": ""})
    return entries


# -- the Japanese book ------------------------------------------------------------------------

def _with_exercise_note(text: str) -> str:
    """Add EXERCISE_NOTE as the last paragraph of an ``{exercise}`` directive."""
    lines = text.split("\n")
    if not lines or not re.match(r"^\s*`{3,}\{exercise\}", lines[0]):
        return text
    fence = FENCE.match(lines[0]).group(2)
    for i in range(len(lines) - 1, 0, -1):
        if lines[i].strip() == fence:
            return "\n".join(lines[:i] + ["", EXERCISE_NOTE] + lines[i:])
    return text


def translate_text(text: str, table: dict[str, str], where: str, problems: list[str]) -> str:
    out = []
    for is_block, piece in split(text):
        if is_block and needs_translation(piece):
            ja = table.get(_normal(piece))
            if not ja:
                problems.append(f"{where}: no translation for block starting "
                                f"{_normal(piece)[:60]!r}")
                ja = piece
            out.append(_with_exercise_note(ja))
        else:
            out.append(piece)
    return "".join(out)


def _table(catalog: Path) -> dict[str, str]:
    """English -> Japanese of one catalog's translated entries."""
    return {e["en"]: e["ja"] for e in load_catalog(catalog) if e["ja"]}


def _source_lines(text: str) -> list[str]:
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def generate(file: str, problems: list[str]) -> tuple[Path, str]:
    """The Japanese version of one English file: (path under ja/, text)."""
    path = source_path(file)
    table = _table(catalog_path(file))
    target = JA / path.relative_to(ROOT)
    if path.suffix == ".md":
        return target, translate_text(path.read_text(encoding="utf-8"), table, file, problems)
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        where = f"{file}, cell {cell.get('id', '?')}"
        if cell["cell_type"] == "markdown":
            text = translate_text(_cell_text(cell), table, where, problems)
            cell["source"] = _source_lines(text)
        elif cell["cell_type"] == "code":
            meta = cell.get("metadata", {}).get("mystnb", {})
            for key, text in _metadata_texts(cell):
                ja = table.get(_normal(text))
                if not ja:
                    problems.append(f"{where}: no translation of the figure {key}")
                    continue
                if key == "caption":
                    meta["figure"]["caption"] = ja
                else:
                    meta["image"]["alt"] = ja
    nb["metadata"]["tinyk3"] = {"edition": "ja", "generated_from": path.relative_to(ROOT)
                                .as_posix()}
    return target, json.dumps(nb, ensure_ascii=False, indent=1) + "\n"


def generate_toc(problems: list[str]) -> str:
    table = _table(SITE_CATALOG)
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    for part in toc.get("parts", []):
        ja = table.get(part["caption"])
        if not ja:
            problems.append(f"_toc.yml: no translation of the caption {part['caption']!r}")
        else:
            part["caption"] = ja
    head = ("# Generated by tools/translate.py build from ../_toc.yml and translations/_site.yml:"
            " do not edit.\n")
    return head + yaml.safe_dump(toc, allow_unicode=True, sort_keys=False, width=100)


def generate_config(problems: list[str]) -> str:
    table = _table(SITE_CATALOG)
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    for section, key in ((config, "title"), (config["html"], "extra_footer")):
        ja = table.get(section[key])
        if not ja:
            problems.append(f"_config.yml: no translation of {key} {section[key]!r}")
        else:
            section[key] = ja
    config["exclude_patterns"] = [p for p in config.get("exclude_patterns", []) if p != "ja"] \
        + ["translations", "STYLE.md", "terms.yml"]
    config["repository"]["path_to_book"] = "ja"
    config["html"]["favicon"] = "../" + config["html"]["favicon"]
    sphinx = config["sphinx"]
    sphinx["local_extensions"] = {k: "../" + v for k, v in sphinx["local_extensions"].items()}
    sphinx["config"]["language"] = "ja"
    sphinx["config"]["html_static_path"] = ["../" + p
                                            for p in sphinx["config"]["html_static_path"]]
    head = ("# Generated by tools/translate.py build from ../_config.yml (the Japanese site's\n"
            "# language, paths one level up, the translated title and footer): do not edit.\n")
    return head + yaml.safe_dump(config, allow_unicode=True, sort_keys=False, width=100)


def outputs(problems: list[str]) -> dict[Path, str]:
    files = {}
    for file in toc_files():
        target, text = generate(file, problems)
        files[target] = text
    files[JA / "_toc.yml"] = generate_toc(problems)
    files[JA / "_config.yml"] = generate_config(problems)
    return files


# -- checks -----------------------------------------------------------------------------------

def _literal_asterisks(text: str) -> int:
    """How many ``*`` a reader would see: the block rendered as CommonMark, maths and code
    taken out first."""
    from markdown_it import MarkdownIt

    rest = INLINE_CODE.sub("C", DISPLAY_MATH.sub("M", _without_fences(text)))
    rest = INLINE_MATH.sub("M", rest)
    rendered = MarkdownIt("commonmark").render(rest)
    return re.sub(r"<[^>]+>", "", rendered).count("*")


def entry_problems(where: str, e: dict) -> list[str]:
    out = []
    if not e["ja"]:
        return [f"{where}: missing translation ({e['where']})"]
    if e.get("was") is not None:
        diff = "\n".join(difflib.unified_diff(e["was"].split("\n"), e["en"].split("\n"),
                                              "translated English", "current English",
                                              lineterm="", n=0))
        return [f"{where}: stale translation ({e['where']}): the English changed since it was"
                f" translated; update `ja`, then delete `was`:\n{diff}"]
    if needs_translation(e["en"]) and not JAPANESE.search(prose(e["ja"])) \
            and len(re.findall(r"[A-Za-z]{2,}", prose(e["en"]))) >= 3:
        out.append(f"{where}: `ja` has no Japanese ({e['where']})")
    if "*" in e["ja"] and _literal_asterisks(e["ja"]) > _literal_asterisks(e["en"]):
        out.append(f"{where}: emphasis that renders as literal asterisks ({e['where']}): "
                   "no punctuation or bracket just inside **...** (write **状態**「」, not "
                   "**「状態」**)")
    en, ja = keep_spans(e["en"]), keep_spans(e["ja"])
    for kind in en:
        lost, added = en[kind] - ja[kind], ja[kind] - en[kind]
        if lost or added:
            out.append(f"{where}: the {kind} spans differ from the English ({e['where']}):"
                       f" missing {sorted(lost)}, not in the English {sorted(added)}")
    return out


def check(files: list[str] | None = None, generated: bool = True) -> list[str]:
    problems: list[str] = []
    wanted = files or toc_files()
    for file in wanted:
        blocks = extract(file)
        entries = {e["en"]: e for e in load_catalog(catalog_path(file))}
        rel = catalog_path(file).relative_to(ROOT).as_posix()
        for b in blocks:
            e = entries.get(b.en)
            if e is None:
                problems.append(f"{rel}: no entry for {b.where} (run tools/translate.py update)")
                continue
            problems += entry_problems(rel, e)
    if files is None:
        site = {e["en"]: e for e in load_catalog(SITE_CATALOG)}
        for b in site_blocks():
            e = site.get(b.en)
            if e is None:
                problems.append(f"ja/translations/_site.yml: no entry for {b.where}")
            else:
                problems += entry_problems("ja/translations/_site.yml", e)
        known = {catalog_path(f) for f in wanted} | {SITE_CATALOG}
        for path in sorted(CATALOGS.rglob("*.yml")):
            if path not in known:
                problems.append(f"{path.relative_to(ROOT)}: a catalog for no English file in"
                                " _toc.yml (delete it)")
    if generated and not problems:
        build_problems: list[str] = []
        for path, text in outputs(build_problems).items():
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                problems.append(f"{path.relative_to(ROOT)}: not up to date (run "
                                "tools/translate.py build)")
        problems += build_problems
    return problems


def code_cells_identical() -> list[str]:
    """The Japanese notebooks' code cells and outputs are the English ones, byte for byte."""
    problems = []
    for file in toc_files():
        en_path = source_path(file)
        if en_path.suffix != ".ipynb":
            continue
        ja_path = JA / en_path.relative_to(ROOT)
        if not ja_path.is_file():
            problems.append(f"{ja_path.relative_to(ROOT)}: missing")
            continue
        en = json.loads(en_path.read_text(encoding="utf-8"))["cells"]
        ja = json.loads(ja_path.read_text(encoding="utf-8"))["cells"]
        if [(c["cell_type"], c.get("id")) for c in en] != \
                [(c["cell_type"], c.get("id")) for c in ja]:
            problems.append(f"{ja_path.relative_to(ROOT)}: cells differ from the English")
            continue
        for a, b in zip(en, ja):
            if a["cell_type"] == "code" and (a["source"] != b["source"]
                                             or a.get("outputs") != b.get("outputs")):
                problems.append(f"{ja_path.relative_to(ROOT)}: code cell {a.get('id')} differs")
    return problems


# -- commands ---------------------------------------------------------------------------------

def cmd_update(args) -> int:
    for file in args.files or toc_files():
        path = catalog_path(file)
        with locked(path):
            entries = merge(extract(file), load_catalog(path))
            dump_catalog(path, source_path(file).relative_to(ROOT).as_posix(), entries)
    if not args.files:
        site = merge(site_blocks(), load_catalog(SITE_CATALOG))
        dump_catalog(SITE_CATALOG, "_toc.yml and _config.yml", site)
    return 0


def cmd_fill(args) -> int:
    """Put translations into one catalog by ``where``: FILE is a YAML list of
    ``{where: ..., ja: ...}`` (as a translator writes them, without copying the English)."""
    path = catalog_path(args.file) if args.file != "_site" else SITE_CATALOG
    with locked(path):
        return _fill(args, path)


def _fill(args, path: Path) -> int:
    entries = load_catalog(path)
    if not entries:
        raise SystemExit(f"{path.relative_to(ROOT)}: no catalog (run update first)")
    try:
        new = yaml.load(Path(args.translations).read_text(encoding="utf-8"),
                        Loader=yaml.CSafeLoader)
    except yaml.YAMLError as exc:
        raise SystemExit(f"{args.translations}: not valid YAML: {exc}") from None
    by_where = {e["where"]: e for e in entries}
    unknown = [n.get("where") for n in new if n.get("where") not in by_where]
    if unknown:
        raise SystemExit(f"{args.translations}: no entry with where = {unknown}")
    for n in new:
        e = by_where[n["where"]]
        e["ja"] = _normal(str(n.get("ja") or ""))
        e.pop("was", None)
    english = "_toc.yml and _config.yml" if args.file == "_site" else \
        source_path(args.file).relative_to(ROOT).as_posix()
    dump_catalog(path, english, entries)
    rel = path.relative_to(ROOT).as_posix()
    problems = [p for e in entries if e["where"] in {n["where"] for n in new}
                for p in entry_problems(rel, e)]
    for p in problems:
        print(f"translate fill: {p}")
    print(f"translate fill: {len(new)} entries into {rel}; "
          f"{sum(1 for e in entries if not e['ja'])} of {len(entries)} still empty")
    return 1 if problems else 0


def cmd_build(args) -> int:
    problems: list[str] = []
    for path, text in outputs(problems).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
    for p in problems:
        print(f"translate build: {p}")
    return 1 if problems and not args.partial else 0


def cmd_check(args) -> int:
    problems = check(args.files or None, generated=not args.files)
    if not args.files:
        problems += code_cells_identical()
    for p in problems:
        print(f"translate check: {p}")
    if problems:
        print(f"translate check: {len(problems)} problem(s); see tools/translate.py")
        return 1
    print("translate check: every block translated, none stale, generated files up to date")
    return 0


def first_uses(file: str) -> list[str]:
    """Terms of ja/terms.yml whose first use in a chapter's body (headings aside) has no
    English in brackets after it: 線形注意（linear attention）. A reading aid, not a check:
    a common word (まとめる, 注意する) can look like a term."""
    terms = yaml.safe_load((JA / "terms.yml").read_text(encoding="utf-8"))
    longer = {t["ja"]: [u["ja"] for u in terms if t["ja"] in u["ja"] and u["ja"] != t["ja"]]
              for t in terms}
    body = "\n".join(line for e in load_catalog(catalog_path(file))
                     for line in e["ja"].split("\n") if not re.match(r"#{1,6} ", line))
    body = INLINE_MATH.sub(" ", INLINE_CODE.sub(" ", DISPLAY_MATH.sub(" ", body)))
    out = []
    for t in terms:
        if t.get("bracket", True) is False:
            continue
        for m in re.finditer(re.escape(t["ja"]), body):
            # a use of 注意 inside 線形注意 is a use of the longer term
            inside = any(body.startswith(u, start)
                         for u in longer[t["ja"]]
                         for start in range(max(0, m.start() - len(u) + 1), m.start() + 1))
            if inside:
                continue
            after = body[m.end():m.end() + 80]
            bracket = re.match(r"[^（。\n]{0,16}（([^）]*)）", after)
            head = t["en"].lower().split()[-1].rstrip("s")
            if not (bracket and head in bracket.group(1).lower()):
                out.append(f"{t['ja']} ({t['en']}): …{body[max(0, m.start() - 12):m.end() + 16]}…")
            break
    return out


def cmd_terms(args) -> int:
    for file in args.files or [f for f in toc_files() if f.startswith("notebooks/")]:
        for line in first_uses(file):
            print(f"{file}: {line}")
    return 0


def cmd_status(args) -> int:
    for file in args.files or toc_files():
        entries = load_catalog(catalog_path(file))
        blocks = extract(file)
        done = sum(1 for e in entries if e["ja"] and e.get("was") is None)
        stale = sum(1 for e in entries if e.get("was") is not None)
        words = sum(len(b.en.split()) for b in blocks)
        print(f"{file:45s} blocks {len(blocks):4d}  words {words:6d}  translated {done:4d}"
              f"  stale {stale:3d}  missing {len(blocks) - done - stale:4d}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    fill = sub.add_parser("fill", help=cmd_fill.__doc__.split("\n")[0])
    fill.add_argument("file", help="English file as named in _toc.yml, or _site")
    fill.add_argument("translations", help="YAML list of {where, ja}")
    fill.set_defaults(fn=cmd_fill)
    for name, fn in (("update", cmd_update), ("build", cmd_build), ("check", cmd_check),
                     ("status", cmd_status), ("terms", cmd_terms)):
        p = sub.add_parser(name)
        p.add_argument("files", nargs="*", help="English files as named in _toc.yml "
                       "(notebooks/01_gpt2); default: all")
        if name == "build":
            p.add_argument("--partial", action="store_true",
                           help="write the Japanese book even where translations are missing")
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

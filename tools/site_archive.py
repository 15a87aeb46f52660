"""The website as one zip that opens from disk (`make site-archive`, part of `make dist`).

Everything the pages load is in the built site (MathJax, RequireJS and the widget manager
are vendored by `make vendor`), so the archive's pages work from file:// with no server and
no network: unzip it and open tinyk3-site-VERSION/index.html. The zip is reproducible: its
entries are sorted and carry one fixed timestamp.

    python tools/site_archive.py _build/html dist/tinyk3-site-1.0.0.zip --version 1.0.0
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

STAMP = (2026, 1, 1, 0, 0, 0)  # every entry's time: the same bytes from the same site
README = """GPT-2 to Kimi K3, version {version}: the course website.

Open index.html in a browser (double-click it, or file:///path/to/{top}/index.html).
No server and no network are needed. The notebooks, the package and the tests are in the
repository; the wheel of the same release is tinyk3-{version}-py3-none-any.whl.
"""


def build(site: Path, out: Path, version: str) -> int:
    if not (site / "index.html").is_file():
        sys.exit(f"{site} has no index.html: build the site first (make html)")
    top = f"tinyk3-site-{version}"
    files = sorted(p for p in site.rglob("*") if p.is_file() and p.name != ".buildinfo")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".zip.tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        info = zipfile.ZipInfo(f"{top}/README.txt", STAMP)
        info.compress_type = zipfile.ZIP_DEFLATED
        z.writestr(info, README.format(version=version, top=top))
        for p in files:
            info = zipfile.ZipInfo(f"{top}/{p.relative_to(site).as_posix()}", STAMP)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, p.read_bytes())
    tmp.replace(out)
    return len(files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("site", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--version", required=True)
    args = ap.parse_args()
    n = build(args.site, args.out, args.version)
    size = args.out.stat().st_size / 2**20
    print(f"wrote {args.out} ({n} files, {size:.1f} MiB)")


if __name__ == "__main__":
    main()

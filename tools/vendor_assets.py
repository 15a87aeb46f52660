"""Copy the browser assets the site needs from node_modules/ into _vendor/ (run after `npm ci`).

    .venv/bin/python tools/vendor_assets.py        # from the repository root (`make vendor`)

_config.yml serves _vendor/ as the site's _static/ folder (`html_static_path`), so the built
book loads MathJax, RequireJS and the ipywidgets HTML manager from itself and renders with
no network:

    _vendor/mathjax/tex-chtml.js         `mathjax_path`; loads input/tex/extensions/*,
                                         output/chtml/fonts/woff-v2/*, ui/*, a11y/*, sre/*
                                         lazily, relative to its own URL
    _vendor/widgets/require.js           RequireJS, the AMD loader embed-amd.js needs
    _vendor/widgets/config.js            written here: makes embed-amd.js resolve its assets
                                         (Font Awesome fonts) and any non-core widget module
                                         under _static/widgets/, never from a CDN, and lets
                                         widgets typeset math with MathJax 3
    _vendor/widgets/embed-amd.js         @jupyter-widgets/html-manager: renders the widget
                                         state stored in each notebook (base, controls and
                                         output are built into this file)

`nb_ipywidgets_js` in _config.yml lists the three widget scripts, in this order.
Not `_static/`: Jupyter Book adds every .js under a source `_static/` folder to every page.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODE = ROOT / "node_modules"
OUT = ROOT / "_vendor"

# MathJax 3 "es5" components: tex-chtml.js itself plus what it loads at run time. The TeX
# extensions are loaded by \require and by autoload (e.g. \boldsymbol, \cancel, \bbox);
# ui/ and a11y/ back the right-click menu; sre/ (speech rule engine, about 4 MB) is loaded
# only when a reader turns on the menu's accessibility explorer or speech.
MATHJAX_FILES = ["tex-chtml.js"]
MATHJAX_DIRS = [
    "input/tex/extensions",
    "output/chtml/fonts/woff-v2",
    "ui",
    "a11y",
    "sre",
]

# html-manager's dist/: the AMD bundle and the Font Awesome fonts its CSS refers to
# (woff2/woff/ttf; .eot and .svg fonts only serve browsers from before 2016).
WIDGET_FONT_SUFFIXES = {".woff2", ".woff", ".ttf"}

# Licence texts travel with the files (require.js carries its MIT header inline).
LICENSES = {
    "mathjax/LICENSE": "mathjax/LICENSE",
    "widgets/embed-amd.js.LICENSE.txt": "@jupyter-widgets/html-manager/dist/embed.js.LICENSE.txt",
    "widgets/LICENSE.fontawesome.txt": "@fortawesome/fontawesome-free/LICENSE.txt",
}

# Loaded after require.js and before embed-amd.js (see nb_ipywidgets_js in _config.yml).
# Page URLs differ in depth, so the folder is taken from this script's own URL.
WIDGETS_CONFIG_JS = r"""// Written by tools/vendor_assets.py: keeps the widget manager on this site.
(function () {
  var script = document.currentScript;
  var dir = script.src.slice(0, script.src.lastIndexOf("/") + 1);
  // Public path for embed-amd.js's own assets (Font Awesome fonts used by icons).
  window.__jupyter_widgets_assets_path__ = dir;
  // Module URIs of the named modules inside embed-amd.js, so their assets resolve here too.
  var paths = {};
  ["base", "base7", "controls", "controls7", "output", "html-manager"].forEach(function (m) {
    paths["@jupyter-widgets/" + m] = dir + m;
  });
  paths["@jupyter-widgets/html-manager/dist/libembed-amd"] = dir + "libembed-amd";
  window.requirejs.config({ paths: paths });
  // Widget libraries other than base/controls/output are looked up under
  // _static/widgets/npm/<name>@<version>/dist/index.js and nowhere else (embed-amd.js
  // reads these attributes from any <script>; the default is cdn.jsdelivr.net).
  script.setAttribute("data-jupyter-widgets-cdn", dir + "npm/");
  script.setAttribute("data-jupyter-widgets-cdn-only", "");
  // ipywidgets typesets descriptions, Label and HTMLMath values with the MathJax 2 API
  // (MathJax.Hub.Queue); the site runs MathJax 3, which has no Hub, so every such widget
  // would throw. Give MathJax 3 a Hub whose Queue typesets with the version 3 API. Sphinx's
  // MathJax 3 finds only \(..\) and \[..\], while widget text uses $..$ and $$..$$
  // as in JupyterLab: rewrite those delimiters in the widget's text first.
  // MathJax is a deferred script: it has replaced its config object by DOMContentLoaded,
  // and widgets render only at the load event.
  function dollarsToTex(el) {
    var walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    var node;
    while ((node = walker.nextNode())) {
      if (node.nodeValue.indexOf("$") < 0) continue;
      if (node.parentElement.closest("script, style, textarea, pre, code")) continue;
      node.nodeValue = node.nodeValue
        .replace(/(^|[^\\])\$\$([^$]+)\$\$/g, "$1\\[$2\\]")
        .replace(/(^|[^\\])\$([^$]+)\$/g, "$1\\($2\\)");
    }
  }
  document.addEventListener("DOMContentLoaded", function () {
    var mj = window.MathJax;
    if (!mj || mj.Hub || !mj.startup) return;
    mj.Hub = {
      Queue: function () {
        Array.prototype.forEach.call(arguments, function (job) {
          if (Array.isArray(job) && job[0] === "Typeset" && job[2]) {
            mj.startup.promise = mj.startup.promise.then(function () {
              dollarsToTex(job[2]);
              return mj.typesetPromise([job[2]]);
            });
          }
        });
      },
    };
  });
})();
"""


def copy(src: Path, dst: Path) -> int:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
    return src.stat().st_size


def copy_tree(src: Path, dst: Path) -> int:
    total = 0
    for f in sorted(src.rglob("*")):
        if f.is_file():
            total += copy(f, dst / f.relative_to(src))
    return total


def main() -> int:
    need = [NODE / "mathjax/es5/tex-chtml.js", NODE / "requirejs/require.js",
            NODE / "@jupyter-widgets/html-manager/dist/embed-amd.js"]
    missing = [str(p.relative_to(ROOT)) for p in need if not p.is_file()]
    if missing:
        print(f"vendor_assets: missing {', '.join(missing)}; run `npm ci` first", file=sys.stderr)
        return 1

    if OUT.exists():
        shutil.rmtree(OUT)
    total = 0

    mathjax = NODE / "mathjax/es5"
    for name in MATHJAX_FILES:
        total += copy(mathjax / name, OUT / "mathjax" / name)
    for name in MATHJAX_DIRS:
        total += copy_tree(mathjax / name, OUT / "mathjax" / name)

    widgets = OUT / "widgets"
    total += copy(NODE / "requirejs/require.js", widgets / "require.js")
    dist = NODE / "@jupyter-widgets/html-manager/dist"
    total += copy(dist / "embed-amd.js", widgets / "embed-amd.js")
    for f in sorted(dist.iterdir()):
        if f.suffix in WIDGET_FONT_SUFFIXES:
            total += copy(f, widgets / f.name)
    (widgets / "config.js").write_text(WIDGETS_CONFIG_JS)
    total += len(WIDGETS_CONFIG_JS)

    for dst, src in LICENSES.items():
        total += copy(NODE / src, OUT / dst)

    nfiles = sum(1 for f in OUT.rglob("*") if f.is_file())
    print(f"vendor_assets: {nfiles} files, {total / 2**20:.1f} MiB -> {OUT.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

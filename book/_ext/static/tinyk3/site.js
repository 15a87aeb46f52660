// The course's own script (book/_ext/tinyk3_site.py adds it to every page).
//
// Sidebar buttons. pydata-sphinx-theme 0.17 and sphinx-book-theme 1.3 attach their click
// handlers to the FIRST `.primary-toggle` / `.secondary-toggle` of the page only
// (pydata-sphinx-theme issue 2451). sphinx-book-theme renders a second pair in the article
// header, and that pair is the one a reader sees: on a phone tapping it did nothing, on a
// desktop the menu could not be collapsed. Each other button forwards its click to the
// first one, so the themes' own code runs: on a wide screen it collapses or restores the
// sidebar, on a narrow one it opens the sidebar as a dialog.
(function () {
  function forward(selector) {
    var buttons = document.querySelectorAll(selector);
    for (var i = 1; i < buttons.length; i++) {
      buttons[i].addEventListener("click", function (event) {
        event.preventDefault();
        event.stopPropagation();
        buttons[0].click();
      });
    }
  }
  // Printed tables, listings and diffs keep their columns: an output whose lines are aligned
  // (a run of spaces inside a line, indented lines, a diff's +/- column) does not wrap; it
  // scrolls inside its box, with the scroll shadow (site.css, `pre.tinyk3-aligned`). Prose-like
  // outputs and the autograder's reports (already wrapped to 88 columns) keep wrapping.
  function aligned(text) {
    var lines = text.replace(/\n+$/, "").split("\n");
    if (lines.length < 2 || /^[\u2714\u2718\u25cb]/.test(text)) return false;
    var inner = 0, indented = 0, diff = 0;
    for (var i = 0; i < lines.length; i++) {
      if (/\S {2,}\S/.test(lines[i])) inner++;
      if (/^ {4,}\S/.test(lines[i])) indented++;
      if (/^[+-](?![+-])/.test(lines[i])) diff++;
    }
    return inner >= 2 || indented >= 3 || diff >= 3;
  }
  // An output longer than FOLD_LINES lines is folded behind a summary that says how long it
  // is; it opens in place, and for printing.
  var FOLD_LINES = 30;
  function outputs() {
    var blocks = document.querySelectorAll("div.cell_output pre");
    for (var i = 0; i < blocks.length; i++) {
      var pre = blocks[i];
      var text = pre.textContent;
      if (aligned(text)) pre.classList.add("tinyk3-aligned");
      var n = text.replace(/\n+$/, "").split("\n").length;
      if (n > FOLD_LINES && !pre.closest("details")) {
        var box = pre.closest(".output") || pre;
        var details = document.createElement("details");
        details.className = "tinyk3-fold";
        var summary = document.createElement("summary");
        summary.textContent = "Show the output (" + n + " lines)";
        details.appendChild(summary);
        box.parentNode.insertBefore(details, box);
        details.appendChild(box);
      }
    }
    window.addEventListener("beforeprint", function () {
      var folds = document.querySelectorAll("details.tinyk3-fold");
      for (var j = 0; j < folds.length; j++) folds[j].open = true;
    });
  }
  // A solution's title names its exercise as a link: clicking it jumped to the exercise and
  // left the solution folded. Clicking the title now unfolds the solution, as its button does.
  function solutionTitles() {
    var links = document.querySelectorAll(".solution > .admonition-title a");
    for (var i = 0; i < links.length; i++) {
      links[i].addEventListener("click", function (event) {
        var button = this.closest(".solution").querySelector(".toggle-button");
        if (!button) return;
        event.preventDefault();
        button.click();
      });
    }
  }
  // An identifier in a heading breaks after a dot or an underscore or between the words of a
  // CamelCase name ("gated_delta_rule.|chunked", "KimiLinear|ForCausalLM"), not inside a word
  // ("ch|unked"): a <wbr> at each such place, which line breaking prefers over site.css's
  // break-anywhere fallback.
  function headingBreaks() {
    var codes = document.querySelectorAll("article h1 code, article h2 code, article h3 code");
    for (var i = 0; i < codes.length; i++) {
      var walker = document.createTreeWalker(codes[i], NodeFilter.SHOW_TEXT);
      var texts = [];
      while (walker.nextNode()) texts.push(walker.currentNode);
      for (var j = 0; j < texts.length; j++) {
        var parts = texts[j].nodeValue.split(/(?<=[._])|(?<=[a-z])(?=[A-Z])/);
        if (parts.length < 2) continue;
        var frag = document.createDocumentFragment();
        for (var k = 0; k < parts.length; k++) {
          frag.appendChild(document.createTextNode(parts[k]));
          if (k < parts.length - 1) frag.appendChild(document.createElement("wbr"));
        }
        texts[j].parentNode.replaceChild(frag, texts[j]);
      }
    }
  }
  // Phone drawers (the theme's <dialog>s). Tapping an entry of the page's contents scrolls
  // the page underneath: close the drawer so that the reader sees the section. Opening the
  // chapter menu shows the current chapter, not the top of a long list.
  function drawers() {
    var contents = document.getElementById("pst-secondary-sidebar-modal");
    if (contents) {
      contents.addEventListener("click", function (event) {
        var link = event.target.closest("a[href]");
        if (link && contents.open) setTimeout(function () { contents.close(); }, 0);
      });
    }
    var menu = document.getElementById("pst-primary-sidebar-modal");
    if (menu && window.MutationObserver) {
      new MutationObserver(function () {
        if (!menu.open) return;
        var current = menu.querySelectorAll("li.current > a, a.current");
        if (current.length) current[current.length - 1].scrollIntoView({block: "center"});
      }).observe(menu, {attributes: true, attributeFilter: ["open"]});
    }
  }
  // The widgets' pictures (precomputed frames) come without alt text: describe each visible
  // frame by its sliders' labels and values, and keep that up to date as a slider moves.
  function widgetAlt() {
    function describe(area) {
      var parts = [];
      var sliders = area.querySelectorAll(".widget-slider, .widget-hslider");
      for (var i = 0; i < sliders.length; i++) {
        var label = sliders[i].querySelector(".widget-label");
        var readout = sliders[i].querySelector(".widget-readout");
        var name = label ? label.textContent.trim() : "";
        var value = readout ? (readout.value || readout.textContent || "").trim() : "";
        if (name || value) parts.push((name ? name + " " : "") + value);
      }
      return "Interactive figure, the frame for " + (parts.join(", ") || "the current setting")
        + "; move the slider to change it.";
    }
    function update() {
      var areas = document.querySelectorAll(".widget-subarea");
      for (var i = 0; i < areas.length; i++) {
        var text = describe(areas[i]);
        var images = areas[i].querySelectorAll("img");
        for (var j = 0; j < images.length; j++) {
          if (images[j].getAttribute("alt") !== text) images[j].setAttribute("alt", text);
        }
      }
    }
    if (!document.querySelector(".widget-subarea, script[type='application/vnd.jupyter.widget-view+json']")) return;
    var pending = null;
    new MutationObserver(function () {
      if (pending) return;
      pending = setTimeout(function () { pending = null; update(); }, 50);
    }).observe(document.body, {subtree: true, childList: true, characterData: true,
                               attributes: true, attributeFilter: ["src", "value", "class"]});
    update();
  }
  // Figures: tapping one opens it enlarged (twice its shown width, at least 680 px, at most
  // its own pixels) in a full-screen layer that scrolls both ways, so a phone reader can read
  // a multi-panel figure's labels. Tapping the layer, its Close button or Escape closes it and
  // gives the focus back to the figure. A figure already shown at its own size keeps its
  // plain link to the image file.
  function figureZoom() {
    function open(img, link) {
      var shown = img.getBoundingClientRect().width;
      var width = Math.min(img.naturalWidth, Math.max(2 * shown, 680));
      var layer = document.createElement("div");
      layer.className = "tinyk3-zoom";
      layer.setAttribute("role", "dialog");
      layer.setAttribute("aria-modal", "true");
      layer.setAttribute("aria-label", "Enlarged figure");
      var close = document.createElement("button");
      close.type = "button";
      close.textContent = "Close";
      var big = document.createElement("img");
      big.src = img.currentSrc || img.src;
      big.alt = img.alt;
      big.style.width = Math.round(width) + "px";
      layer.appendChild(close);
      layer.appendChild(big);
      function key(event) { if (event.key === "Escape") shut(); }
      function shut() {
        document.removeEventListener("keydown", key);
        if (layer.parentNode) layer.parentNode.removeChild(layer);
        document.documentElement.style.overflow = "";
        link.focus();
      }
      layer.addEventListener("click", shut);
      document.addEventListener("keydown", key);
      document.body.appendChild(layer);
      document.documentElement.style.overflow = "hidden";
      close.focus();
    }
    var links = document.querySelectorAll("figure a.image-reference");
    for (var i = 0; i < links.length; i++) {
      links[i].addEventListener("click", function (event) {
        var img = this.querySelector("img");
        if (!img || !img.naturalWidth) return;
        if (img.naturalWidth < 1.25 * img.getBoundingClientRect().width) return;
        event.preventDefault();
        open(img, this);
      });
    }
  }
  function init() {
    figureZoom();
    headingBreaks();
    widgetAlt();
    drawers();
    forward(".primary-toggle");
    forward(".secondary-toggle");
    outputs();
    solutionTitles();
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();

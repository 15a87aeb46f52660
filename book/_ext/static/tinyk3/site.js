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
  function init() {
    forward(".primary-toggle");
    forward(".secondary-toggle");
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();

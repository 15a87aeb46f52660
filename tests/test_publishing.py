"""Publishing: the GitHub workflows, the release version, environment.yml, the site archive,
the weekly run's report, and the one place the repository URL is written."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
import yaml

import tinyk3

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
sys.path.insert(0, str(ROOT / "tools"))
import environment_yml  # noqa: E402
import site_archive  # noqa: E402
import weekly_check  # noqa: E402


def _workflow(name):
    return yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())


def _on(wf):
    return wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on:` key as True


def _runs(wf):
    return [step["run"] for job in wf["jobs"].values() for step in job.get("steps", [])
            if "run" in step]


def _uses(wf):
    return [step["uses"] for job in wf["jobs"].values() for step in job.get("steps", [])
            if "uses" in step]


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", text, re.M))


def _ci_run_goals() -> set[str]:
    text = (ROOT / ".ci" / "run").read_text()
    case = re.search(r'case "\$goal" in(.*?)esac', text, re.S).group(1)
    return {g for line in re.findall(r"^\s*([\w|]+)\)", case, re.M) for g in line.split("|")}


# -- the workflows ------------------------------------------------------------------------------

def test_the_three_workflows_exist():
    assert [w.name for w in WORKFLOWS] == ["ci.yml", "pages.yml", "weekly.yml"]


def test_every_make_target_a_workflow_calls_exists():
    targets, goals = _make_targets(), _ci_run_goals()
    assert goals == {"test", "dist", "weekly"} and goals <= targets
    called = []
    for path in WORKFLOWS:
        for run in _runs(yaml.safe_load(path.read_text())):
            # `make X` as a command (not `apt-get install ... make python3`)
            called += [(path.name, t) for t in
                       re.findall(r"(?:^|&&|;|\|\|)\s*make\s+([\w-]+)", run, re.M)]
            called += [(path.name, f"ci:{g}") for g in re.findall(r"\.ci/run\s+([\w-]+)", run)]
    assert called, "the workflows call no make target"
    for name, target in called:
        if target.startswith("ci:"):
            assert target[3:] in goals, f"{name}: .ci/run has no goal {target[3:]!r}"
        else:
            assert target in targets, f"{name}: the Makefile has no target {target!r}"
    assert {t for _, t in called} == {"ci:test", "ci:dist", "ci:weekly"}


def test_the_makefile_knows_its_targets():
    """The regex above reads real targets: make itself agrees on the ones that matter. (Not
    `make -n test`: make runs a recipe line that calls $(MAKE) even under -n, and test's
    writes the step times.)"""
    for target in ("dist", "weekly", "wheel", "site-archive", "environment", "lint"):
        done = subprocess.run(["make", "-n", "-s", target], cwd=ROOT, capture_output=True,
                              text=True)
        assert "No rule to make target" not in done.stderr, target
    done = subprocess.run(["make", "-n", "no-such-target"], cwd=ROOT, capture_output=True,
                          text=True)
    assert "No rule to make target" in done.stderr


def test_ci_runs_make_test_on_every_push_and_keeps_the_artifacts():
    wf = _workflow("ci.yml")
    assert {"push", "pull_request"} <= set(_on(wf))
    assert ".ci/run test" in _runs(wf)
    uploads = [s["with"]["path"] for job in wf["jobs"].values() for s in job["steps"]
               if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert any("_build/screenshots" in p for p in uploads)
    assert any("benchmarks/" in p for p in uploads)


def test_pages_builds_the_release_on_main_and_deploys_with_the_official_actions():
    wf = _workflow("pages.yml")
    assert _on(wf)["push"]["branches"] == ["main"]
    assert ".ci/run dist" in _runs(wf)
    uses = _uses(wf)
    assert any(u.startswith("actions/upload-pages-artifact@") for u in uses)
    assert any(u.startswith("actions/deploy-pages@") for u in uses)
    deploy = wf["jobs"]["deploy"]
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert deploy["environment"]["name"] == "github-pages"
    upload = next(s for s in wf["jobs"]["build"]["steps"]
                  if s.get("uses", "").startswith("actions/upload-pages-artifact@"))
    assert upload["with"]["path"] == "_build/html"
    # The landing page links the book PDF on the site; the deployed site must hold it there.
    steps = wf["jobs"]["build"]["steps"]
    copy = next(i for i, s in enumerate(steps) if "tinyk3-book.pdf" in s.get("run", ""))
    assert steps[copy]["run"] == "cp dist/tinyk3-book-*.pdf _build/html/tinyk3-book.pdf"
    assert copy < steps.index(upload)
    assert "(@SITE_URL@tinyk3-book.pdf)" in (ROOT / "book" / "intro.md").read_text()


def test_weekly_runs_on_a_schedule_and_opens_or_updates_one_issue():
    wf = _workflow("weekly.yml")
    assert _on(wf)["schedule"][0]["cron"] and "workflow_dispatch" in _on(wf)
    assert ".ci/run weekly" in _runs(wf)
    assert wf["permissions"]["issues"] == "write"
    script = next(s for s in wf["jobs"]["notebooks"]["steps"]
                  if s.get("uses", "").startswith("actions/github-script@"))
    assert script["if"] == "failure()"
    body = script["with"]["script"]
    assert "_build/weekly/report.md" in body
    assert "issues.update" in body and "issues.create" in body  # one issue, updated


def test_workflows_run_in_the_debian_release_ci_is_written_for():
    for path in WORKFLOWS:
        wf = yaml.safe_load(path.read_text())
        for name, job in wf["jobs"].items():
            if any("run" in s for s in job.get("steps", [])):
                assert job.get("container") == "debian:bookworm", f"{path.name}: {name}"


# -- the version --------------------------------------------------------------------------------

def test_the_version_is_written_once_and_the_changelog_describes_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, what CI runs
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tinyk3.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", tinyk3.__version__)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## (\S+)", changelog, re.M).group(1)
    assert first == tinyk3.__version__, "CHANGELOG.md's first entry is not the current version"
    made = subprocess.run(["make", "-s", "-p", "-n", "help"], cwd=ROOT, capture_output=True,
                          text=True).stdout
    assert f"VERSION := {tinyk3.__version__}" in made


# -- environment.yml ----------------------------------------------------------------------------

def test_environment_yml_is_what_the_pins_derive():
    done = subprocess.run([sys.executable, "tools/environment_yml.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_environment_yml_check_fails_when_a_pin_moves(tmp_path):
    pins = environment_yml.pins()
    moved = [p if not p.startswith("torch==") else "torch==0.0.1" for p in pins]
    assert moved != pins
    assert environment_yml.render(moved) != (ROOT / "environment.yml").read_text()
    bad = tmp_path / "ci.txt"
    bad.write_text("numpy>=1\n")
    with pytest.raises(SystemExit, match="not a pin"):
        environment_yml.pins(bad)


# -- the repository URL -------------------------------------------------------------------------

def test_the_repository_url_is_written_in_one_place():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    url = config["repository"]["url"]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    holders = set()
    for name in tracked:
        path = ROOT / name
        if path.suffix in (".png", ".svg", ".woff", ".woff2", ".zip") or not path.is_file():
            continue
        if url in path.read_text(errors="ignore"):
            holders.add(name)
    # the notebooks' setup cells are generated from _config.yml by tools/setup_cell.py
    # (tests/test_notebooks.py checks that they agree), and the Japanese book's notebooks and
    # configuration from those by tools/translate.py (`make translations` checks they are up
    # to date); nothing else may spell it
    others = {h for h in holders
              if not re.fullmatch(r"(ja/)?notebooks/(src/)?(\d\d|A\d)_\w+\.(ipynb|py)", h)
              and h != "ja/_config.yml"}
    assert others == {"_config.yml"}, others


def test_binder_and_colab_launch_buttons_are_configured():
    launch = yaml.safe_load((ROOT / "_config.yml").read_text())["launch_buttons"]
    assert launch["binderhub_url"] == "https://mybinder.org"
    assert launch["colab_url"].startswith("https://colab.research.google.com")


def test_the_readme_says_how_a_fork_publishes_its_copy():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Publish your own copy"):]
    section = section[:section.index("\n## ")]
    for step in ("_config.yml", "repository.url", "tools/setup_cell.py", "Settings",
                 "GitHub Actions", "pages.yml", "Colab"):
        assert step in section, step
    assert len(re.findall(r"^\d\. ", section, re.M)) <= 6  # a few steps


# -- the site archive ---------------------------------------------------------------------------

def test_the_site_archive_is_reproducible_and_rooted_in_one_folder(tmp_path):
    site = tmp_path / "html"
    (site / "book").mkdir(parents=True)
    (site / "index.html").write_text("<a href='book/a.html'>a</a>")
    (site / "book" / "a.html").write_text("<p>a</p>")
    (site / ".buildinfo").write_text("sphinx")
    one, two = tmp_path / "one.zip", tmp_path / "two.zip"
    assert site_archive.build(site, one, "9.9.9") == 2
    site_archive.build(site, two, "9.9.9")
    assert one.read_bytes() == two.read_bytes()
    names = zipfile.ZipFile(one).namelist()
    assert names == ["tinyk3-site-9.9.9/README.txt", "tinyk3-site-9.9.9/book/a.html",
                     "tinyk3-site-9.9.9/index.html"]
    with pytest.raises(SystemExit, match="no index.html"):
        site_archive.build(tmp_path / "missing", tmp_path / "x.zip", "1")


# -- the weekly run -----------------------------------------------------------------------------

def test_weekly_takes_colab_versions_except_the_newest_torch_and_triton():
    reqs, constraints = weekly_check.requirements_and_constraints()
    assert reqs[-2:] == ["torch", "triton"] and "torch" not in reqs[:-2]
    names = {weekly_check._name(c) for c in constraints}
    assert not names & {"torch", "triton"}
    assert "ipywidgets==7.7.1" in constraints  # Colab's, as the Colab-image check pins it
    assert {"ipykernel", "ipywidgets", "matplotlib", "numpy"} <= set(reqs)


def test_weekly_reads_colab_s_freeze_and_says_where_colab_moved():
    text = ("numpy==2.3.1\nipywidgets==7.7.1\ntorch @ https://download.pytorch.org/x.whl\n"
            "setuptools==75.2.0\n# a comment\nTqdm==4.68.0\n")
    current = weekly_check.parse_freeze(text)
    assert current == {"numpy": "2.3.1", "ipywidgets": "7.7.1", "tqdm": "4.68.0"}
    snapshot = weekly_check.parse_freeze(weekly_check.FREEZE.read_text())
    assert snapshot["numpy"] == "2.1.3" and "setuptools" not in snapshot
    assert weekly_check.moved(current, snapshot, ["numpy", "ipywidgets", "tqdm", "torch"]) == [
        "numpy 2.1.3 -> 2.3.1", "tqdm 4.67.3 -> 4.68.0"]
    reqs, constraints = weekly_check.requirements_and_constraints(freeze_text=text)
    assert constraints == ["numpy==2.3.1", "ipywidgets==7.7.1", "tqdm==4.68.0"]
    freeze, source = weekly_check.colab_now("")  # no URL: the committed snapshot
    assert freeze == weekly_check.FREEZE.read_text() and "snapshot" in source


def test_weekly_report_names_the_notebook_the_cell_and_the_versions():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_code_cell("import torch\ntorch.zeros(2) @ torch.zeros(3)")]
    nb.cells[2].execution_count = 2
    nb.cells[2].outputs = [nbformat.v4.new_output(
        "error", ename="RuntimeError", evalue="size mismatch", traceback=[])]
    err = weekly_check.first_error(nb)
    assert err["code_cell"] == 2 and err["execution_count"] == 2
    assert err["ename"] == "RuntimeError" and "torch.zeros(2)" in err["source"]
    assert weekly_check.first_error(nbformat.v4.new_notebook()) is None
    results = [{"notebook": "01_gpt2.ipynb", "seconds": 9.0, "passed": True},
               {"notebook": "05_deltanet.ipynb", "seconds": 3.0, "passed": False, "error": err}]
    report = weekly_check.render(results, {"python": "3.13.0", "torch": "2.99.0"}, smoke=False,
                                 source="backend-info", colab_moved=["numpy 2.1.3 -> 2.3.1"])
    assert report.startswith("# Weekly notebook run: 1 of 2 notebooks failed")
    for text in ("## 05_deltanet.ipynb", "Code cell 2", "RuntimeError", "size mismatch",
                 "| torch | 2.99.0 |", "| 01_gpt2.ipynb | passed |", "full size",
                 "from backend-info", "numpy 2.1.3 -> 2.3.1"):
        assert text in report, text
    ok = weekly_check.render(results[:1], {"torch": "2.99.0"}, smoke=True)
    assert "all 1 notebooks passed" in ok and "SMOKE" in ok

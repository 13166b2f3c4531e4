"""The course as a site (`make site`, scripts/course_site.py), read as a reader reads it.

Quick tests, in `make test`: the pieces the build is made of (links into the code, the
execution cache's key, the scan over pages, `class_bundle.py --with-site`).

The reader's test needs the site built, which executes the eight lessons (minutes of
CPU, cached in build/site-cache/ afterwards): it runs under `make site-check`
(MINSERVE_SITE_CHECK=1), not in `make test`. It builds the site into a temporary folder
and opens every page from disk in headless Chromium (Debian's, no browser download, no
network): no console error and no request leaving the site, every plotly figure drawn
(a `.plotly` element with its traces), the stepper's frames shown one by one, every
internal link and anchor resolving, search answering, no line of a lab's solution or
hidden test on any page (the class bundle's scan), and screenshots of the home page and
a lesson at 1280x720 and at a phone's 390x844 (MINSERVE_SCREENSHOT_DIR, or the test's
temporary folder), with nothing wider than the phone's screen.
"""

from __future__ import annotations

import ast
import os
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import CHROMIUM, load_script

ROOT = Path(__file__).resolve().parents[1]
site_script = load_script("course_site")
bundle_script = load_script("class_bundle")
SOURCES = sorted((ROOT / "notebooks" / "labs").glob("lab*.ipynb"))
LINKS = site_script.CodeLinks()
DEFINED = sorted((k, v) for k, v in LINKS.index.items() if "." in k)  # `class.method`, `module.fn`


# ------------------------------------------------------------------ quick: the pieces
@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DEFINED), st.sampled_from(["{}", "{}()", "x.{}", "engine.{}(a, b)"]))
def test_a_named_function_links_to_the_line_that_defines_it(entry, form):
    """`Scheduler.admit_pending`, `engine.scheduler.admit_pending()`, `execute.run_remote`:
    the link goes to the code page of the file that defines it, at its `def` line."""
    key, (path, line) = entry
    owner, name = key.split(".")
    span = form.format(f"{owner}.{name}")
    md = f"See `{span}` here."
    out = LINKS.link(md, "notebooks/01_x.ipynb")
    m = re.search(r'href="\.\./([^"#]+)#L-(\d+)"><code>', out)
    assert m, out
    page, at = m.group(1), int(m.group(2))
    linked = page.removesuffix(".html")
    assert (ROOT / linked).is_file(), page
    source = (ROOT / linked).read_text(encoding="utf-8").splitlines()
    assert re.match(rf"\s*(async\s+)?def {re.escape(name)}\b", source[at - 1], re.I) \
        or re.match(rf"\s*def {re.escape(name)}\b", source[at - 1]), (span, linked, at)


def test_a_file_name_links_to_its_page_and_code_blocks_links_and_headings_stay():
    md = ("The stepper (`minserve/inspection/stepper.py`) and `minserve/scheduler.py::Scheduler`.\n"
          "```python\n`minserve/scheduler.py`\n```\n# `minserve/engine.py`\n"
          "[`minserve/engine.py`](../minserve/engine.py) `not_a_name_here_xyz` `step` "
          "`01_one_tick.ipynb` `99_no_such_lesson.ipynb`")
    out = LINKS.link(md, "docs/page.md")
    assert 'href="../minserve/inspection/stepper.py.html"><code>minserve/inspection/stepper.py' in out
    sched = ast.parse((ROOT / "minserve/scheduler.py").read_text())
    line = next(n.lineno for n in sched.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    assert f'href="../minserve/scheduler.py.html#L-{line}"' in out
    lines = out.split("\n")
    assert lines[2] == "`minserve/scheduler.py`" and lines[4] == "# `minserve/engine.py`"
    assert "[`minserve/engine.py`](../minserve/engine.py)" in out  # already a link
    assert "`not_a_name_here_xyz`" in out and "`step`" in out  # unknown, or not one place
    assert 'href="../notebooks/01_one_tick.html"><code>01_one_tick.ipynb' in out
    assert "`99_no_such_lesson.ipynb`" in out


def test_the_execution_cache_key_follows_the_notebook_and_the_package(tmp_path, monkeypatch):
    pkg = tmp_path / "minserve"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "notes.txt").write_text("not code\n")
    nb = tmp_path / "01_x.ipynb"
    nb.write_text("{}")
    monkeypatch.setattr(site_script, "PACKAGE", pkg)
    monkeypatch.setattr(site_script, "ROOT", tmp_path)
    first = site_script.cache_key(nb)
    assert site_script.cache_key(nb) == first
    (pkg / "notes.txt").write_text("changed, and not code\n")
    assert site_script.cache_key(nb) == first
    (pkg / "a.py").write_text("x = 2\n")
    second = site_script.cache_key(nb)
    assert second != first
    nb.write_text('{"cells": []}')
    assert site_script.cache_key(nb) != second


def _highlighted(line: str) -> str:
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    return highlight(line, PythonLexer(), HtmlFormatter())


def test_the_scan_reads_a_page_as_a_reader_does(tmp_path):
    """A solution line highlighted token by token (`<span class="n">req</span>...`) is
    found in the page's text; the site's page of an engine module may hold what the engine
    holds (the open reference the labs rewrite), a lesson's page may not."""
    forbidden = bundle_script.forbidden_strings(SOURCES)
    key = "return (-req.priority, req.arrival_seq)"
    assert key in forbidden and key in (ROOT / "minserve" / "policies.py").read_text()
    site = tmp_path / "site"
    (site / "notebooks").mkdir(parents=True)
    (site / "minserve").mkdir()
    page = f"<html><body><div class='highlight'>{_highlighted(key)}</div></body></html>"
    assert key not in page  # only the page's text holds it whole
    (site / "minserve" / "policies.py.html").write_text(page)
    assert bundle_script.leaks(site, forbidden) == []
    (site / "notebooks" / "01_one_tick.html").write_text(page)
    found = bundle_script.leaks(site, forbidden)
    assert found and all(f.startswith("notebooks/01_one_tick.html") for f in found), found
    hidden = next(s for s, why in forbidden.items() if "check_against_the_engine(FCFSLab, lab_hidden)" in s)
    (site / "notebooks" / "01_one_tick.html").unlink()
    (site / "minserve" / "labs").mkdir()
    (site / "minserve" / "labs" / "fcfs.py.html").write_text(_highlighted(hidden))
    found = bundle_script.leaks(site, forbidden)  # not an engine page: the rule holds there
    assert found and all(f.startswith("minserve/labs/fcfs.py.html") for f in found), found


def test_the_site_scan_looks_for_the_instructors_secret_too(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<p>inputs drawn from <b>s3cret-of-the-term</b></p>")
    monkeypatch.delenv("MINSERVE_LAB_SECRET", raising=False)
    assert site_script.scan(site) == []
    monkeypatch.setenv("MINSERVE_LAB_SECRET", "s3cret-of-the-term")
    assert any("instructor's secret" in f for f in site_script.scan(site))


def test_class_bundle_with_site_scans_the_site_it_carries(tmp_path):
    """`make class-bundle ARGS=--with-site`: the site goes into the bundle's site/ and the
    bundle's scan covers it: a site holding a hidden test's line is not handed out."""
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^class-bundle:.*\n\t.*scripts/class_bundle.py \$\(ARGS\)", make, re.M)
    forbidden = bundle_script.forbidden_strings(SOURCES)
    hidden = next(s for s, why in forbidden.items() if "check_against_the_engine(FCFSLab, lab_hidden)" in s)
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text(f"<html><body><pre>{_highlighted(hidden)}</pre></body></html>")
    with pytest.raises(SystemExit) as refused:
        bundle_script.build(tmp_path / "dist", make_zip=False, site=site)
    assert "site/index.html" in str(refused.value), refused.value
    assert not (tmp_path / "dist").exists()


# ------------------------------------------------------------------ the reader's test
CHECK = os.environ.get("MINSERVE_SITE_CHECK") == "1"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-default-apps",
                 "--disable-extensions", "--no-first-run", "--host-resolver-rules=MAP * ~NOTFOUND"]
reader = pytest.mark.skipif(not CHECK, reason="the reader's test of the site runs under "
                                              "`make site-check` (it executes the lessons)")
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(),
                                    reason=f"needs Debian's chromium at {CHROMIUM}: "
                                           "`sudo apt-get install -y chromium`")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built into a temporary folder (MINSERVE_SITE_BUILT=folder: check that one,
    already built, instead)."""
    if os.environ.get("MINSERVE_SITE_BUILT"):
        return Path(os.environ["MINSERVE_SITE_BUILT"])
    out = tmp_path_factory.mktemp("site") / "site"
    times = site_script.build(out)
    print("site built:", {k: round(v) for k, v in times.items()},
          f"{site_script.size_mb(out):.1f} MB")
    return out


def pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if "_static" not in p.parts)


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.hrefs, self.srcs = set(), [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(a[key])
        if tag == "a" and a.get("href"):
            self.hrefs.append(a["href"])
        for key in ("src", "href"):
            if tag in ("script", "link", "img", "iframe") and a.get(key):
                self.srcs.append(a[key])


def refs(page: Path) -> _Refs:
    r = _Refs()
    r.feed(page.read_text(encoding="utf-8"))
    return r


@reader
def test_the_site_has_the_course_the_lessons_the_labs_the_docs_and_the_code(site):
    names = {p.relative_to(site).as_posix() for p in pages(site)}
    lessons = [p.stem for p in site_script.lessons()]
    assert {"index.html", "search.html", "notebooks/README.html", "minserve/index.html"} <= names
    assert {f"notebooks/{n}.html" for n in lessons} <= names
    assert {f"notebooks/labs/{s.stem}.html" for s in SOURCES} <= names
    assert {f"docs/{p.stem}.html" for p in (ROOT / "docs").glob("*.md")} <= names
    assert "minserve/scheduler.py.html" in names and "minserve/labs/fcfs.py.html" not in names
    home = (site / "index.html").read_text(encoding="utf-8")
    for n in lessons:  # the path: lesson -> what it shows -> its lab
        assert f'href="notebooks/{n}.html"' in home, n
    for s in SOURCES[:6]:
        assert f'href="notebooks/labs/{s.stem}.html"' in home, s.stem
    lab = (site / "notebooks" / "labs" / "lab1_fcfs.html").read_text(encoding="utf-8")
    assert "How it is graded" in lab and "NotImplementedError" in lab and "hidden" in lab
    for n in lessons:
        assert "Run it yourself" in (site / "notebooks" / f"{n}.html").read_text(encoding="utf-8")


@reader
def test_no_page_holds_a_line_of_a_solution_or_a_hidden_test(site):
    forbidden = bundle_script.forbidden_strings(SOURCES)
    assert len(forbidden) > 20
    assert bundle_script.leaks(site, forbidden) == []


@reader
def test_the_class_bundle_carries_the_site_and_passes_its_scan(site, tmp_path):
    """`make class-bundle ARGS=--with-site`: the bundle's site/ is the site, scanned with
    the rest of the bundle, and its README says how to open it."""
    dest = bundle_script.build(tmp_path / "dist", make_zip=False, site=site)
    assert (dest / "site" / "index.html").is_file()
    assert sorted(p.relative_to(dest / "site") for p in (dest / "site").rglob("*.html")) == \
        sorted(p.relative_to(site) for p in site.rglob("*.html"))
    assert "site/index.html" in (dest / "README.md").read_text(encoding="utf-8")


@reader
def test_every_internal_link_and_anchor_resolves_and_nothing_is_fetched_from_outside(site):
    bad, ids = [], {}
    for page in pages(site):
        r = refs(page)
        ids[page.resolve()] = r.ids
        for src in r.srcs:
            if re.match(r"(https?:)?//", src):
                bad.append(f"{page.relative_to(site)}: loads {src}")
    for page in pages(site):
        for href in refs(page).hrefs:
            if re.match(r"[a-z]+:", href):
                continue  # an external link a reader may follow (not loaded by the page)
            parts = urlsplit(href)
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page.resolve()
            if not target.exists():
                bad.append(f"{page.relative_to(site)}: {href}: no such file")
            elif parts.fragment and target.suffix == ".html" \
                    and unquote(parts.fragment) not in ids.get(target, set()):
                bad.append(f"{page.relative_to(site)}: {href}: no #{parts.fragment}")
    assert not bad, "\n".join(bad[:30])


@reader
def test_lessons_link_the_code_they_show_at_its_line(site):
    """Lesson 08 prints `execute.run_remote` with inspect.getsource: the page links the
    line that defines it; the code page's line holds the `def`."""
    page = site / "notebooks" / "08_disaggregated_prefill.html"
    hrefs = [h for h in refs(page).hrefs if "minserve/execute.py.html#L-" in h]
    assert hrefs, "no link to execute.py"
    code = (page.parent / hrefs[0].split("#")[0]).resolve()
    line = hrefs[0].split("#L-")[1]
    text = code.read_text(encoding="utf-8")
    m = re.search(rf'<span id="L-{line}">(.*?)<span id="L-{int(line) + 1}">', text, re.S)
    assert m and "def run_remote(" in re.sub(r"<[^>]+>", "", m.group(1)), line
    one = (site / "notebooks" / "01_one_tick.html").read_text(encoding="utf-8")
    assert 'href="../minserve/inspection/stepper.py.html' in one


def open_page(browser, url: str, viewport=(1280, 720)):
    page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: problems.append(f"request out: {r.url}")
            if not r.url.startswith(("file:", "data:", "blob:", "about:")) else None)
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url} {r.failure}"))
    page.goto(url, wait_until="load")
    return page, problems


DRAWN = """() => Array.from(document.querySelectorAll('.plotly-graph-div, .sf-fig')).map(el => ({
    id: el.id || el.dataset.name, frame: el.classList.contains('sf-fig'),
    plotly: !!el.querySelector('.plotly .main-svg'), traces: (el.data || []).length,
    drawn: (el._fullData || []).length,
    says: (el.querySelector('.gtitle') || {}).textContent || ''}))"""


def drawn(fig: dict) -> bool:
    """Drawn by plotly with its traces; a stepper's figure before the first tick is the
    stepper's placeholder, no trace and a sentence saying why (as in JupyterLab)."""
    if not fig["plotly"]:
        return False
    return bool(fig["traces"] and fig["drawn"]) or (fig["frame"] and re.search(
        r"no tick has run yet|is empty", fig["says"]) is not None)


@reader
@needs_chromium
def test_every_page_opens_without_errors_and_draws_every_figure(site, browser):
    bad, figures = [], 0
    for path in pages(site):
        page, problems = open_page(browser, path.as_uri())
        try:
            if "plotly-graph-div" in path.read_text(encoding="utf-8"):
                page.wait_for_function("() => Array.from(document.querySelectorAll("
                                       "'.plotly-graph-div')).every(el => el._fullData)",
                                       timeout=30_000)
            for fig in page.evaluate(DRAWN):
                figures += 1
                if not drawn(fig):
                    bad.append(f"{path.relative_to(site)}: figure {fig} not drawn")
        finally:
            page.close()
        bad += [f"{path.relative_to(site)}: {p}" for p in problems]
    assert figures >= 25, figures
    assert not bad, "\n".join(bad[:30])


@reader
@needs_chromium
def test_the_steppers_frames_go_forward_and_each_draws_its_figures(site, browser):
    for name in ("01_one_tick", "08_disaggregated_prefill"):
        page, problems = open_page(browser, (site / "notebooks" / f"{name}.html").as_uri())
        box = page.locator(".stepper-frames").first
        count = box.locator(".sf-count").inner_text()
        total = int(re.search(r"of (\d+)", count).group(1))
        assert total >= 6, count
        clicks = []
        for i in range(total):
            figs = page.evaluate(DRAWN)
            assert figs and all(drawn(f) for f in figs), (name, i, figs)
            clicks.append(box.locator(".sf-click").inner_text())
            if i < total - 1:
                box.locator(".sf-next").click()
        assert box.locator(".sf-next").is_disabled()
        assert any("T1 admit" in c for c in clicks) and any("T4 decode" in c for c in clicks)
        assert "make notebooks" in box.locator(".sf-note").inner_text()
        page.close()
        assert not problems, problems


@reader
@needs_chromium
def test_search_finds_a_lesson(site, browser):
    page, problems = open_page(browser, (site / "search.html").as_uri() + "?q=prefix+caching")
    page.wait_for_selector("#search-results li a, ul.search li a", timeout=30_000)
    found = page.eval_on_selector_all("#search-results li a, ul.search li a",
                                      "els => els.map(e => e.getAttribute('href'))")
    page.close()
    assert any("03_kv_blocks_and_prefix_caching" in h for h in found), found
    assert not problems, problems


@reader
@needs_chromium
def test_screenshots_of_the_home_page_and_a_lesson_fit_a_laptop_and_a_phone(site, browser,
                                                                            tmp_path):
    out = Path(os.environ.get("MINSERVE_SCREENSHOT_DIR") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    for name, rel in (("home", "index.html"), ("lesson", "notebooks/04_policies_fcfs_vs_vtc.html")):
        for label, size in (("1280x720", (1280, 720)), ("phone", (390, 844))):
            page, problems = open_page(browser, (site / rel).as_uri(), viewport=size)
            page.wait_for_timeout(500)
            if name == "lesson":  # scroll to the first figure: the screenshot shows one
                page.locator(".plotly-graph-div").first.scroll_into_view_if_needed()
                page.wait_for_timeout(300)
            wide = page.evaluate("document.documentElement.scrollWidth")
            page.screenshot(path=str(out / f"site_{name}_{label}.png"))
            page.close()
            assert not problems, problems
            assert wide <= size[0] + 1, f"{rel} at {label}: the page is {wide} px wide"
    print("screenshots in", out)

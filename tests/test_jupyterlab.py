"""`make notebooks`: JupyterLab starts on loopback, offline, and serves the lessons with
the widget extensions the stepper needs (ipywidgets' manager, anywidget for plotly's
FigureWidget); and a lesson as a student meets it there, in headless Chromium.

`make notebooks` serves the repository but opens the student's copies of the lessons in
work/ (git-ignored, made by scripts/work_copy.py): running a notebook in JupyterLab saves
it, and that must never rewrite a tracked file. Here JupyterLab serves a temporary folder
laid out the same way: docs/img (the lessons' static pictures) and work/, made by the same
copy step; the browser test checks that a save lands in work/. The browser is Debian's chromium driven by playwright (no browser
download), as in tests/test_app_browser.py. The stepper's screenshot goes to a
temporary folder; `make screenshots` (MINSERVE_SCREENSHOT_DIR=docs/img) refreshes the
docs' copy, docs/img/stepper.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import CHROMIUM, CHROMIUM_ARGS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from work_copy import copy_lessons, reset  # noqa: E402

TOKEN = "minserve-test"
# JupyterLab's output area with the file browser open in a 1400 px window is ~968 px
WINDOW = {"width": 1400, "height": 900}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab started as `make notebooks` does, on the lessons' work copies and their
    pictures: its URL and the served folder."""
    copy = tmp_path_factory.mktemp("lab")
    copy_lessons(ROOT / "notebooks", copy / "work")  # `make notebooks`' copy step
    shutil.copytree(ROOT / "docs" / "img", copy / "docs" / "img")
    # JupyterLab 4 keeps only the cells in view in the page (windowing); draw them all,
    # so every figure can be measured, and fetch no news (offline)
    settings = tmp_path_factory.mktemp("lab-settings")
    for ext, name, value in (("notebook-extension", "tracker", {"windowingMode": "none"}),
                             ("apputils-extension", "notification", {"fetchNews": "false"})):
        (settings / "@jupyterlab" / ext).mkdir(parents=True, exist_ok=True)
        (settings / "@jupyterlab" / ext / f"{name}.jupyterlab-settings").write_text(
            json.dumps(value))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the same command as `make notebooks`, with a token we know and a free port
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", f"--ServerApp.root_dir={copy}",
           "--LabApp.default_url=/lab/tree/work/README.md",
           f"--LabApp.user_settings_dir={settings}",  # and no workspace (open tabs) of
           f"--LabApp.workspaces_dir={settings}",     # the user's own JupyterLab
           f"--IdentityProvider.token={TOKEN}"]
    if os.geteuid() == 0:  # as `make notebooks` does on a root shell (containers, CI)
        cmd.append("--allow-root")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, up = time.monotonic() + 90, False
        while time.monotonic() < deadline and not up:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            try:
                up = httpx.get(f"{url}/api/contents", params={"token": TOKEN},
                               timeout=2).status_code == 200
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert up, "JupyterLab did not come up"
        yield url, copy
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        finally:
            proc.kill()


def test_make_notebooks_serves_work_copies_made_once_and_reset_keeps_the_old_ones(tmp_path):
    """`make notebooks` copies the lessons into the git-ignored work/ and opens them there;
    a second run keeps what the student changed; `make notebooks-reset` copies afresh and
    moves the old copy aside."""
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^notebooks:.*\n((?:\t.*\n)+)", make, re.M).group(1)
    assert "scripts/work_copy.py" in recipe and "default_url=/lab/tree/work/" in recipe, recipe
    assert "work_copy.py --reset" in re.search(r"^notebooks-reset:.*\n\t(.*)", make, re.M).group(1)
    assert re.search(r"^/work/$", (ROOT / ".gitignore").read_text(), re.M)
    work = tmp_path / "work"
    copied = copy_lessons(ROOT / "notebooks", work)
    lessons = sorted(p.relative_to(ROOT / "notebooks") for p in (ROOT / "notebooks").glob("*.ipynb"))
    labs = [Path("labs") / p.stem / p.name for p in (ROOT / "notebooks" / "labs").glob("*.ipynb")]
    assert lessons and {p.relative_to(work) for p in copied} >= set(lessons) | set(labs) | {
        Path("README.md")}  # the labs as their student versions: tests/test_student_copies.py
    assert not (work / "conftest.py").exists()
    edited = work / lessons[0]
    edited.write_text("a student's edit")
    assert copy_lessons(ROOT / "notebooks", work) == [] and edited.read_text() == "a student's edit"
    old = reset(ROOT / "notebooks", work)
    assert (old / lessons[0]).read_text() == "a student's edit"
    assert (work / lessons[0]).read_bytes() == (ROOT / "notebooks" / lessons[0]).read_bytes()


def test_jupyterlab_starts_on_the_notebooks_and_lists_them_with_widgets_installed(lab):
    lab, _ = lab
    listing = httpx.get(f"{lab}/api/contents/work", params={"token": TOKEN}, timeout=10).json()
    names = {item["name"] for item in listing["content"]}
    lessons = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert lessons and lessons | {"README.md"} <= names
    picture = httpx.get(f"{lab}/files/docs/img/tick_timeline.png", params={"token": TOKEN},
                        timeout=10)  # what a notebook's ../docs/img/... link asks for
    assert picture.status_code == 200 and picture.content[:4] == b"\x89PNG"
    assert httpx.get(f"{lab}/lab", params={"token": TOKEN}, timeout=10).status_code == 200
    ext = httpx.get(f"{lab}/lab/api/extensions", params={"token": TOKEN}, timeout=10)
    installed = {e["name"] for e in ext.json()}
    # the extension API names packages with the scope folded in: @a/b -> a-b
    assert {"jupyter-widgets-jupyterlab-manager", "anywidget"} <= installed, installed
    kernels = httpx.get(f"{lab}/api/kernelspecs", params={"token": TOKEN}, timeout=10).json()
    assert "python3" in kernels["kernelspecs"]


# --- a lesson in the browser -------------------------------------------------------------------
FIGURE_WIDTHS = """() => [...document.querySelectorAll('.jp-OutputArea .js-plotly-plot')].map(e => {
    const svg = e.querySelector('.main-svg'), out = e.closest('.jp-OutputArea-output');
    const title = e.querySelector('.gtitle');
    return {svg: svg ? svg.getBoundingClientRect().width : 0,
            area: out.getBoundingClientRect().width,
            right: svg ? svg.getBoundingClientRect().right : 0,
            areaRight: out.getBoundingClientRect().right,
            title: title ? title.textContent : ''};
})"""


def _dismiss_dialogs(page) -> None:
    """A slow machine's JupyterLab may ask "Select Kernel" (the kernel was not up when the
    notebook opened) and its dialog then intercepts every click: take the kernel it
    proposes (the notebook's own, python3). News toasts are closed too."""
    dialog = page.locator(".jp-Dialog")
    if dialog.count() and dialog.first.is_visible():
        accept = dialog.locator(".jp-Dialog-footer .jp-mod-accept")
        (accept if accept.count() else dialog.locator("button").last).first.click()
        dialog.first.wait_for(state="detached", timeout=30_000)
    news = page.locator(".jp-Notification-Toast-Close, .Toastify__close-button")
    if news.count():  # "Would you like to get notified about official Jupyter news?"
        news.first.click()


def _wait_for_idle_kernel(page, timeout_s: float = 120) -> None:
    """Until the kernel reports idle, answering a "Select Kernel" dialog if one comes."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    deadline = time.monotonic() + timeout_s
    while True:
        _dismiss_dialogs(page)
        try:
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                                   timeout=2_000)
            return
        except PlaywrightTimeout:
            assert time.monotonic() < deadline, "the kernel never became idle"


def _run_all_cells(page, timeout_s: float = 240) -> None:
    """Run > Run All Cells; return when no cell is queued or running any more."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    started = ("() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
               ".some(e => e.textContent.includes('*'))")
    for _ in range(6):  # until the kernel is ready the command may do nothing: try again
        _dismiss_dialogs(page)
        page.locator(".jp-NotebookPanel:visible .jp-Cell").first.click()  # focus the notebook
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(started, timeout=10_000)
            break
        except PlaywrightTimeout:
            continue
    # Run All queues every cell at once ([*]); when none shows [*], all have run
    try:
        page.wait_for_function(f"!({started})()", timeout=timeout_s * 1000, polling=500)
    except PlaywrightTimeout:
        raise AssertionError("the notebook did not finish running") from None
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    tracebacks = [t for t in errors.all_inner_texts() if "Error" in t]
    assert not tracebacks, tracebacks[:1]


@pytest.mark.real_model
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium: "
                    "`sudo apt-get install -y chromium` (no browser download)")
def test_lesson_01_in_jupyterlab_the_stepper_answers_its_first_click_and_every_figure_fits(
        lab, tmp_path):
    """Open 01 as a student does (file browser open, 1400 px window), run it all, then
    use the stepper: its first click does something, it shows the requests' text, and
    no figure is wider than the output area. The browser console has no anywidget error.
    Saving the run notebook writes the work copy (work/), not the tracked one."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    lab, served = lab
    saved = served / "work" / "01_one_tick.ipynb"
    before = saved.read_bytes()

    img = Path(os.environ.get("MINSERVE_SCREENSHOT_DIR") or tmp_path)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=WINDOW)
        console: list[str] = []
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        page.goto(f"{lab}/lab/tree/work/01_one_tick.ipynb?reset&token={TOKEN}")
        page.wait_for_selector(".jp-NotebookPanel:visible .jp-Cell", timeout=90_000)
        _wait_for_idle_kernel(page)
        assert page.locator(".jp-DirListing").first.is_visible(), "the file browser is open"
        _run_all_cells(page)

        stepper = page.locator(".widget-vbox", has=page.locator(".widget-button",
                                                                has_text="next phase")).last
        stepper.scroll_into_view_if_needed()
        status = stepper.locator("pre").first
        table = stepper.locator("table").first
        page.wait_for_function("document.querySelectorAll('.widget-vbox table tr').length >= 4")
        assert "waiting in pending for T1 admit: req-0, req-1, req-2" in status.inner_text()
        assert "nothing waiting" not in status.inner_text()

        stepper.locator(".widget-button", has_text="next phase").click()  # the first click
        page.wait_for_function("[...document.querySelectorAll('.widget-vbox pre')]"
                               ".some(e => e.textContent.includes('admitted req-0'))")
        assert "tick 1 so far" in status.inner_text()
        stepper.locator(".widget-button", has_text="next tick").click()
        page.wait_for_function("[...document.querySelectorAll('.widget-vbox pre')]"
                               ".some(e => e.textContent.includes('tick 1\\n'))")
        # the table is a separate widget: on a busy machine it redraws a moment later
        page.wait_for_function("[...document.querySelectorAll('.widget-vbox table tr')].some("
                               "r => r.textContent.includes('alice') && "
                               "r.textContent.includes('active'))", timeout=30_000)
        rows = table.locator("tr").all_inner_texts()
        assert len(rows) == 4 and "alice" in rows[1] and "active" in rows[1], rows
        answer = table.locator("tr").nth(1).locator("td").last.inner_text()
        assert re.sub(r"\(\d+/\d+\)", "", answer).strip() not in ("", "-"), rows  # alice's text
        # the timeline is drawn right under the buttons, not a screen further down
        timeline = stepper.locator(".js-plotly-plot").first
        gap = timeline.bounding_box()["y"] - stepper.bounding_box()["y"]
        assert gap < 450, f"the timeline starts {gap:.0f} px below the buttons"
        img.mkdir(parents=True, exist_ok=True)
        page.set_viewport_size({"width": WINDOW["width"], "height": 1800})  # all of it
        stepper.scroll_into_view_if_needed()
        stepper.screenshot(path=str(img / "stepper.png"))
        page.set_viewport_size(WINDOW)

        page.wait_for_function("document.querySelectorAll('.jp-OutputArea .js-plotly-plot "
                               ".main-svg').length >= 6")
        figures = page.evaluate(FIGURE_WIDTHS)
        assert len(figures) >= 6, figures  # three lesson figures, the stepper's three
        for f in figures:
            assert f["svg"] <= f["area"] + 1 and f["right"] <= f["areaRight"] + 1, f
        stepper.locator(".widget-button", has_text="add request").click()
        page.wait_for_function("document.querySelectorAll('.widget-vbox table tr').length >= 5")
        assert "req-3" in table.inner_text()
        # a fresh engine: the batch figure empties in place, and the padded batch's two
        # subplot titles go with it (they once stayed, over the empty figure's title)
        stepper.locator(".widget-button", has_text="reset").click()
        page.wait_for_function("[...document.querySelectorAll('.widget-vbox .gtitle')]"
                               ".some(e => e.textContent.includes('batch is empty'))")
        try:  # the resets reach the browser with the new layout: wait for the state
            page.wait_for_function("![...document.querySelectorAll('.widget-vbox "
                                   ".annotation-text')].some(e => e.textContent.includes("
                                   "'attention_mask'))", timeout=15_000)
        except PlaywrightTimeout:
            raise AssertionError("the empty batch figure still shows the subplot titles") from None
        page.set_viewport_size({"width": WINDOW["width"], "height": 1800})
        stepper.locator(".js-plotly-plot").last.screenshot(path=str(img / "stepper_empty.png"))
        page.set_viewport_size(WINDOW)
        # what autosave would do two minutes later, now: File > Save
        _dismiss_dialogs(page)
        page.keyboard.press("Control+s")
        deadline = time.monotonic() + 30
        while saved.read_bytes() == before and time.monotonic() < deadline:
            page.wait_for_timeout(200)
        assert saved.read_bytes() != before, "File > Save did not write work/01_one_tick.ipynb"
        browser.close()
    # 404: a picture that is not there ("... responded with a status of 404 (Not Found)");
    # a number on its own, not the digits inside a kernel's id or a port
    bad = [line for line in console if "anywidget" in line.lower() and "fail" in line.lower()
           or line.startswith("pageerror") or re.search(r"\b404\b", line)]
    assert not bad, bad


def test_a_missing_browser_is_reported_loudly_at_the_end_of_the_run():
    """Without /usr/bin/chromium the browser tests skip, and the run's last lines say so
    (with the command that fixes it), instead of one more `s` among hundreds of dots."""
    from tests.conftest import pytest_terminal_summary

    class Report:
        longrepr = ("tests/test_app_browser.py", 1, "Skipped: needs Debian's chromium ...")

    class Reporter:
        stats = {"skipped": [Report(), Report()]}
        lines: list[str] = []

        def write_sep(self, sep, title, **kw):
            self.lines.append(title)

        def write_line(self, line, **kw):
            self.lines.append(line)

    reporter = Reporter()
    pytest_terminal_summary(reporter)
    assert "2 BROWSER TEST(S) SKIPPED" in reporter.lines[0]
    assert "sudo apt-get install -y chromium" in reporter.lines[1]
    reporter.stats, reporter.lines = {"skipped": []}, []
    pytest_terminal_summary(reporter)
    assert reporter.lines == []

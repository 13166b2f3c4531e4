"""`make notebooks`: JupyterLab starts on loopback, offline, and serves the lessons with
the widget extensions the stepper needs (ipywidgets' manager, anywidget for plotly's
FigureWidget); and a lesson as a student meets it there, in headless Chromium.

JupyterLab serves a temporary copy of the repository's notebooks/ and docs/img (the
notebooks' static pictures link to it), laid out as in the repository, whose root
`make notebooks` serves: running a notebook in JupyterLab saves it, and tests never
write tracked files. The browser is Debian's chromium driven by playwright (no browser
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

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
TOKEN = "minserve-test"
# JupyterLab's output area with the file browser open in a 1400 px window is ~968 px
WINDOW = {"width": 1400, "height": 900}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab started as `make notebooks` does, on a copy of the lessons and their
    pictures: its URL."""
    copy = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", copy / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
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
           "--LabApp.default_url=/lab/tree/notebooks/README.md",
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
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        finally:
            proc.kill()


def test_jupyterlab_starts_on_the_notebooks_and_lists_them_with_widgets_installed(lab):
    listing = httpx.get(f"{lab}/api/contents/notebooks", params={"token": TOKEN}, timeout=10).json()
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


def _run_all_cells(page, timeout_s: float = 240) -> None:
    """Run > Run All Cells; return when no cell is queued or running any more."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    started = ("() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
               ".some(e => e.textContent.includes('*'))")
    for _ in range(6):  # until the kernel is ready the command may do nothing: try again
        page.locator(".jp-NotebookPanel:visible .jp-Cell").first.click()  # focus the notebook
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(started, timeout=10_000)
            break
        except PlaywrightTimeout:
            continue
    deadline = time.monotonic() + timeout_s
    # Run All queues every cell at once ([*]); when none shows [*], all have run
    busy = started
    while page.evaluate(busy):
        assert time.monotonic() < deadline, "the notebook did not finish running"
        page.wait_for_timeout(500)
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
    no figure is wider than the output area. The browser console has no anywidget error."""
    from playwright.sync_api import sync_playwright

    img = Path(os.environ.get("MINSERVE_SCREENSHOT_DIR") or tmp_path)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=WINDOW)
        console: list[str] = []
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        page.goto(f"{lab}/lab/tree/notebooks/01_one_tick.ipynb?reset&token={TOKEN}")
        page.wait_for_selector(".jp-NotebookPanel:visible .jp-Cell", timeout=90_000)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                               timeout=90_000)
        assert page.locator(".jp-DirListing").first.is_visible(), "the file browser is open"
        news = page.locator(".jp-Notification-Toast-Close, .Toastify__close-button")
        if news.count():  # "Would you like to get notified about official Jupyter news?"
            news.first.click()
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

        page.wait_for_timeout(500)
        figures = page.evaluate(FIGURE_WIDTHS)
        assert len(figures) >= 6, figures  # three lesson figures, the stepper's three
        for f in figures:
            assert f["svg"] <= f["area"] + 1 and f["right"] <= f["areaRight"] + 1, f
        stepper.locator(".widget-button", has_text="add request").click()
        page.wait_for_function("document.querySelectorAll('.widget-vbox table tr').length >= 5")
        assert "req-3" in table.inner_text()
        browser.close()
    bad = [line for line in console if "anywidget" in line.lower() and "fail" in line.lower()
           or line.startswith("pageerror") or "404" in line]  # 404: a picture that is not there
    assert not bad, bad

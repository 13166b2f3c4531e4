"""`make notebooks`: JupyterLab starts on loopback, offline, and serves the lessons with
the widget extensions the stepper needs (ipywidgets' manager, anywidget for plotly's
FigureWidget)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def test_jupyterlab_starts_on_the_notebooks_and_lists_them_with_widgets_installed():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "minserve-test"
    # the same command as `make notebooks`, with a token we know and a free port
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", f"--ServerApp.root_dir={ROOT / 'notebooks'}",
           f"--IdentityProvider.token={token}"]
    if os.geteuid() == 0:  # as `make notebooks` does on a root shell (containers, CI)
        cmd.append("--allow-root")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, listing = time.monotonic() + 90, None
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            try:
                r = httpx.get(f"{url}/api/contents", params={"token": token}, timeout=2)
                if r.status_code == 200:
                    listing = r.json()
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert listing is not None, "JupyterLab did not come up"
        names = {item["name"] for item in listing["content"]}
        lessons = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
        assert lessons and lessons <= names
        assert httpx.get(f"{url}/lab", params={"token": token}, timeout=10).status_code == 200
        ext = httpx.get(f"{url}/lab/api/extensions", params={"token": token}, timeout=10)
        installed = {e["name"] for e in ext.json()}
        # the extension API names packages with the scope folded in: @a/b -> a-b
        assert {"jupyter-widgets-jupyterlab-manager", "anywidget"} <= installed, installed
        kernels = httpx.get(f"{url}/api/kernelspecs", params={"token": token}, timeout=10).json()
        assert "python3" in kernels["kernelspecs"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        finally:
            proc.kill()

"""Waiting for a server started as a subprocess to answer: `/health` returning 200.

What every harness that starts `minserve serve` does before sending it anything: the
bench's servers (shares.py) and the scripts that drive one from outside
(scripts/disagg_scenarios.py, scripts/teacher_server_attacks.py). A server that exits
first, or does not answer in time, raises RuntimeError saying which.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, name: str = "minserve serve",
                 said: Callable[[], str] = lambda: "", poll_s: float = 0.2,
                 probe_s: float = 2.0) -> None:
    """Return once `url + "/health"` answers 200. `said()`: what to quote if `proc` exits
    first (its last lines, or where its log is)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {said()}")
        try:
            if httpx.get(url + "/health", timeout=probe_s).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not come up")
        time.sleep(poll_s)

"""What `scripts/course_site.py` asks a lesson's kernel, between two of its cells.

A static page has no kernel: what needs one is asked while the lesson runs for the site,
in the same kernel, right after the cell that needs it, and comes back as JSON (one
`application/json` display):

    stepper_frames(model_id)   the stepper a cell displayed (found by its widget's model
                               id), clicked a few times as a student would: one frame per
                               click (what was clicked, the status text, the requests'
                               table, the figures as plotly JSON)
    source_lines(names)        where the engine code a cell prints with
                               `inspect.getsource(...)` lives: file (relative to the
                               repository) and first and last line

Nothing here is imported by minserve; the build puts this folder on the kernel's
`sys.path` for these two calls only.
"""

from __future__ import annotations

import gc
import inspect
import json
from pathlib import Path

import plotly.io as pio
from IPython.display import display

from minserve.inspection.panel import requests_html
from minserve.inspection.stepper import Stepper

FRAMES_MIME = "application/json"


def _emit(payload) -> None:
    display({FRAMES_MIME: payload}, raw=True)


def _displayed(model_id: str) -> Stepper:
    """The Stepper whose panel is the widget a cell displayed (its box's model id)."""
    for obj in gc.get_objects():
        if isinstance(obj, Stepper) and obj._panel is not None \
                and obj._panel.box.model_id == model_id:
            return obj
    raise LookupError(f"no displayed Stepper has widget {model_id}")


def _frame(stepper: Stepper, click: str) -> dict:
    figures = []  # [name, figure] pairs: in the widget's order (a notebook's JSON sorts keys)
    for name, fig in stepper.figures().items():
        fig.update_layout(width=None, autosize=True)  # a page's width, not the widget's
        figures.append([name, json.loads(pio.to_json(fig))])
    return {"click": click, "status": stepper.status(),
            "requests": requests_html(stepper.requests(), stepper.tokenizer is not None),
            "figures": figures}


def stepper_frames(model_id: str, ticks_after: int = 2, run_n: int = 5) -> None:
    """Click the displayed stepper as the lesson's text invites, one frame per click: as
    shown; (two `add request`s when nothing is queued); the four phases of one tick one
    `next phase` at a time; `next tick` `ticks_after` times; `run N ticks` with N=run_n.
    The stepper is clicked itself (the build refuses a lesson that uses it in a later
    cell), so a frame is exactly what the same click shows in JupyterLab."""
    st = _displayed(model_id)
    frames = [_frame(st, "as the cell shows it")]
    if not st.engine.scheduler.has_work():
        for session in ("alice", "bob"):
            st.add_request(session=session)
        frames.append(_frame(st, "add request (twice: alice, then bob)"))
    for _ in range(4):
        st.next_phase()
        frames.append(_frame(st, f"next phase: {st.last_phase}"))
    for _ in range(ticks_after):
        st.next_tick()
        frames.append(_frame(st, f"next tick: {st.last_phase}"))
    st.run(run_n)
    frames.append(_frame(st, f"run N ticks (N={run_n})"))
    _emit(frames)


def source_lines(objects: dict, root: str) -> None:
    """{expression: [path relative to root, first line, last line]} for each object."""
    out = {}
    for expr, obj in objects.items():
        obj = inspect.unwrap(obj)
        path = Path(inspect.getsourcefile(obj)).resolve()
        lines, first = inspect.getsourcelines(obj)
        out[expr] = [path.relative_to(Path(root).resolve()).as_posix(), max(first, 1),
                     max(first, 1) + len(lines) - 1]
    _emit(out)

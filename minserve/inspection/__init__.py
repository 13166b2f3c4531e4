"""Inspection: records -> traces -> figures -> the stepper (SPEC T6). An outer layer.

Every tick phase returns a record (`minserve.records`, part of the core). This
layer only reads them:

    trace.py     TraceRecorder (record a run), Trace (save / load / replay as JSON,
                 no model needed), describe_tick / describe_phase (one line of prose)
    viz/         plotly figures drawn from a record or a trace: queues, padding masks,
                 block tables, the block pool, timelines, fairness, work per tick
    stepper.py   the stepper: next phase / next tick / run N / add a request, as methods
    panel.py     its ipywidgets face: buttons, status, requests, figures redrawn in place

    from minserve.inspection import viz, TraceRecorder, Trace
    from minserve.inspection.stepper import Stepper

May import: the core and its front (records, sampling; an Engine is passed in,
never built here) and its own modules. Never imported by the core. `viz` and the stepper
need the `viz` extra (plotly, ipywidgets); `trace` needs nothing beyond the core.
"""

from __future__ import annotations

import importlib

from .trace import Trace, TraceRecorder, describe_phase, describe_tick


def __getattr__(name: str):
    # `viz` and `Stepper` pull in plotly / ipywidgets: import them only when asked for.
    # (import_module, not `from . import viz`: that would call this hook again.)
    if name == "viz":
        return importlib.import_module(".viz", __name__)
    if name == "Stepper":
        return importlib.import_module(".stepper", __name__).Stepper
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Stepper", "Trace", "TraceRecorder", "describe_phase", "describe_tick", "viz"]

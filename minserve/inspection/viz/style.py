"""What every minserve figure shares: colours with one meaning each, and small helpers.

The figures themselves are in queues.py, batch.py and timeline.py;
`minserve.inspection.viz` is the one module to import.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ..trace import Trace

# --- colours: one meaning each, the same in every figure ------------------------------------
PAD = "#e3e3e3"  # padding / free: nothing there
REAL = "#4c78a8"  # a real token / a block in use / decoding
SHARED = "#f58518"  # a block in several block tables (a shared prompt prefix)
CACHED = "#54a24b"  # ref 0 but its KV kept (prefix cache)
HELD = "#d62728"  # soft-held by a gate
PREFILL = "#f2a541"  # prefill chunk
PREFILL_WAIT = "#fbe0b5"  # in prefilling, no chunk this tick
QUEUED = "#bab0ac"  # waiting in pending
DONE = "#333333"  # finished

# sessions: a qualitative palette (colour-blind friendly, Okabe-Ito order)
SESSION_PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9",
                   "#D55E00", "#F0E442", "#000000", "#999999", "#882255")

TEMPLATE = "plotly_white"
FONT = {"family": "DejaVu Sans, Arial, sans-serif", "size": 12}


def session_colors(trace: Trace | None = None, sessions: list[str] | None = None) -> dict[str, str]:
    """Session -> colour, stable across the figures of one trace (order of first arrival).

    Without a trace, a session's colour comes from a hash of its name: stable
    everywhere, at the price of possible collisions.
    """
    colors: dict[str, str] = {}
    if trace is not None:
        for rid in trace.request_ids():
            s = trace.session_of(rid)
            if s is not None and s not in colors:
                colors[s] = SESSION_PALETTE[len(colors) % len(SESSION_PALETTE)]
    for s in sessions or []:
        if s not in colors:
            colors[s] = SESSION_PALETTE[zlib.crc32(s.encode()) % len(SESSION_PALETTE)]
    return colors


def short_id(request_id: str) -> str:
    """'req-12' -> 'r12' (labels inside small cells)."""
    return "r" + request_id[4:] if request_id.startswith("req-") else request_id


def as_record(rec_or_trace):
    """A TickRecord from a record, a trace (its last tick) or a dict (to_dict / JSON)."""
    from ...records import TickRecord
    from ..trace import Trace, tick_from_dict

    if isinstance(rec_or_trace, Trace):
        if not rec_or_trace.ticks:
            raise ValueError("the trace has no ticks yet")
        return rec_or_trace.ticks[-1]
    if isinstance(rec_or_trace, dict):
        return tick_from_dict(rec_or_trace)
    if not isinstance(rec_or_trace, TickRecord):
        raise TypeError(f"expected a TickRecord, a Trace or a dict, got {type(rec_or_trace)}")
    return rec_or_trace


def base_layout(title: str, **extra: Any) -> dict[str, Any]:
    layout = {"title": {"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
              "template": TEMPLATE, "font": FONT, "margin": {"l": 70, "r": 20, "t": 70, "b": 40}}
    layout.update(extra)
    return layout

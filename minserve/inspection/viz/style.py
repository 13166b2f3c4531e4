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

# sessions: colours that none of the states above uses, so a session colour never reads
# as "prefill" or "decoding". A session keeps its colour in every figure of a notebook:
# the colour is a function of the session id alone, never of arrival order.
SESSION_PALETTE = ("#8e6cbd", "#17a2a2", "#d45c9e", "#8c6d31", "#a6a21a", "#7a1f5c", "#5b6b7f")
# The lessons' cast gets fixed, distinct colours; any other id takes one from a hash of it,
# moved on to the next free colour when another session of the same figure has it (two
# demo users once shared a colour).
CAST = {"alice": 0, "bob": 1, "carol": 2, "dave": 3, "erin": 4, "default": 6}

TEMPLATE = "plotly_white"
FONT = {"family": "DejaVu Sans, Arial, sans-serif", "size": 12}
# Figures leave `width` unset (autosize): they fill the output area they are drawn in,
# ~970 px in JupyterLab with the file browser open. A figure drawn with fixed-size marks
# (the block pool's squares) stays at or under MAX_WIDTH; PNG exports use EXPORT_WIDTH.
MAX_WIDTH = 900
EXPORT_WIDTH = 900


def session_color(session: str) -> str:
    """The colour of a session, the same in every figure (a function of the id alone)."""
    if session in CAST:
        return SESSION_PALETTE[CAST[session]]
    return SESSION_PALETTE[zlib.crc32(session.encode()) % len(SESSION_PALETTE)]


def session_colors(trace: Trace | None = None, sessions: list[str] | None = None) -> dict[str, str]:
    """Session -> colour for the sessions of a trace (order of first arrival) and/or
    `sessions`: distinct while the palette lasts. Each session takes
    `session_color(session)` unless another session of the figure already has it; then
    the next free colour, the sessions taken in a fixed order (the cast, then by id), so
    the same sessions get the same colours in every figure, whatever their arrival."""
    names: list[str] = []
    if trace is not None:
        names += [s for rid in trace.request_ids() if (s := trace.session_of(rid)) is not None]
    names += list(sessions or [])
    names = list(dict.fromkeys(names))
    taken: dict[str, str] = {}
    for s in sorted(names, key=lambda x: (x not in CAST, x)):
        color = session_color(s)
        if color in taken.values() and len(taken) < len(SESSION_PALETTE):
            start = SESSION_PALETTE.index(color)
            color = next(c for i in range(len(SESSION_PALETTE))
                         if (c := SESSION_PALETTE[(start + i) % len(SESSION_PALETTE)])
                         not in taken.values())
        taken[s] = color
    return {s: taken[s] for s in names}


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
    """The layout every figure starts from: no fixed width (see MAX_WIDTH), our font."""
    layout = {"title": {"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
              "template": TEMPLATE, "font": FONT, "autosize": True,
              "margin": {"l": 70, "r": 20, "t": 70, "b": 40}}
    layout.update(extra)
    if (layout.get("width") or 0) > MAX_WIDTH:
        raise ValueError(f"width {layout['width']} px would be clipped in JupyterLab's output "
                         f"area; leave it unset or at most {MAX_WIDTH}")
    return layout


def empty(title: str):
    """A figure with nothing to draw but its title (an empty batch, no tick yet)."""
    import plotly.graph_objects as go

    return go.Figure(layout=base_layout(
        title, height=130, xaxis={"visible": False}, yaxis={"visible": False}))

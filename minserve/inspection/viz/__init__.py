"""Pictures of the engine, drawn from tick records (plotly). `pip install minserve[viz]`.

Every figure takes a `TickRecord` (what `engine.step()` returns, or one tick of
a saved `Trace`) or a whole `Trace`, and nothing else: no engine, no model, no
private state. So the same call draws a live engine in a notebook and a trace
saved last week.

    from minserve.inspection import viz
    rec = engine.step()
    viz.queues(rec)        # Q1 pending / Q2 prefilling / Q3 active, a card per request
    viz.padding(rec)       # padded backend: attention mask + position ids, one row per request
    viz.block_tables(rec)  # paged backend: each row's block table
    viz.batch(rec)         # whichever of the two fits the record's backend
    viz.kv_blocks(rec)     # the block pool: free / in use / shared / cached, and owners
    viz.timeline(trace)    # a Gantt of every request across ticks
    viz.fairness(trace)    # per-session service (and VTC counters) over time
    viz.work(trace)        # tokens through the model per tick (prefill chunks + decode);
                           #   viz.work({"a": t1, "b": t2}) draws runs on one y-scale
    viz.tick_times({"a": t1, "b": t2})  # wall time per tick: a stall, drawn

The figures live in three files, one concept each: `queues.py` (the
queues), `batch.py` (the decode batch and the KV block pool) and
`timeline.py` (whole-trace figures); `style.py` holds what they share
(colours with one meaning each, labels). This module gathers them.
"""

from __future__ import annotations

from .batch import BLOCK_STATES, batch, block_state, block_tables, kv_blocks, padding
from .queues import queues
from .style import as_record, session_color, session_colors
from .timeline import fairness, tick_times, timeline, work

__all__ = ["BLOCK_STATES", "as_record", "batch", "block_state", "block_tables", "fairness",
           "kv_blocks", "padding", "queues", "session_color", "session_colors", "tick_times", "timeline", "work"]

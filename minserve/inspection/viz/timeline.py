"""Whole-trace figures: a Gantt of requests across ticks, and fairness over time.

* `timeline(trace)`: one row per request, one column per tick, what it did in
  that tick (trace.request_states): waiting, held by a gate, a prefill chunk,
  waiting for a chunk, decoding; an end marker for finished or rejected. When a
  request is prefilled and decodes in the same tick (monolithic prefill, T2
  then T4), the tick's cell is split: prefill on the left, decode on the right.
* `fairness(trace)`: per session, the weighted service it received (SPEC P3:
  `w_in * prompt tokens computed + w_out * output tokens`), derived from the
  records so it works for FCFS too; under the fair policy also its VTC counter
  (which includes the lifts, P4); below, how many of its requests wait.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import trace as tr
from . import style

BAR_STATES = ((tr.QUEUED, style.QUEUED), (tr.HELD, style.HELD), (tr.PREFILL, style.PREFILL),
              (tr.PREFILL_WAIT, style.PREFILL_WAIT), (tr.DECODE, style.REAL))
END_STATES = ((tr.FINISHED, style.DONE, "x-thin-open"), (tr.REJECTED, style.HELD, "x"))


def timeline(trace: tr.Trace, title: str | None = None) -> go.Figure:
    """Gantt of every request across the trace's ticks (one bar trace per state).

    Bars are horizontal: `y` the request, `base` where the bar starts (tick - 0.5,
    or tick for the second half of a split tick), `x` its length.
    """
    states = tr.request_states(trace)
    order = [rid for rid in trace.request_ids() if rid in states]
    labels = {rid: f"{rid} · {trace.session_of(rid) or '?'}" for rid in order}
    bars: dict[str, dict[str, list]] = {s: {"y": [], "base": [], "x": [], "text": []}
                                        for s, _ in BAR_STATES}
    ends: dict[str, dict[str, list]] = {s: {"y": [], "x": [], "text": []} for s, *_ in END_STATES}
    for rid in order:
        by_tick: dict[int, list[dict]] = {}
        for ev in states[rid]:
            by_tick.setdefault(ev["tick"], []).append(ev)
        for t, evs in by_tick.items():
            spans = [ev for ev in evs if ev["state"] in bars]
            for k, ev in enumerate(spans):  # split the tick cell between its events
                w = 1.0 / len(spans)
                b = bars[ev["state"]]
                b["y"].append(labels[rid])
                b["base"].append(t - 0.5 + k * w)
                b["x"].append(w)
                b["text"].append(f"tick {t}: {ev['state']} {ev['detail']}")
            for ev in evs:
                if ev["state"] in ends:
                    e = ends[ev["state"]]
                    e["y"].append(labels[rid])
                    e["x"].append(t)
                    e["text"].append(f"tick {t}: {ev['state']} ({ev['detail']})")
    fig = go.Figure()
    for state, color in BAR_STATES:
        b = bars[state]
        fig.add_trace(go.Bar(y=b["y"], x=b["x"], base=b["base"], orientation="h", name=state,
                             marker={"color": color, "line": {"width": 0.5, "color": "white"}},
                             hovertext=b["text"], hoverinfo="text", width=0.7))
    for state, color, symbol in END_STATES:
        e = ends[state]
        fig.add_trace(go.Scatter(y=e["y"], x=e["x"], mode="markers", name=state,
                                 marker={"symbol": symbol, "size": 11, "color": color,
                                         "line": {"width": 2, "color": color}},
                                 hovertext=e["text"], hoverinfo="text"))
    n_ticks = max([rec.tick for rec in trace.ticks] + [1])
    cfg = trace.config
    if title is None:
        title = (f"timeline: {len(order)} requests over {n_ticks} ticks · policy "
                 f"{cfg.get('policy', '?')}, backend {cfg.get('backend', '?')}, prefill "
                 f"{cfg.get('prefill_mode', '?')}, max_batch_size {cfg.get('max_batch_size', '?')}")
    fig.update_layout(**style.base_layout(
        title, barmode="overlay", height=170 + 26 * max(1, len(order)), width=1000,
        margin={"l": 130, "r": 20, "t": 60, "b": 50},
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0.0,
                "font": {"size": 11}},
        xaxis={"title": "tick", "range": [0.4, n_ticks + 0.6], "dtick": 1 if n_ticks <= 30 else None,
               "showgrid": False},
        yaxis={"categoryorder": "array", "categoryarray": [labels[r] for r in order],
               "autorange": "reversed"}))
    fig.update_layout(title={"y": 0.98, "yanchor": "top"}, margin={"t": 80})
    return fig


def fairness(trace: tr.Trace, title: str | None = None) -> go.Figure:
    """Per session (one colour each): service received; VTC counters when the policy keeps
    them (the fair policy's `stats()`); requests waiting in pending. One row each."""
    service = tr.service_by_session(trace)
    colors = style.session_colors(trace)
    ticks = [rec.tick for rec in trace.ticks]
    counters = {s: [rec.policy.get("counters", {}).get(s) for rec in trace.ticks]
                for s in service} if any("counters" in r.policy for r in trace.ticks) else {}
    waiting = {s: [0] * len(ticks) for s in service}
    for i, rec in enumerate(trace.ticks):
        for rid in rec.queues.get("pending", []):
            s = trace.session_of(rid)
            if s in waiting:
                waiting[s][i] += 1
    cfg = trace.config
    w = f"w_in={cfg.get('fair_w_in', 1)}, w_out={cfg.get('fair_w_out', 2)}"
    titles = [f"service received: w_in·prompt + w_out·output tokens ({w})"]
    if counters:
        titles.append("VTC counter (service + lifts on arrival, P4): least goes next")
    titles.append("requests waiting in pending")
    rows = len(titles)
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.09,
                        row_heights=[0.4, 0.35, 0.25] if rows == 3 else [0.65, 0.35],
                        subplot_titles=titles)
    for s in service:
        c = colors.get(s, style.DONE)
        fig.add_trace(go.Scatter(x=ticks, y=service[s], mode="lines", name=s, legendgroup=s,
                                 line={"color": c, "width": 2.5}), row=1, col=1)
        if counters:
            fig.add_trace(go.Scatter(x=ticks, y=counters[s], mode="lines", name=f"{s} VTC counter",
                                     legendgroup=s, showlegend=False,
                                     line={"color": c, "width": 2, "dash": "dash"}), row=2, col=1)
        fig.add_trace(go.Scatter(x=ticks, y=waiting[s], mode="lines", name=f"{s} waiting",
                                 legendgroup=s, showlegend=False, line={"color": c, "shape": "hv"}),
                      row=rows, col=1)
    if title is None:
        title = f"fairness per session · policy {cfg.get('policy', '?')}"
    fig.update_layout(**style.base_layout(title, height=260 + 160 * rows, width=1000,
                                          margin={"l": 70, "r": 20, "t": 80, "b": 50},
                                          legend={"title": {"text": "session"}}))
    fig.update_xaxes(title_text="tick", row=rows, col=1)
    fig.update_yaxes(title_text="weighted tokens", row=1, col=1)
    if counters:
        fig.update_yaxes(title_text="counter", row=2, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=rows, col=1)
    return fig


def work(trace: tr.Trace, title: str | None = None, durations: bool = False) -> go.Figure:
    """Tokens pushed through the model per tick: prompt tokens (prefill chunks, one colour
    per request) stacked on decode tokens (one per active row), and above each bar the
    number of forward passes that carried them (`TickRecord.forwards`: Version A runs
    one per chunk plus the decode one, Version B one in all). With `durations`, the
    tick's wall time too (ms, right axis; a measurement, so it differs run to run).

    Chunked prefill (SPEC C1) caps the prompt part of every tick at
    `prefill_chunk_size`: the tallest bar, and so the longest tick, gets shorter.
    """
    ticks = [rec.tick for rec in trace.ticks]
    per_req: dict[str, list[int]] = {}
    for i, rec in enumerate(trace.ticks):
        for c in rec.prefill.chunks:
            per_req.setdefault(c["request_id"], [0] * len(ticks))[i] += c["end"] - c["start"]
    fig = make_subplots(specs=[[{"secondary_y": durations}]])
    fig.add_trace(go.Bar(x=ticks, y=[len(rec.decode.rows) for rec in trace.ticks],
                         name="decode tokens (1 per active row)", marker={"color": style.REAL}))
    shades = ("#f2a541", "#e07b39", "#c9541f", "#f6c48b", "#d99a5b", "#b5651d")
    for k, (rid, ys) in enumerate(per_req.items()):
        fig.add_trace(go.Bar(x=ticks, y=ys, name=f"prefill {rid}",
                             marker={"color": shades[k % len(shades)]}))
    if any(rec.forwards for rec in trace.ticks):  # how many forward passes carried them
        totals = [len(rec.decode.rows) + sum(c["end"] - c["start"] for c in rec.prefill.chunks)
                  for rec in trace.ticks]
        fig.add_trace(go.Scatter(
            x=ticks, y=totals, mode="text", name="forwards this tick (count above the bar)",
            text=[str(len(rec.forwards)) if rec.forwards else "" for rec in trace.ticks],
            textposition="top center", textfont={"size": 10, "color": style.DONE},
            customdata=[", ".join(map(str, rec.forwards)) for rec in trace.ticks],
            hovertemplate="tick %{x}: %{text} forward(s) of %{customdata} tokens<extra></extra>"))
    if durations:
        fig.add_trace(go.Scatter(x=ticks, y=[1000 * rec.duration_s for rec in trace.ticks],
                                 name="tick wall time (ms)", mode="lines+markers",
                                 line={"color": style.DONE, "width": 1.5}), secondary_y=True)
        fig.update_yaxes(title_text="ms", secondary_y=True, rangemode="tozero", showgrid=False,
                         tickmode="auto", nticks=6)
    cfg = trace.config
    if title is None:
        title = (f"tokens through the model per tick · prefill {cfg.get('prefill_mode', '?')}"
                 + (f", chunk {cfg['prefill_chunk_size']}" if cfg.get("prefill_chunk_size") else ""))
    fig.update_layout(**style.base_layout(title, barmode="stack", height=420, width=1000,
                                          legend={"font": {"size": 11}},
                                          margin={"l": 70, "r": 20, "t": 60, "b": 50}))
    fig.update_xaxes(title_text="tick", dtick=1 if len(ticks) <= 30 else None)
    fig.update_yaxes(title_text="tokens", secondary_y=False)
    return fig

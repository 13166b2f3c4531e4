"""Whole-trace figures: a Gantt of requests across ticks, fairness, work and time per tick.

* `timeline(trace)`: one row per request, one column per tick, what it did in
  that tick (trace.request_states): waiting, held by a gate, a prefill chunk,
  waiting for a chunk, its prompt on the prefill worker (disaggregated: hatched),
  decoding; an end marker for finished or rejected. When a
  request is prefilled and decodes in the same tick (monolithic prefill, T2
  then T4), the tick's cell is split: prefill on the left, decode on the right.
* `fairness(trace)`: per session, the weighted service it received (SPEC P3:
  `w_in * prompt tokens computed + w_out * output tokens`), derived from the
  records so it works for FCFS too; under the fair policy also its VTC counter
  (which includes the lifts, P4); below, how many of its requests wait.
* `work(trace)` / `work({name: trace})`: tokens through the model per tick, prefill
  stacked on decode, several runs on one y-scale.
* `tick_times({name: trace})`: wall time per tick, i.e. the gap between two tokens
  of every streaming user; a stall is a tall point.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import trace as tr
from . import style

BAR_STATES = ((tr.QUEUED, style.QUEUED), (tr.HELD, style.HELD), (tr.PREFILL, style.PREFILL),
              (tr.PREFILL_WAIT, style.PREFILL_WAIT), (tr.REMOTE, style.PREFILL),
              (tr.DECODE, style.REAL))
# disaggregated prefill: the prefill colour (it is prefill), hatched (somewhere else)
PATTERNS = {tr.REMOTE: {"shape": "/", "fgcolor": "white", "solidity": 0.35}}
END_STATES = ((tr.FINISHED, style.DONE, "x-thin-open"), (tr.REJECTED, style.HELD, "x"),
              (tr.PREEMPTED, style.HELD, "triangle-down"))  # P6: KV dropped, back to pending


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
        if state == tr.REMOTE and not b["y"]:
            continue  # no legend entry for a mode the run did not use
        fig.add_trace(go.Bar(y=b["y"], x=b["x"], base=b["base"], orientation="h", name=state,
                             marker={"color": color, "line": {"width": 0.5, "color": "white"},
                                     **({"pattern": PATTERNS[state]} if state in PATTERNS else {})},
                             hovertext=b["text"], hoverinfo="text", width=0.7))
    for state, color, symbol in END_STATES:
        e = ends[state]
        fig.add_trace(go.Scatter(y=e["y"], x=e["x"], mode="markers", name=state,
                                 marker={"symbol": symbol, "size": 11, "color": color,
                                         "line": {"width": 2, "color": color}},
                                 hovertext=e["text"], hoverinfo="text"))
    # the trace's own ticks: a recorder attached to an engine that already ran (the
    # stepper on a lesson's engine) starts at that engine's tick, not at 1
    ticks = [rec.tick for rec in trace.ticks] or [1]
    first, last = min(ticks), max(ticks)
    n_ticks = last - first + 1
    cfg = trace.config
    if title is None:
        title = (f"timeline: {len(order)} requests over {n_ticks} ticks · policy "
                 f"{cfg.get('policy', '?')}, backend {cfg.get('backend', '?')}, prefill "
                 f"{cfg.get('prefill_mode', '?')}, max_batch_size {cfg.get('max_batch_size', '?')}")
    fig.update_layout(**style.base_layout(
        title, barmode="overlay", height=170 + 26 * max(1, len(order)),
        margin={"l": 130, "r": 20, "t": 60, "b": 50},
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0.0,
                "font": {"size": 11}},
        xaxis={"title": "tick", "range": [first - 0.6, last + 0.6], "dtick": 1 if n_ticks <= 30 else None,
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
    fig.update_layout(**style.base_layout(title, height=260 + 160 * rows,
                                          margin={"l": 70, "r": 20, "t": 80, "b": 50},
                                          legend={"title": {"text": "session"}}))
    fig.update_xaxes(title_text="tick", row=rows, col=1)
    fig.update_yaxes(title_text="weighted tokens", row=1, col=1)
    if counters:
        fig.update_yaxes(title_text="counter", row=2, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=rows, col=1)
    return fig


PREFILL_SHADES = ("#f2a541", "#e07b39", "#c9541f", "#f6c48b", "#d99a5b", "#b5651d")  # orange: prefill


def work(runs, title: str | None = None, durations: bool = False,
         log_y: bool | None = None) -> go.Figure:
    """Tokens pushed through the model per tick: prompt tokens (prefill chunks, one orange
    shade per request) stacked on decode tokens (blue, one per active row), and above each
    bar the number of forward passes that carried them (`TickRecord.forwards`: Version A
    runs one per chunk plus the decode one, Version B one in all).

    `runs`: one Trace, or {name: Trace} to draw several runs one above the other on *one*
    y-scale, so their bars compare. That scale is logarithmic when the runs are compared
    (`log_y`, default: True for several runs): a 384-token prefill and a 2-token decode
    step are both visible. With `durations` (one trace only), the tick's wall time too
    (ms, right axis; a measurement, so it differs run to run; see also `tick_times`).

    Chunked prefill (SPEC C1) caps the prompt part of every tick at
    `prefill_chunk_size`: the tallest bar, and so the longest tick, gets shorter.
    """
    named = dict(runs) if isinstance(runs, dict) else {"": runs}
    if log_y is None:
        log_y = len(named) > 1
    if durations and len(named) > 1:
        raise ValueError("durations=True draws one trace; for several runs use tick_times(runs)")
    fig = make_subplots(rows=len(named), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[n for n in named] if len(named) > 1 else None,
                        specs=[[{"secondary_y": durations}]] * len(named))
    top, seen = 1, set()
    for row, trace in enumerate(named.values(), start=1):
        ticks = [rec.tick for rec in trace.ticks]
        per_req: dict[str, list[int]] = {}
        for i, rec in enumerate(trace.ticks):
            for c in rec.prefill.chunks:
                per_req.setdefault(c["request_id"], [0] * len(ticks))[i] += c["end"] - c["start"]
        bars = [("decode tokens (1 per active row)", style.REAL,
                 [len(rec.decode.rows) for rec in trace.ticks])]
        bars += [(f"prefill {rid}", PREFILL_SHADES[k % len(PREFILL_SHADES)], ys)
                 for k, (rid, ys) in enumerate(per_req.items())]
        for name, color, ys in bars:
            fig.add_trace(go.Bar(x=ticks, y=ys, name=name, legendgroup=name,
                                 showlegend=name not in seen, marker={"color": color}),
                          row=row, col=1)
            seen.add(name)
        totals = [len(rec.decode.rows) + sum(c["end"] - c["start"] for c in rec.prefill.chunks)
                  for rec in trace.ticks]
        top = max([top] + totals)
        if any(rec.forwards for rec in trace.ticks):  # how many forward passes carried them
            name = "forwards this tick (count above the bar)"
            fig.add_trace(go.Scatter(
                x=ticks, y=totals, mode="text", name=name, legendgroup=name,
                showlegend=name not in seen,
                text=[str(len(rec.forwards)) if rec.forwards else "" for rec in trace.ticks],
                textposition="top center", textfont={"size": 10, "color": style.DONE},
                customdata=[", ".join(map(str, rec.forwards)) for rec in trace.ticks],
                hovertemplate="tick %{x}: %{text} forward(s) of %{customdata} tokens"
                              "<extra></extra>"), row=row, col=1)
            seen.add(name)
        if durations:
            fig.add_trace(go.Scatter(x=ticks, y=[1000 * rec.duration_s for rec in trace.ticks],
                                     name="tick wall time (ms)", mode="lines+markers",
                                     line={"color": style.DONE, "width": 1.5}),
                          row=row, col=1, secondary_y=True)
            fig.update_yaxes(title_text="ms", secondary_y=True, rangemode="tozero",
                             showgrid=False, tickmode="auto", nticks=6)
    first = next(iter(named.values()))
    cfg = first.config
    if title is None:
        title = "tokens through the model per tick" + (
            " · one y-scale (log) for all runs" if len(named) > 1 and log_y else
            " · one y-scale for all runs" if len(named) > 1 else
            f" · prefill {cfg.get('prefill_mode', '?')}"
            + (f", chunk {cfg['prefill_chunk_size']}" if cfg.get("prefill_chunk_size") else ""))
    fig.update_layout(**style.base_layout(title, barmode="stack",
                                          height=(420 if len(named) == 1 else 190 + 230 * len(named)),
                                          legend={"font": {"size": 11}, "orientation": "h",
                                                  "y": -0.12, "yanchor": "top", "x": 0},
                                          margin={"l": 70, "r": 20, "t": 70, "b": 50}))
    n_ticks = max(len(t.ticks) for t in named.values())
    fig.update_xaxes(dtick=1 if n_ticks <= 30 else None)
    fig.update_xaxes(title_text="tick", row=len(named), col=1)
    # one y-scale for every run: the same range on each row (headroom for the counts)
    yr = [math.log10(0.8), math.log10(top * 1.6)] if log_y else [0, top * 1.12]
    for row in range(1, len(named) + 1):
        fig.update_yaxes(title_text="tokens", type="log" if log_y else "linear", range=yr,
                         dtick=1 if log_y else None, row=row, col=1,
                         **({"secondary_y": False} if durations else {}))
    return fig


def tick_times(runs, title: str | None = None) -> go.Figure:
    """Wall time of every tick, one line per run ({name: Trace}, or one Trace).

    Every decoding row gets one token per tick, so for a user who is streaming, a
    tick's time *is* the gap between two of their tokens: a tall point is a stall.
    A marker is orange when the tick ran a prefill chunk, blue when it only decoded.
    A measurement: it changes from run to run and machine to machine (the first tick
    of a fresh process also pays one-off warm-up costs).
    """
    named = dict(runs) if isinstance(runs, dict) else {"": runs}
    fig = go.Figure()
    for k, (name, trace) in enumerate(named.items()):
        ticks = [rec.tick for rec in trace.ticks]
        prompt = [sum(c["end"] - c["start"] for c in rec.prefill.chunks) for rec in trace.ticks]
        fig.add_trace(go.Scatter(
            x=ticks, y=[1000 * rec.duration_s for rec in trace.ticks], name=name or "tick time",
            mode="lines+markers", line={"color": style.DONE, "width": 1.5,
                                        "dash": ("solid", "dot", "dash", "dashdot")[k % 4]},
            marker={"size": 9, "color": [style.PREFILL if p else style.REAL for p in prompt],
                    "line": {"width": 1, "color": style.DONE}},
            customdata=[[p, len(rec.decode.rows)] for p, rec in zip(prompt, trace.ticks)],
            hovertemplate=f"{name}<br>tick %{{x}}: %{{y:.1f}} ms<br>%{{customdata[0]}} prompt "
                          "tokens, %{customdata[1]} decode rows<extra></extra>"))
    for label, color in (("tick ran a prefill chunk", style.PREFILL),
                         ("tick only decoded", style.REAL)):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label,
                                 marker={"size": 9, "color": color}, hoverinfo="skip"))
    fig.update_layout(**style.base_layout(
        title or "time per tick = the gap between two tokens of every streaming user",
        height=380, legend={"orientation": "h", "y": -0.2, "yanchor": "top", "x": 0,
                            "font": {"size": 11}},
        margin={"l": 70, "r": 20, "t": 60, "b": 50}))
    n_ticks = max(len(t.ticks) for t in named.values())
    fig.update_xaxes(title_text="tick", dtick=1 if n_ticks <= 30 else None)
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    return fig

"""The three queues (SPEC Q1-Q3), a card per request, drawn from one TickRecord.

    Q1 pending            Q2 prefilling           Q3 active (decode batch)   left this tick
    ┌──────────────┐      ┌──────────────┐        ┌──────────────┐           ┌────────────┐
    │ req-4 · bob  │      │ req-2 · alice│        │ req-0 · alice│           │ req-1      │
    │ prompt 40    │      │ 16/40 done   │        │ out 3/8      │           │ length     │
    │ held: G2 ... │      │ ███░░░░░     │        │ ███░░░░░     │           └────────────┘
    └──────────────┘      └──────────────┘        └──────────────┘

Card colour = session (the legend says which; a session has the same colour in
every figure, `style.session_color`); a red dashed border = soft-held at the head of pending
by a gate (G4), with the gate's numbers (G6) in the card and on hover. The
thin bar at the bottom of a card is its progress: prompt tokens computed
(prefilling) or output tokens out of `max_tokens` (active). Under disaggregated
prefill (SPEC C2) a prefilling card says where its prompt is (on the prefill worker,
being computed or queued; not sent yet; its KV back), and a row promoted this tick
says what its KV's move cost (blocks, bytes).
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import plotly.graph_objects as go

from . import style

COLUMNS = (("pending", "Q1 pending"), ("prefilling", "Q2 prefilling"),
           ("active", "Q3 active (decode batch)"), ("left", "left this tick"))
CARD_W, CARD_H, GAP = 0.86, 0.82, 0.18  # in axis units: one column is 1 wide, one card ~1 high


def _gate_line(rejection: dict[str, Any]) -> str:
    """The hold in a few words (the card is narrow); the full numbers are in the hover."""
    n = rejection.get("numbers", {})
    if rejection["gate"] == "G2":
        return (f"held by G2: {n.get('active_kv_reserved')} + {n.get('need')}"
                f" > {n.get('kv_budget_tokens')}")
    if rejection["gate"] == "G3":
        return f"held by G3: {n.get('blocks_needed')} blocks, {n.get('free_blocks')} free"
    if rejection.get("reason") == "session_cap":
        return f"held: its session has {n.get('session_rows')}/{n.get('max_rows_per_session')} rows"
    if rejection["gate"] == "batch":
        return f"held: all {n.get('max_batch_size')} rows busy"
    return f"held by {rejection['gate']}: {rejection['reason']}"


def _remote_line(rid: str, remote: dict[str, Any], jobs: dict[str, dict], worker: dict[str, Any],
                 admitted: bool) -> str:
    """disaggregated (SPEC C2): where a prefilling row's prompt is, in a few words."""
    if rid in jobs:
        return ("on the prefill worker, " + ("being computed" if jobs[rid]["started"] else "queued")
                + (" (sent this tick)" if rid in remote.get("sent", []) else ""))
    if rid in worker.get("arrived", []):
        return "KV back from the worker: spliced in at T2"
    if rid in remote.get("waiting", {}):
        return "not sent yet: the worker is full"
    return "admitted this tick: sent at T2" if admitted else "to be sent to the prefill worker"


def _cards(rec, trace) -> dict[str, list[dict[str, Any]]]:
    """Per column, in queue order: {id, card, lines, progress, held} for each request."""
    held = rec.admit.held or {}
    admitted = {a["request_id"]: a for a in rec.admit.admitted}
    chunks = {c["request_id"]: c for c in rec.prefill.chunks}
    remote = rec.prefill.remote  # disaggregated (C2): sent, waiting, on_worker, transfers
    moved = remote.get("transfers") or {}
    worker = rec.backend.get("prefill_worker")
    jobs = {j["request_id"]: j for j in (worker or {}).get("on_worker", [])}
    out: dict[str, list[dict[str, Any]]] = {}
    for q in ("pending", "prefilling", "active"):
        col = []
        for rid in rec.queues.get(q, []):
            c = rec.requests.get(rid, {})
            head = f"<b>{rid}</b> · {c.get('session', '?')}"
            if c.get("priority"):
                head += f" · prio {c['priority']}"
            progress, lines = 0.0, [head]
            if q == "pending":
                lines.append(f"prompt {c.get('prompt_len')} · max {c.get('max_tokens')} out")
                if rid == held.get("request_id"):
                    lines.append(_gate_line(held["rejection"]))
                else:
                    lines.append("waiting")
            elif q == "prefilling":
                done, n = c.get("computed", 0), c.get("prompt_len", 1)
                progress = done / max(1, n)
                lines.append(f"prompt {done}/{n} computed" + (f" ({c['cached']} cached)"
                                                             if c.get("cached") else ""))
                if worker is not None:  # disaggregated: where its prompt is
                    lines.append(_remote_line(rid, remote, jobs, worker, rid in admitted))
                else:
                    lines.append(f"chunk {chunks[rid]['start']}..{chunks[rid]['end']} this tick"
                                 if rid in chunks else ("admitted this tick" if rid in admitted
                                                        else "waiting for a chunk"))
            else:
                k, m = c.get("output_len", 0), c.get("max_tokens", 1)
                progress = k / max(1, m)
                lines.append(f"out {k}/{m} · prompt {c.get('prompt_len')}"
                             + (f" ({c['cached']} cached)" if c.get("cached") else ""))
                if rid in rec.decode.finished:
                    lines.append(f"done ({rec.decode.finished[rid]}), leaves next tick")
                elif moved.get(rid):
                    n = moved[rid]["blocks"]
                    lines.append(f"KV moved in: {n} block{'s' if n != 1 else ''}, "
                                 f"{moved[rid]['bytes']:,} B")
                elif rid in chunks:
                    lines.append("prefilled, first token this tick")
                else:
                    lines.append(f"decoded at pos {rec.decode.positions[rid]}"
                                 if rid in rec.decode.positions else "")
            col.append({"id": rid, "card": c, "lines": lines, "progress": progress,
                        "held": q == "pending" and rid == held.get("request_id")})
        out[q] = col
    left = []
    for e in rec.evict.evicted:
        left.append({"id": e["request_id"], "card": e, "progress": 1.0, "held": False,
                     "lines": [f"<b>{e['request_id']}</b>", f"finished: {e['finish_reason']}",
                               f"released {e['released_tokens']} KV tokens"]})
    for r in rec.admit.rejected:
        j = r["rejection"]
        left.append({"id": r["request_id"], "card": r, "progress": 0.0, "held": False,
                     "lines": [f"<b>{r['request_id']}</b>", f"rejected by {j['gate']}",
                               j["reason"]]})
    for rid in rec.admit.cancelled:
        left.append({"id": rid, "card": {}, "progress": 0.0, "held": False,
                     "lines": [f"<b>{rid}</b>", "cancelled while pending", ""]})
    out["left"] = left
    return out


def _wrapped(lines: list[str], width: int) -> list[str]:
    """A card's lines for a narrow card: each ' · ' part on its own line, and a part
    longer than `width` characters (tags not counted) wrapped at spaces."""
    out = []
    for line in lines:
        for part in line.split(" · "):
            if len(re.sub(r"<[^>]+>", "", part)) <= width:
                out.append(part)
            else:
                out += textwrap.wrap(part, width) or [""]
    return out


def queues(rec, trace=None, title: str | None = None, *, columns=None, font_size: int = 11,
           wrap: int | None = None) -> go.Figure:
    """The queues after a tick (or after one phase, in the stepper), a card per request.

    One invisible scatter trace per column carries the request ids (`customdata`,
    in queue order) and the hover text, so the figure's data can be checked.
    For a narrow or projected page (the chat demo): `columns`, the queues to draw
    (names of COLUMNS); `font_size`, the cards' text; `wrap`, the most characters on a
    card's line (its ' · ' parts go on lines of their own). Cards grow to their lines.
    """
    rec = style.as_record(rec)
    cols = _cards(rec, trace)
    drawn = [(q, label) for q, label in COLUMNS if columns is None or q in columns]
    if wrap:
        for col in cols.values():
            for card in col:
                card["lines"] = _wrapped(card["lines"], wrap)
    most = max([len(c["lines"]) for q, _ in drawn for c in cols[q]] + [3])
    # pixels per card slot (a card and its gap: 1 axis unit): 82, or what its lines need
    # between the text's top (0.06 below the card's) and the progress bar (0.12 high)
    unit_px = max(82.0, (most * font_size * 1.3 + 4) / (CARD_H - 0.18))
    sessions = [c["card"].get("session") for col in cols.values() for c in col
                if c["card"].get("session")]
    colors = style.session_colors(sessions=sessions)  # the sessions on screen: the legend
    shapes, annotations, data = [], [], []
    for x, (q, label) in enumerate(drawn):
        annotations.append({"x": x + CARD_W / 2, "y": 0.35, "text": f"<b>{label}</b> "
                            f"({len(cols[q])})", "showarrow": False,
                            "font": {"size": max(13, font_size + 1)}})
        xs, ys, hover = [], [], []
        for i, card in enumerate(cols[q]):
            top = -i * (CARD_H + GAP)
            color = colors.get(card["card"].get("session"), style.DONE) if q != "left" else style.DONE
            shapes.append({"type": "rect", "x0": x, "x1": x + CARD_W, "y0": top - CARD_H,
                           "y1": top, "fillcolor": color, "opacity": 0.16 if q != "left" else 0.08,
                           "line": {"width": 0}})
            shapes.append({"type": "rect", "x0": x, "x1": x + CARD_W, "y0": top - CARD_H,
                           "y1": top, "fillcolor": "rgba(0,0,0,0)",
                           "line": {"color": style.HELD if card["held"] else color,
                                    "width": 3 if card["held"] else 1.5,
                                    "dash": "dash" if card["held"] else "solid"}})
            if q in ("prefilling", "active"):  # progress bar along the bottom edge
                shapes.append({"type": "rect", "x0": x + 0.02, "y0": top - CARD_H + 0.04,
                               "x1": x + 0.02 + (CARD_W - 0.04) * min(1.0, card["progress"]),
                               "y1": top - CARD_H + 0.12, "fillcolor": color,
                               "line": {"width": 0}})
            annotations.append({"x": x + 0.03, "y": top - 0.06, "xanchor": "left",
                                "yanchor": "top", "align": "left", "showarrow": False,
                                "text": "<br>".join(card["lines"]),
                                "font": {"size": font_size}})
            xs.append(x + CARD_W / 2)
            ys.append(top - CARD_H / 2)
            info = dict(card["card"])
            if card["held"]:
                info["held"] = rec.admit.held["rejection"]["message"]
            hover.append("<br>".join(f"{k}: {v}" for k, v in info.items()))
        data.append(go.Scatter(x=xs, y=ys, mode="markers", name=q, hovertext=hover,
                               hoverinfo="text", customdata=[c["id"] for c in cols[q]],
                               marker={"size": 30, "opacity": 0}, showlegend=False))
    # the legend: what a card's colour and a dashed red border mean (one meaning per colour)
    for s in sorted(colors):
        data.append(go.Scatter(x=[None], y=[None], mode="markers", name=s, customdata=[],
                               meta="session",
                               marker={"symbol": "square", "size": 12, "color": colors[s],
                                       "opacity": 0.6}, hoverinfo="skip"))
    if rec.admit.held:
        data.append(go.Scatter(x=[None], y=[None], mode="markers", customdata=[],
                               name="held by a gate (red dashed border)",
                               marker={"symbol": "square-open", "size": 12, "color": style.HELD},
                               hoverinfo="skip"))
    rows = max([len(cols[q]) for q, _ in drawn] + [1])
    bottom = -rows * (CARD_H + GAP)
    if title is None:
        reserved = f"KV reserved {rec.active_kv_reserved}"
        if trace is not None and trace.config.get("kv_budget_tokens"):
            reserved += f"/{trace.config['kv_budget_tokens']}"
        title = f"tick {rec.tick}: the queues after the tick · {reserved} tokens (R1)"
    fig = go.Figure(data=data, layout=style.base_layout(
        title, shapes=shapes, annotations=annotations, height=int(126 + unit_px * (rows + 0.6)),
        margin={"l": 15, "r": 15, "t": 70, "b": 45}, showlegend=bool(colors),
        legend={"orientation": "h", "y": 0, "yanchor": "top", "x": 0, "font": {"size": font_size},
                "title": {"text": "card colour = session:"},
                "itemclick": False, "itemdoubleclick": False},
        xaxis={"visible": False, "range": [-0.05, len(drawn)]},
        yaxis={"visible": False, "range": [bottom, 0.6]}, hovermode="closest"))
    return fig

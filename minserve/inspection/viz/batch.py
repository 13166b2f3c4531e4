"""The decode batch and the KV block pool, drawn from one TickRecord.

* `padding(rec)`: the padded backend's batch. Rows have different lengths, so
  they are left-padded to one width; the attention mask says which columns are
  real, and each row's position ids count only its real tokens (B1, R3):

      mask          position ids
      0 0 1 1 1     · · 0 1 2      <- req-0, 3 tokens: 2 columns of padding
      1 1 1 1 1     0 1 2 3 4      <- req-1, 5 tokens

* `block_tables(rec)`: the paged backend's batch. No padding: each row is a
  list of physical blocks (its block table); equal prompt prefixes share blocks.
* `kv_blocks(rec)`: the whole block pool, one square per block, coloured by
  state: free, in use, in use by several rows (a shared prefix), cached.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import style

CELL_TEXT_MAX_COLS = 48  # wider batches drop the numbers inside the cells


def padding(rec, trace=None) -> go.Figure:
    """Attention mask and position ids of the padded decode batch, one row per request.

    Row order is the backend's (`rec.backend["row_ids"]`). Heatmap 1's `z` is the
    backend's mask exactly; heatmap 2's `z` is the position ids, with -1 on padding.
    """
    rec = style.as_record(rec)
    b = rec.backend
    if b.get("name") != "padded":
        raise ValueError(f"padding() draws the padded backend; this record is from "
                         f"{b.get('name')!r}: use block_tables() (or batch())")
    mask, pos, rows = b["attention_mask"], b["position_ids"], b["row_ids"]
    B, L = len(mask), (len(mask[0]) if mask else 0)
    if B == 0:
        return style.empty(f"tick {rec.tick}: the padded decode batch is empty")
    pos_z = [[p if m else -1 for p, m in zip(pr, mr)] for pr, mr in zip(pos, mask)]
    labels = [f"{rid} ({sum(m)}/{L})" for rid, m in zip(rows, mask)]
    show_text = L <= CELL_TEXT_MAX_COLS
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.14,
                        subplot_titles=("attention_mask: 1 = real token, 0 = left padding",
                                        "position_ids: counted over real tokens only "
                                        "(grey · = padding)"))
    fig.add_trace(go.Heatmap(
        z=mask, x=list(range(L)), y=labels, zmin=0, zmax=1, showscale=False, xgap=1, ygap=1,
        colorscale=[[0, style.PAD], [0.5, style.PAD], [0.5, style.REAL], [1, style.REAL]],
        text=[[str(v) for v in r] for r in mask], texttemplate="%{text}" if show_text else None,
        name="attention_mask", hovertemplate="%{y}<br>column %{x}: mask %{z}<extra></extra>"),
        row=1, col=1)
    top = max([max(r) for r in pos] + [1]) if pos else 1
    cut = 0.5 / (top + 1)  # -1 (padding) maps below `cut`: grey; real positions: blues
    fig.add_trace(go.Heatmap(
        z=pos_z, x=list(range(L)), y=labels, zmin=-1, zmax=top, showscale=False, xgap=1, ygap=1,
        colorscale=[[0, style.PAD], [cut, style.PAD], [cut, "#deebf7"], [1, "#2171b5"]],
        text=[[str(p) if m else "·" for p, m in zip(pr, mr)] for pr, mr in zip(pos, mask)],
        texttemplate="%{text}" if show_text else None, name="position_ids",
        hovertemplate="%{y}<br>column %{x}: position %{text}<extra></extra>"), row=2, col=1)
    pad = b.get("padding_tokens", sum(L - sum(m) for m in mask))
    staging = b.get("staging") or {}
    title = (f"tick {rec.tick}: padded decode batch, {B} rows × {L} columns, {pad} padding "
             f"slots ({100 * pad / max(1, B * L):.0f}%)")
    if staging:
        title += "<br><sup>being prefilled, not in the batch yet: " + ", ".join(
            f"{k} ({v} tokens)" for k, v in staging.items()) + "</sup>"
    fig.update_layout(**style.base_layout(title, height=230 + 2 * 30 * max(1, B),
                                        margin={"l": 120, "r": 20, "t": 90, "b": 45}))
    fig.update_yaxes(autorange="reversed", tickfont={"size": 11})
    fig.update_xaxes(title_text="KV column (all rows end at the newest token, on the right)",
                     row=2, col=1)
    return fig


def block_tables(rec, trace=None) -> go.Figure:
    """The paged batch: one row per request, one cell per entry of its block table.

    Cell = the physical block id; colour = tokens in the block (darker = fuller);
    an orange frame marks a block that is also in another table (shared prefix).
    """
    rec = style.as_record(rec)
    b = rec.backend
    if "rows" not in b:
        raise ValueError(f"block_tables() draws the paged backend; this record is from "
                         f"{b.get('name')!r}: use padding() (or batch())")
    bs = b["block_size"]
    refs = {blk["id"]: blk["ref_count"] for blk in rec.blocks or []}
    rows = b["rows"]
    if not rows:
        return style.empty(f"tick {rec.tick}: the paged batch is empty (no block tables)")
    width = max([len(r["block_table"]) for r in rows] + [1])
    z, text, labels, sx, sy = [], [], [], [], []
    for r in rows:
        label = f"{r['request_id']} ({r['state']}, {r['length']} tok)"
        labels.append(label)
        table = r["block_table"]
        z.append([min(bs, max(0, r["length"] - i * bs)) if i < len(table) else None
                  for i in range(width)])
        text.append([f"#{table[i]}" if i < len(table) else "" for i in range(width)])
        for i, blk in enumerate(table):
            if refs.get(blk, 1) > 1:
                sx.append(i)
                sy.append(label)
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(width)), y=labels, zmin=0, zmax=bs, xgap=2, ygap=2, text=text,
        texttemplate="%{text}", name="block tables",
        colorscale=[[0, "#eef3fa"], [1, style.REAL]],
        colorbar={"title": {"text": "tokens<br>in block"}, "thickness": 12},
        hovertemplate="%{y}<br>table[%{x}] = block %{text}: %{z} tokens<extra></extra>"))
    fig.add_trace(go.Scatter(x=sx, y=sy, mode="markers", name="shared block (ref > 1)",
                             marker={"symbol": "square-open", "size": 34, "color": style.SHARED,
                                     "line": {"width": 3}}, hoverinfo="skip"))
    fig.update_layout(**style.base_layout(
        f"tick {rec.tick}: paged batch, block tables (block_size {bs}; no padding anywhere)",
        height=200 + 44 * max(1, len(rows)),
        margin={"l": 200, "r": 20, "t": 70, "b": 45},
        legend={"orientation": "h", "y": -0.25, "x": 0},
        xaxis={"title": "index in the block table (token t lives in entry t // block_size)",
               "dtick": 1},
        yaxis={"autorange": "reversed"}))
    return fig


def batch(rec, trace=None) -> go.Figure:
    """`padding` for a padded-backend record, `block_tables` for a paged one."""
    rec = style.as_record(rec)
    return padding(rec, trace) if rec.backend.get("name") == "padded" else block_tables(rec, trace)


BLOCK_STATES = (  # (trace name, colour): one legend entry per state
    ("free", style.PAD), ("in use", style.REAL), ("in use, shared prefix (ref > 1)", style.SHARED),
    ("cached (ref 0, KV kept for reuse)", style.CACHED))


def block_state(blk: dict) -> str:
    """The legend name of a block from `BlockManager.snapshot()`."""
    if blk["state"] == "used":
        return BLOCK_STATES[2][0] if blk["ref_count"] > 1 else BLOCK_STATES[1][0]
    return BLOCK_STATES[3][0] if blk["state"] == "cached" else BLOCK_STATES[0][0]


def kv_blocks(rec, trace=None, columns: int | None = None) -> go.Figure:
    """The block pool after a tick: one square per block, by state, labelled with owners.

    One scatter trace per state; trace `customdata` holds the block ids, so a test
    can check that every block sits in the trace of its state.
    """
    rec = style.as_record(rec)
    blocks = rec.blocks
    if blocks is None:
        raise ValueError("this record has no block snapshot (the engine had no block manager)")
    n = len(blocks)
    columns = columns or (16 if n > 48 else 12 if n > 24 else 8)
    nrows = -(-n // columns)
    # squares are drawn in pixels, so this figure has a width: the pool's columns fit
    # in style.MAX_WIDTH (left and right margins, 60 px, plus a little room)
    cell = min(58, (style.MAX_WIDTH - 80) // columns)
    fig = go.Figure()
    for name, color in BLOCK_STATES:
        sel = [blk for blk in blocks if block_state(blk) == name]
        labels = []
        for blk in sel:
            if blk["ref_count"] > 1:
                second = f"×{blk['ref_count']}"
            elif blk["owners"]:
                second = style.short_id(blk["owners"][0])
            else:
                second = blk["hash"][:4] if blk["hash"] else ""
            labels.append(f"<b>{blk['id']}</b><br>{second}")
        fig.add_trace(go.Scatter(
            x=[blk["id"] % columns for blk in sel], y=[blk["id"] // columns for blk in sel],
            mode="markers+text", name=f"{name} ({len(sel)})", customdata=[b["id"] for b in sel],
            text=labels, textfont={"size": 10, "color": "white" if name != "free" else "#555"},
            marker={"symbol": "square", "size": cell - 6, "color": color,
                    "line": {"width": 1, "color": "#777" if name == "free" else color}},
            hovertext=[f"block {blk['id']}: {blk['state']}, ref {blk['ref_count']}<br>"
                       f"owners: {', '.join(blk['owners']) or '-'}<br>tokens: {blk['num_tokens']}"
                       f"<br>hash: {blk['hash'] or '-'}" for blk in sel], hoverinfo="text"))
    used = sum(1 for blk in blocks if blk["state"] == "used")
    cached = sum(1 for blk in blocks if blk["state"] == "cached")
    bs = (trace.config.get("block_size") if trace is not None else None) or \
        rec.backend.get("block_size")
    title = (f"tick {rec.tick}: KV block pool, {used} in use, {cached} cached, "
             f"{n - used - cached} free of {n}" + (f" (block_size {bs})" if bs else ""))
    fig.update_layout(**style.base_layout(
        title, width=max(560, cell * columns + 80), height=135 + cell * nrows,
        margin={"l": 40, "r": 20, "t": 60, "b": 80},
        showlegend=True, legend={"orientation": "h", "y": -0.02, "yanchor": "top", "x": 0},
        xaxis={"visible": False, "range": [-0.6, columns - 0.4]},
        yaxis={"visible": False, "range": [nrows - 0.4, -0.6]}))
    return fig

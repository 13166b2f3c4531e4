"""Figures (minserve.inspection.viz) drawn from a saved trace: their data must say what the records say.

Every figure is rendered from a trace read back from JSON (no model), and its data is
compared with the records: the mask heatmap's cells are the backend's mask, each block
sits in the legend entry of its state, each queue column lists its queue in order.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import plotly.graph_objects as go
import pytest

from minserve import SamplingParams
from minserve.inspection import viz
from minserve.inspection.stepper import Stepper
from minserve.inspection.trace import (
    DECODE,
    FINISHED,
    HELD,
    PREFILL,
    Trace,
    TraceRecorder,
    request_states,
)
from minserve.inspection.viz import style

from .conftest import make_engine

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def record(model, **cfg) -> Trace:
    """A shared prefix (prefix-cache hits), more requests than rows (holds), two sessions."""
    rng = random.Random(1)
    prefix = [rng.randrange(1, 256) for _ in range(8)]
    rec = TraceRecorder(make_engine(model, max_batch_size=3, block_size=4, num_blocks=20, **cfg))
    rec.submit(prefix + [9, 9, 9], SamplingParams(max_tokens=5), session_id="a")
    rec.step()  # req-0's prefix blocks are computed: later prompts share them
    for i in range(4):
        tail = [rng.randrange(1, 256) for _ in range(2 + 3 * i)]
        rec.submit(prefix + tail, SamplingParams(max_tokens=3 + i), session_id=("a", "b")[i % 2])
    rec.run()
    return rec.trace()


@pytest.fixture(scope="module")
def traces(tiny_model, tmp_path_factory) -> dict[str, Trace]:
    """Saved and loaded back: the figures below see exactly what a replay sees."""
    out = tmp_path_factory.mktemp("viz")
    cfgs = {"padded": {}, "paged": {"backend": "paged", "policy": "fair"}}
    return {name: Trace.load(record(tiny_model, **cfg).save(out / f"{name}.json"))
            for name, cfg in cfgs.items()}


def test_mask_heatmap_cells_equal_the_backends_mask(traces):
    checked = 0
    for rec in traces["padded"].ticks:
        b = rec.backend
        if not b["row_ids"]:
            continue
        fig = viz.padding(rec)
        mask, pos = fig.data[0], fig.data[1]
        assert [list(r) for r in mask.z] == b["attention_mask"]
        assert list(mask.y) == [f"{rid} ({sum(m)}/{len(m)})"
                                for rid, m in zip(b["row_ids"], b["attention_mask"])]
        for zr, pr, mr in zip(pos.z, b["position_ids"], b["attention_mask"]):
            assert list(zr) == [p if m else -1 for p, m in zip(pr, mr)]  # -1: padding, grey
            real = [p for p, m in zip(pr, mr) if m]
            assert real == list(range(len(real)))  # positions count real tokens only
        assert str(b["padding_tokens"]) in fig.layout.title.text
        checked += 1
    assert checked >= 3


def test_padding_is_drawn_in_the_padding_colour_and_real_tokens_in_another(traces):
    rec = traces["padded"][1]
    heat = viz.padding(rec).data[0]
    assert heat.zmin == 0 and heat.zmax == 1
    low = [c for v, c in heat.colorscale if v < 0.5]
    high = [c for v, c in heat.colorscale if v > 0.5]
    assert set(low) == {style.PAD} and set(high) == {style.REAL}


def test_block_pool_colours_match_block_states(traces):
    seen = set()
    for trace in traces.values():
        for rec in trace.ticks:
            fig = viz.kv_blocks(rec, trace)
            assert sum(len(t.customdata) for t in fig.data) == len(rec.blocks)
            for t, (state, color) in zip(fig.data, viz.BLOCK_STATES):
                assert t.name.startswith(state) and t.marker.color == color
                assert list(t.customdata) == [b["id"] for b in rec.blocks
                                              if viz.block_state(b) == state]
                if len(t.customdata):
                    seen.add(state)
    # the workload reaches every state: free, in use, shared prefix, cached
    assert seen == {s for s, _ in viz.BLOCK_STATES}


def test_shared_prefix_blocks_are_the_ones_in_several_tables(traces):
    trace = traces["paged"]
    hits = 0
    for rec in trace.ticks:
        fig = viz.block_tables(rec, trace)
        if not rec.backend["rows"]:
            continue
        heat, frames = fig.data
        tables = {r["request_id"]: r["block_table"] for r in rec.backend["rows"]}
        for label, row_text in zip(heat.y, heat.text):
            rid = label.split(" ")[0]
            assert [t for t in row_text if t] == [f"#{b}" for b in tables[rid]]
        refs = {b["id"]: b["ref_count"] for b in rec.blocks}
        expected = sorted((i, label) for label, rid in zip(heat.y, tables)
                          for i, b in enumerate(tables[rid]) if refs[b] > 1)
        assert sorted(zip(frames.x, frames.y)) == expected
        hits += len(expected)
    assert hits > 0


def test_batch_draws_the_padding_or_the_block_tables_by_backend(traces):
    assert viz.batch(traces["padded"][0]).data[0].name == "attention_mask"
    assert viz.batch(traces["paged"][0]).data[0].name == "block tables"
    with pytest.raises(ValueError):
        viz.padding(traces["paged"][0])
    with pytest.raises(ValueError):
        viz.block_tables(traces["padded"][0])


def test_queue_columns_list_each_queue_in_order_and_mark_the_held_head(traces):
    held_seen = 0
    for trace in traces.values():
        for rec in trace.ticks:
            fig = viz.queues(rec, trace)
            cols = {t.name: list(t.customdata) for t in fig.data}
            for q in ("pending", "prefilling", "active"):
                assert cols[q] == rec.queues[q]
            left = [e["request_id"] for e in rec.evict.evicted] + \
                [r["request_id"] for r in rec.admit.rejected] + rec.admit.cancelled
            assert cols["left"] == left
            dashed = [s for s in fig.layout.shapes if s.line.dash == "dash"]
            if rec.admit.held:
                held_seen += 1
                assert len(dashed) == 1 and dashed[0].line.color == style.HELD
                gate = rec.admit.held["rejection"]["gate"]
                assert any("held" in a.text and (gate in a.text or "rows busy" in a.text)
                           for a in fig.layout.annotations)
            else:
                assert not dashed
    assert held_seen > 0


def test_every_kind_of_hold_gets_its_numbers_on_the_card():
    """Each soft hold the scheduler can record reads with its own numbers (never 'None')."""
    from minserve import gates
    from minserve.inspection.viz.queues import _gate_line

    holds = [gates.check_kv_budget(600, 3900, 4096), gates.check_block_pool(20, 12, 20, 64),
             gates.batch_slot_hold(8, 8), gates.session_cap_hold("flood", 6, 6)]
    lines = [_gate_line(h.to_dict()) for h in holds]
    assert all("None" not in line for line in lines), lines
    assert lines[3] == "held: its session has 6/6 rows" and "8 rows busy" in lines[2], lines


def test_timeline_draws_what_each_request_did_in_each_tick(traces):
    trace = traces["padded"]
    fig = viz.timeline(trace)
    states = request_states(trace)
    by_name = {t.name: t for t in fig.data}
    labels = {rid: f"{rid} · {trace.session_of(rid)}" for rid in states}
    for state in (PREFILL, DECODE, HELD):
        bars = by_name[state]
        expected = sorted((labels[rid], e["tick"]) for rid, evs in states.items() for e in evs
                          if e["state"] == state)
        # a bar starts at tick - 0.5 (whole or first half) or at tick (second half)
        got = sorted((y, math.floor(b + 0.5 + 1e-9)) for y, b in zip(bars.y, bars.base))
        assert got == expected, state
    ends = by_name[FINISHED]
    evicted = sorted((labels[e["request_id"]], rec.tick) for rec in trace.ticks
                     for e in rec.evict.evicted)
    assert sorted(zip(ends.y, ends.x)) == evicted
    # a request prefilled and decoded in one tick gets a split cell: prefill first
    assert list(by_name[PREFILL].x).count(0.5) > 0


def test_fairness_lines_are_the_service_and_the_vtc_counters(traces):
    trace = traces["paged"]
    fig = viz.fairness(trace)
    lines = {t.name: list(t.y) for t in fig.data}
    for s in ("a", "b"):
        assert lines[f"{s} VTC counter"] == [r.policy["counters"].get(s) for r in trace.ticks]
        served = trace[-1].policy["served"][s]
        assert lines[s][-1] == served["prompt_tokens"] + 2 * served["output_tokens"]
    assert "VTC counter" not in " ".join(t.name for t in viz.fairness(traces["padded"]).data)


def test_work_bars_add_up_to_the_tokens_each_tick_computed(traces):
    trace = traces["padded"]
    fig = viz.work(trace)
    totals = [sum(t.y[i] for t in fig.data if t.type == "bar") for i in range(len(trace))]
    assert totals == [sum(c["end"] - c["start"] for c in r.prefill.chunks) + len(r.decode.rows)
                      for r in trace.ticks]


@pytest.mark.parametrize("mode", ["chunked", "mixed_batch"])
def test_work_figure_counts_the_forward_passes_of_each_tick(tiny_model, mode):
    """Version A: a forward per chunk plus the decode one; Version B: one per tick."""
    from minserve.inspection.trace import TraceRecorder

    engine = make_engine(tiny_model, backend="paged", prefill_mode=mode, prefill_chunk_size=4,
                         max_batch_size=3)
    rec = TraceRecorder(engine)
    for n in (9, 3, 14):
        rec.submit([k % 200 + 1 for k in range(n)], SamplingParams(max_tokens=5))
    rec.run()
    trace = rec.trace()
    counts = next(t for t in viz.work(trace).data if t.type == "scatter" and "forwards" in t.name)
    assert list(counts.text) == [str(len(r.forwards)) if r.forwards else "" for r in trace.ticks]
    most = max(len(r.forwards) for r in trace.ticks)
    assert most == 1 if mode == "mixed_batch" else most > 1


def test_every_figure_accepts_a_record_a_dict_or_a_trace(traces):
    trace = traces["padded"]
    rec = trace[2]
    a = viz.queues(rec).to_dict()
    assert viz.queues(rec.to_dict()).to_dict() == a
    assert viz.kv_blocks(trace).layout.title.text == viz.kv_blocks(trace[-1]).layout.title.text
    for fig in (viz.queues(rec), viz.padding(rec), viz.kv_blocks(rec), viz.timeline(trace),
                viz.fairness(trace), viz.work(trace, durations=True)):
        json.loads(fig.to_json())  # valid plotly, serialisable


def test_stepper_buttons_redraw_the_same_figure_widgets_in_place(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=2, block_size=4, num_blocks=16)
    st = Stepper(engine, figures=("queues", "batch", "kv_blocks", "timeline", "fairness"))
    box = st.widget
    widgets = dict(st._figs)
    assert all(isinstance(w, go.FigureWidget) for w in widgets.values())
    for i in range(3):
        st.add_request(session=("x", "y")[i % 2], max_tokens=3)
    assert list(widgets["queues"].data[0].customdata) == ["req-0", "req-1", "req-2"]
    st.next_phase()  # T1 admit
    assert "after T1 admit" in widgets["queues"].layout.title.text
    assert list(widgets["queues"].data[1].customdata) == ["req-0", "req-1"]  # prefilling
    st.next_phase()  # T2 prefill: both promoted into the padded batch
    assert widgets["batch"].data[0].name == "attention_mask"
    assert len(widgets["batch"].data[0].z) == 2
    st.next_tick()  # finish tick 1
    assert len(engine.trace) == 1 and st.phase == 0
    st.run(50)
    assert not engine.scheduler.has_work()
    assert st._figs == widgets and box is st.widget  # the same objects, redrawn
    assert "tick" in st.status() and engine.stats()["active_kv_reserved"] == 0


# --- the notebooks: lessons that import minserve, stored diff-friendly -------------------------
def _code_cells(path: Path):
    nb = json.loads(path.read_text())
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def test_notebooks_store_no_figure_output_and_define_no_engine_code():
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert len(paths) >= 6
    for path in paths:
        for cell in _code_cells(path):
            src = "".join(cell["source"])
            tags = cell.get("metadata", {}).get("tags", [])
            if "nbval-ignore-output" in tags:
                assert cell["outputs"] == [], (path.name, src[:40])
            for out in cell["outputs"]:
                assert out.get("name") != "stderr", (path.name, src[:40])
                assert "application/vnd.plotly.v1+json" not in out.get("data", {})
            assert "class " not in src, "notebooks import minserve; they never redefine it"
        assert "import minserve" in path.read_text() or "from minserve" in path.read_text()

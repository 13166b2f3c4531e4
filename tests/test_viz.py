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
    REMOTE,
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


def test_stepper_layout_puts_the_timeline_right_under_the_buttons_and_the_text_beside_the_status(
        tiny_model):
    import ipywidgets as w

    st = Stepper(make_engine(tiny_model, max_batch_size=2))
    st.add_request(session="alice")
    box = st.widget
    buttons, adder, info, first_figure = box.children[:4]
    assert {b.description for b in buttons.children if isinstance(b, w.Button)} == {
        "next phase", "next tick", "run N ticks", "reset (fresh engine)"}
    assert "add request" in {b.description for b in adder.children if isinstance(b, w.Button)}
    assert [type(c) for c in info.children] == [w.HTML, w.HTML]  # status | requests' text
    assert first_figure is st._figs["timeline"]
    assert "req-0" in info.children[1].value and "alice" in info.children[1].value


def test_stepper_reset_gives_a_fresh_engine_with_the_opening_requests_queued(tiny_model):
    """The first click after reset does something: the opening requests are pending."""
    engine = make_engine(tiny_model, max_batch_size=2)
    st = Stepper(engine)
    for s in ("alice", "bob", "carol"):
        st.add_request(session=s, max_tokens=3)
    st.run(100)
    assert not engine.scheduler.has_work()
    fresh = st.reset()
    assert fresh is st.engine and fresh is not engine and fresh.model is engine.model
    assert fresh.config == engine.config and fresh.scheduler.tick_count == 0
    assert fresh.stats()["queues"]["pending"] == 3
    admit = st.next_phase()  # the first click
    assert [a["request_id"] for a in admit.admitted] == ["req-0", "req-1"]
    assert [st.recorder.cards[r]["session"] for r in ("req-0", "req-1", "req-2")] == [
        "alice", "bob", "carol"]
    st.run(100)
    assert st.reset(requeue=False).stats()["queues"]["pending"] == 0


def test_stepper_never_shows_a_new_request_beside_an_unexplained_nothing_waiting(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=2)
    st = Stepper(engine)
    st.add_request(session="alice", max_tokens=2)
    assert "waiting in pending for T1 admit: req-0" in st.status()
    st.run(10)  # drained: the last tick's admit said "nothing waiting"
    assert "nothing waiting" in st.status() and "idle" in st.status()
    st.add_request(session="bob")
    status = st.status()
    assert "previous tick" in status and "waiting in pending for T1 admit: req-1" in status
    assert "idle" not in status
    st.next_phase()  # T1 admits req-1; then a request arrives mid-tick
    st.add_request(session="carol")
    assert "arrived after this tick's T1 ran): req-2" in st.status()
    st.next_tick()  # the tick ends; req-2 still waits for a T1 admit
    assert "waiting in pending for T1 admit: req-2" in st.status()


def test_stepper_shows_each_sessions_share_who_borrows_and_who_is_held_back(tiny_model):
    """With shares on (SPEC H6) the status says, per session, what it holds of its share
    now: a lone flood borrows the batch; a newcomer's arrival makes it give rows back."""
    st = Stepper(make_engine(tiny_model, max_batch_size=4, shares="equal"))
    assert st.shares() == ""  # nobody wants anything yet
    for _ in range(6):
        st.add_request(session="flood", max_tokens=8)
    st.next_tick()
    assert "flood: 4 rows of a 4-row share" in st.status()
    st.add_request(session="alice", max_tokens=2)
    text = st.status()
    assert "flood: 4 rows of a 2-row share" in text and "borrowing" in text
    assert "held back while one under its share waits" in text
    assert "alice: 0 rows of a 2-row share" in text
    assert Stepper(make_engine(tiny_model, max_batch_size=2)).shares() == ""  # shares off


def test_stepper_requests_without_a_tokenizer_get_varied_lengths_and_show_their_token_ids(
        tiny_model):
    st = Stepper(make_engine(tiny_model, max_batch_size=4), prompt_len=12)
    for _ in range(4):
        st.add_request(max_tokens=4)
    lengths = [r["prompt_tokens"] for r in st.requests()]
    assert len(set(lengths)) > 1 and all(4 <= n <= 24 for n in lengths), lengths
    st.run(2)
    shown = {r["id"]: r["text"] for r in st.requests()}
    ids = {rid: [ev.token_id for ev in h.events if ev.token_id is not None]
           for rid, h in st.recorder.handles.items()}
    assert all(shown[rid] == " ".join(map(str, ids[rid])) and ids[rid] for rid in ids), shown


@pytest.mark.real_model
def test_stepper_sends_real_questions_of_varied_length_and_shows_each_answer_as_it_grows(
        real_model):
    from minserve.inspection.stepper import EXAMPLE_PROMPTS

    model, tokenizer = real_model
    st = Stepper(make_engine(model, tokenizer, max_batch_size=4))
    st.add_request(session="alice", max_tokens=4)  # plain text
    st.add_request(session="bob", max_tokens=4, chat=True)  # through the chat template
    st.add_request("Hello!", session="carol", max_tokens=4)
    cards = st.recorder.cards
    assert cards["req-0"]["prompt"] == EXAMPLE_PROMPTS[0]
    assert len({c["prompt_len"] for c in cards.values()}) == 3  # padding shows
    st.run(2)
    early = {r["id"]: r["text"] for r in st.requests()}
    st.run(20)
    late = {r["id"]: r["text"] for r in st.requests()}
    for rid, h in st.recorder.handles.items():
        assert late[rid] == h.output.text and late[rid].startswith(early[rid]), (early, late)
    assert any(len(late[r]) > len(early[r]) > 0 for r in late), (early, late)


# --- figures fit the output area; colours mean one thing each ------------------------------------
def all_figures(trace):
    rec = trace[2]
    big = dict(rec.to_dict(), blocks=[dict(b, id=i) for i, b in
                                      enumerate((rec.blocks * 40)[:128])])
    yield from [viz.queues(rec, trace), viz.batch(rec), viz.kv_blocks(rec),
                viz.kv_blocks(big), viz.timeline(trace), viz.fairness(trace), viz.work(trace),
                viz.work({"one": trace, "two": trace}), viz.tick_times({"a": trace}),
                viz.style.empty("nothing")]


def test_no_figure_is_wider_than_a_jupyterlab_output_area(traces):
    """JupyterLab's output area is ~968 px with the file browser open (1400 px window):
    figures leave their width to the area (autosize), or stay at or under MAX_WIDTH."""
    for trace in traces.values():
        for fig in all_figures(trace):
            width = fig.layout.width
            assert width is None or width <= style.MAX_WIDTH, (fig.layout.title.text, width)
            if width is None:
                assert fig.layout.autosize is not False
    with pytest.raises(ValueError, match="clipped"):
        style.base_layout("too wide", width=1000)


def test_a_session_keeps_its_colour_in_every_figure_whatever_the_arrival_order(tiny_model):
    def run(order):
        rec = TraceRecorder(make_engine(tiny_model, max_batch_size=1, policy="fair"))
        for s in order:
            rec.submit([5, 6, 7], SamplingParams(max_tokens=2), session_id=s)
        rec.step()
        return rec.trace()

    for order in (("alice", "bob", "zed"), ("zed", "bob", "alice")):
        trace = run(order)
        fair = {t.name: t.line.color for t in viz.fairness(trace).data if t.name in order}
        q = viz.queues(trace[0], trace)
        legend = {t.name: t.marker.color for t in q.data if t.meta == "session"}
        card = {s.fillcolor for s in q.layout.shapes if s.fillcolor != "rgba(0,0,0,0)"}
        assert card == set(legend.values())
        assert fair == legend == {s: viz.session_color(s) for s in order}
    assert len({viz.session_color(s) for s in style.CAST}) == len(style.CAST)
    states = {style.PAD, style.REAL, style.SHARED, style.CACHED, style.HELD, style.PREFILL,
              style.PREFILL_WAIT, style.QUEUED, style.DONE}
    assert not states & set(style.SESSION_PALETTE), "a session colour must not read as a state"


def test_queue_cards_say_what_their_colours_mean(traces):
    trace = traces["paged"]
    rec = next(r for r in trace.ticks if r.admit.held)
    fig = viz.queues(rec, trace)
    on_cards = {rec.requests[rid]["session"] for q in ("pending", "prefilling", "active")
                for rid in rec.queues[q]}
    legend = {t.name for t in fig.data if t.meta == "session"}
    assert legend == on_cards and fig.layout.showlegend
    assert any("held by a gate" in (t.name or "") for t in fig.data)


def test_work_draws_several_runs_on_one_y_scale_where_decode_tokens_show(traces):
    runs = {"padded": traces["padded"], "paged": traces["paged"]}
    fig = viz.work(runs)
    axes = [fig.layout.yaxis, fig.layout.yaxis2]
    assert axes[0].range == axes[1].range and {a.type for a in axes} == {"log"}
    decode = [t for t in fig.data if t.name.startswith("decode tokens")]
    assert len(decode) == 2 and [t.showlegend for t in decode] == [True, False]
    top = max(sum(t.y[i] for t in fig.data if t.type == "bar" and t.yaxis == "y")
              for i in range(len(runs["padded"])))
    assert 10 ** axes[0].range[1] >= top and 10 ** axes[0].range[0] < 1  # one decode token shows


def test_tick_times_draws_every_ticks_wall_time_coloured_by_what_it_ran(traces):
    trace = traces["padded"]
    line = viz.tick_times({"run": trace}).data[0]
    assert list(line.y) == [1000 * r.duration_s for r in trace.ticks]
    assert list(line.marker.color) == [style.PREFILL if r.prefill.chunks else style.REAL
                                       for r in trace.ticks]


def test_the_stepper_clears_subplot_titles_when_the_batch_figure_empties():
    """The stepper redraws its FigureWidgets in place; the browser merges a new layout
    into the old one, so a padded batch's two subplot titles stayed over the empty-batch
    figure. `redraw` resets, in the message the browser gets, what the new layout lacks."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from minserve.inspection.panel import redraw

    fw = go.FigureWidget(make_subplots(rows=2, cols=1, subplot_titles=("mask", "positions")))
    sent: list[dict] = []
    fw._send_relayout_msg = lambda data, source_view_id=None: sent.append(dict(data))
    redraw(fw, viz.style.empty("tick 9: the padded decode batch is empty"))
    assert sent and sent[0].get("annotations") == [], sent  # before the new layout
    assert not fw.layout.annotations and fw.layout.title.text.startswith("tick 9")


def test_sessions_of_one_figure_get_distinct_colours_even_when_their_ids_hash_alike():
    """Two demo tabs ("user-" + a session hash) once drew in one colour: ids whose hash
    picks the same palette entry now get the next free one, in a fixed order."""
    from minserve.inspection.viz import style

    by_colour: dict[str, list[str]] = {}
    for i in range(50):
        by_colour.setdefault(style.session_color(f"user-{i:06x}"), []).append(f"user-{i:06x}")
    a, b = next(ids for ids in by_colour.values() if len(ids) >= 2)[:2]
    assert style.session_color(a) == style.session_color(b)
    for order in ([a, b, "alice"], ["alice", b, a]):
        colours = style.session_colors(sessions=order)
        assert len(set(colours.values())) == 3, colours
        assert colours == style.session_colors(sessions=[a, b, "alice"])  # order-free
    assert colours["alice"] == style.session_color("alice")  # the cast keeps its colour


# --- disaggregated prefill (SPEC C2): the prefill worker in the stepper and the figures ------
@pytest.fixture(scope="module")
def disagg_engine():
    """A disaggregated engine: it starts a prefill worker process (~3 s), so one per module.
    Its own model: the worker gets the model by pickling, and the session's `tiny_model`
    may carry another test's patched layers, which do not pickle."""
    from minserve.models import tiny_llama

    engine = make_engine(tiny_llama(eos_token_id=0), backend="paged", block_size=4, max_batch_size=4,
                         max_model_len=256, prefill_mode="disaggregated",
                         prefill_worker_threads=1)
    yield engine
    engine.close()


def test_the_stepper_shows_a_prompt_on_the_prefill_worker_then_its_transfer_and_promotion(
        disagg_engine):
    """Phase by phase: after the T2 that sends it, the row's prompt is named as on the
    prefill worker (the tick's line and the worker's line); the T2 that brings its KV back
    names the transfer (blocks, bytes, ms, the worker's ms) and the promotion."""
    engine, s = disagg_engine, disagg_engine.scheduler
    st = Stepper(engine)
    h = st.add_request(list(range(30, 130)), max_tokens=3)  # 100 tokens: 25 blocks of 4
    rid = h.request_id
    st.next_phase()  # T1 admits it
    assert "prefill worker: no prompt on it" in st.status()
    st.next_phase()  # T2 sends it
    text = st.status()
    assert f"sent to the prefill worker: {rid}" in text, text
    assert f"prefill worker: {rid} (100 tokens, " in text, text
    card = next(c for c in viz.queues(st.view()).layout.annotations if f"<b>{rid}</b>" in c.text)
    assert "on the prefill worker" in card.text, card.text
    for _ in range(400):  # until the worker is done and T2 splices its KV in
        if h.events:  # its first token: posted by the T2 that promoted it
            break
        st.next_phase()
    assert st.last_phase.startswith("T2"), st.last_phase
    text = st.status()
    moved = 25 * 4 * s.backend.storage.bytes_per_token()
    assert f"{rid} tokens 0..100 on the prefill worker (computed there in " in text, text
    assert f"KV moved in: 25 blocks, {moved:,} bytes in " in text, text
    assert f"promoted to active: {rid}" in text, text
    card = next(c for c in viz.queues(st.view()).layout.annotations if f"<b>{rid}</b>" in c.text)
    assert f"KV moved in: 25 blocks, {moved:,} B" in card.text, card.text
    st.run(50)
    assert h.finished and s.is_drained()


def test_the_timeline_draws_ticks_on_the_prefill_worker_hatched_and_the_transfer_on_hover(
        disagg_engine):
    """A disaggregated trace, saved and loaded: the row is "on prefill worker" from the
    tick it was sent until the tick its KV came back, drawn in the prefill colour,
    hatched; that last tick's prefill bar says what the move cost."""
    rec = TraceRecorder(disagg_engine)
    h = rec.submit(list(range(40, 80)), SamplingParams(max_tokens=2))  # 40 tokens: 10 blocks
    rec.run()
    trace = Trace.from_dict(json.loads(json.dumps(rec.trace().to_dict())))
    events = request_states(trace)[h.request_id]
    kinds = [e["state"] for e in events]
    remote = [e for e in events if e["state"] == REMOTE]
    assert remote and "sent this tick" in remote[0]["detail"], events
    assert kinds.index(PREFILL) > kinds.index(REMOTE), kinds
    fig = viz.timeline(trace)
    bars = {t.name: t for t in fig.data}
    assert bars[REMOTE].marker.color == style.PREFILL and bars[REMOTE].marker.pattern.shape
    label = f"{h.request_id} · default"
    assert list(bars[REMOTE].y).count(label) == len(remote)
    hover = " ".join(bars[PREFILL].hovertext)
    assert "on the prefill worker; computed there in " in hover and "KV moved in: 10 blocks" in hover
    assert REMOTE not in {t.name for t in viz.timeline(Trace()).data}  # other modes: no entry
    # a recorder on an engine that already ran starts at its tick: the axis starts there
    late = Trace(config=trace.config, ticks=trace.ticks[2:])
    assert viz.timeline(late).layout.xaxis.range[0] == late.ticks[0].tick - 0.6
    assert f"over {len(late.ticks)} ticks" in viz.timeline(late).layout.title.text

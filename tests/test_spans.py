"""Where a served token's time goes (minserve/spans.py): off unless asked; when on, every
tick is cut at its phases in order, every token is stamped on its way to the client (the
worker's detokenise and push, the server's SSE stream), and the summary charges each
token the cycle of the tick that produced it."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve import SamplingParams
from minserve.spans import ENV, PHASES, Spans, from_env, summary

from .conftest import make_engine, run_checked


def test_spans_are_off_unless_minserve_spans_names_a_file(tiny_model, monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    engine = make_engine(tiny_model, backend="paged")
    h = engine.submit([5, 6, 7], SamplingParams(max_tokens=3))
    assert engine.spans is None and engine.scheduler.spans is None and h.spans is None
    run_checked(engine)
    assert from_env({}) is None and from_env({ENV: ""}) is None
    assert from_env({ENV: str(tmp_path / "s.json")}).path == tmp_path / "s.json"


def test_every_tick_is_cut_at_its_phases_in_order_and_every_token_is_stamped(tiny_model):
    engine = make_engine(tiny_model, backend="paged", model_runner="compact",
                         decode_attention="kernel", prefill_mode="mixed_batch",
                         prefill_chunk_size=4, max_batch_size=2, block_size=8)
    spans = Spans()
    engine.set_spans(spans)
    handles = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True))
               for p, n in (([5, 6, 7, 8, 9, 10], 5), ([11, 12], 7), ([13] * 9, 4))]
    while engine.scheduler.has_work():
        engine.step()  # whole ticks (run_checked runs the phases one by one)
    assert len(spans.ticks) == engine.scheduler.tick_count
    for tick in spans.ticks:
        phases = [p for p, _ in tick["marks"]]
        assert phases == [p for p in PHASES if p in phases]  # in the tick's order, once each
        assert {"admit", "prefill", "evict", "record"} <= set(phases)
        times = [tick["start"]] + [t for _, t in tick["marks"]]
        assert times == sorted(times)
    assert any(t["chunk_tokens"] and t["rows"] for t in spans.ticks)  # a mixed forward
    for h in handles:
        for i in range(len(h.output.token_ids)):
            tok = spans.tokens[(h.request_id, i)]
            assert tok["detok"] <= tok["pushed"] <= tok["done"]
    assert len(spans.tokens) == engine.stats()["tokens_generated"]
    s = spans.summary()
    assert s["tokens"] > 0 and s["per_token_s"]["forward"] > 0
    assert s["cycle_s"] == pytest.approx(sum(s["per_token_s"].values()))
    assert all(v >= -1e-9 for v in s["per_token_s"].values())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.floats(1e-4, 0.01), min_size=9, max_size=9),
                          st.floats(1e-4, 0.005), st.integers(1, 3)), min_size=2, max_size=8))
def test_the_summary_charges_each_token_the_cycle_of_its_tick(ticks):
    """Synthetic ticks of known phase lengths, a gap after each, and `rows` tokens pushed
    in each tick's post phase: every token after a request's first is charged its
    tick's phases and the gap after it, its detokenise and push taken out of post."""
    phases = ("admit", "prefill", "evict", "setup", "forward", "chunks", "sample", "post",
              "record")
    data, t, want, charged = {"ticks": [], "tokens": []}, 0.0, {}, 0
    for k, (lengths, gap, rows) in enumerate(ticks):
        start, marks = t, []
        for phase, sec in zip(phases, lengths):
            t += sec
            marks.append((phase, t))
        data["ticks"].append({"start": start, "marks": marks, "rows": rows, "chunk_tokens": 0})
        post_start, d = marks[6][1], lengths[7] / (3 * rows + 1)  # d: a detokenise, a push
        for r in range(rows):  # row r's token k, strictly inside post
            detok = post_start + (3 * r + 1) * d
            data["tokens"].append({"request_id": f"r{r}", "index": k, "detok": detok,
                                   "pushed": detok + d, "done": detok + 2 * d})
        t += gap
        if k == 0 or k == len(ticks) - 1:  # first tokens (TTFT's); the last tick has no gap
            continue
        charged += rows
        cycle = dict(zip(phases, lengths), gap=gap, detokenise=rows * d, push=rows * d)
        cycle["post"] -= 2 * rows * d
        for part, sec in cycle.items():
            want[part] = want.get(part, 0.0) + rows * sec
    s = summary(data)
    assert s["tokens"] == charged
    for part, total in want.items():
        assert s["per_token_s"][part] == pytest.approx(total / charged, abs=1e-9), part
    if charged:
        assert s["cycle_s"] == pytest.approx(sum(want.values()) / charged)


def test_the_server_stamps_each_token_when_its_sse_chunk_is_written():
    from minserve import Engine, EngineConfig
    from minserve.server.api import create_app
    from minserve.server.cli import BackgroundServer

    from .test_server import tiny_chat

    model, tokenizer = tiny_chat()
    engine = Engine(EngineConfig(device="cpu", max_batch_size=2), model=model, tokenizer=tokenizer)
    engine.set_spans(Spans())
    body = {"prompt": [100, 101, 102], "max_tokens": 6, "ignore_eos": True, "stream": True}
    with BackgroundServer(create_app(engine)) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            assert sum(line.startswith("data:") for line in r.iter_lines()) >= 2
    sent = {i: t for (req, i), t in engine.spans.tokens.items() if req == rid and "got" in t}
    assert sent  # every token but the first (its chunk goes out before the stream loop)
    for tok in sent.values():
        assert tok["pushed"] <= tok["got"] <= tok["sent"]
    assert summary(engine.spans.to_dict())["push_to_sse_s"] >= 0


def test_minserve_spans_writes_its_file_when_the_engine_stops(tiny_model, monkeypatch,
                                                              tmp_path):
    path = tmp_path / "spans.json"
    monkeypatch.setenv(ENV, str(path))
    engine = make_engine(tiny_model, backend="paged")
    assert engine.spans is not None and engine.scheduler.spans is engine.spans
    engine.start()
    try:
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    finally:
        engine.stop()
    data = json.loads(path.read_text())
    assert data["ticks"] and len(data["tokens"]) == 4 and data["dropped"] == 0

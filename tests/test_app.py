"""The Gradio chat demo (SPEC H4): real HTTP, real streaming, through `gradio_client`.

Most tests launch `app.build_app(engine)` in this process on a free loopback
port, over a tiny random Llama with the real SmolLM2 tokenizer (its chat
template). In-process because the tests need the engine itself: to pause its
worker (a full queue that stays full), to read its tick records (two sessions
in one decode batch) and to check it drained after a Stop (R2). The model is
random, so its "words" are nonsense, but every token is a real sampled token
streamed through the real scheduler. One `real_model` test runs `python app.py`
itself, as a user would, on the embedded SmolLM2.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gradio_client import Client

import app as chat_demo
from minserve import Engine, EngineConfig
from minserve.chat.logic import (
    APP_DEFAULTS,
    FLOOD_DEFAULTS,
    NOISY_SESSION,
    NOTICE,
    STOPPED,
    WAITING,
    app_defaults,
    chat_messages,
    friendly_refusal,
    text_of,
    waiting_words,
)

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chat_model():
    """A tiny random Llama over SmolLM2's vocabulary, and SmolLM2's real tokenizer."""
    from transformers import AutoTokenizer

    from minserve.models import embedded_model_dir, tiny_llama

    return tiny_llama(vocab_size=49152), AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture
def serve(chat_model):
    """serve(**EngineConfig knobs) -> (engine, url, chat_app): the app on 127.0.0.1, a free
    port; closed after the test."""
    started = []

    def _serve(**cfg):
        cfg.setdefault("device", "cpu")
        cfg.setdefault("policy", "fair")
        engine = Engine(EngineConfig(**cfg), model=chat_model[0], tokenizer=chat_model[1])
        demo = chat_demo.build_app(engine)
        port = free_port()
        chat_demo.launch(demo, "127.0.0.1", port, prevent_thread_lock=True, quiet=True)
        started.append(demo)
        return engine, f"http://127.0.0.1:{port}/", demo.chat_app

    yield _serve
    for demo in started:
        demo.chat_app.close()
        demo.close()


def reply_of(output) -> str:
    """The last assistant message's text from the chat endpoint's (history, box, status)."""
    history = output[0]
    return text_of(history[-1]["content"]) if history and history[-1]["role"] == "assistant" else ""


def wait_for(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_two_browser_sessions_stream_concurrently_as_two_fair_sessions(serve):
    engine, url, _ = serve(max_batch_size=4)
    clients = [Client(url, verbose=False) for _ in range(2)]  # two Gradio sessions
    jobs = [c.submit(f"Hello, I am user {i}", [], 0.0, 96, api_name="/chat")
            for i, c in enumerate(clients)]
    for job in jobs:
        job.result(timeout=60)
        outs = job.outputs()  # every update the client received, in order
        streamed = [reply_of(o) for o in outs if reply_of(o) not in ("", "…")]
        assert len(streamed) > 1, "the reply did not stream (one update only)"
        assert len(streamed[-1]) > len(streamed[0]), "the streamed text did not grow"
        assert streamed[-1] and not streamed[-1].startswith(NOTICE)
        assert "96 tokens" in outs[-1][2]  # the status line reports the finished request
    # Two sessions, each a fair-policy tenant (H4), decoded in the same batch at least once.
    ticks = engine.trace.ticks()
    sessions = set(engine.stats()["policy"]["counters"])
    assert len(sessions) == 2 and all(s.startswith("user-") for s in sessions)
    assert any(len({t.requests[r]["session"] for r in t.decode.rows if r in t.requests}) == 2
               for t in ticks), "the two chats were never in one decode batch"
    assert wait_for(engine.scheduler.is_drained)


def test_full_queue_refusal_is_a_friendly_message_naming_g1(serve):
    engine, url, _ = serve(max_batch_size=1, max_queue_size=2)
    client = Client(url, verbose=False)
    engine.stop()  # pause the worker: the flood fills the queue and it stays full
    client.predict(8, 8, 16, 30, api_name="/flood_start")
    assert wait_for(lambda: engine.stats()["queues"]["pending"] == 2)
    out = client.predict("Are you there?", [], 0.0, 16, api_name="/chat")
    assert reply_of(out) == (NOTICE + "The server is busy: the waiting queue is full "
                             "(G1: 2/2 pending). Try again in a moment.")
    assert "refused by G1" in out[2]
    client.predict(api_name="/flood_stop")
    engine.start()
    assert wait_for(engine.scheduler.is_drained)
    book = engine.stats()["rejected"]
    assert book["G1"] >= 1


def test_request_that_can_never_fit_is_refused_naming_g2_without_retry_advice(serve):
    engine, url, _ = serve(kv_budget_tokens=512)
    out = Client(url, verbose=False).predict("Hi", [], 0.0, 512, api_name="/chat")
    text = reply_of(out)
    assert text.startswith(NOTICE + "This message can never fit") and "(G2)" in text
    assert "more than the whole budget of 512" in text and "Try again" not in text
    assert wait_for(engine.scheduler.is_drained)


def test_stop_cancels_the_request_and_the_engine_drains(serve):
    engine, url, _ = serve()
    client = Client(url, verbose=False)
    job = client.submit("Tell me a long story", [], 0.0, 500, api_name="/chat")
    assert wait_for(lambda: len(job.outputs()) >= 3), "no tokens streamed"
    answer = client.predict(api_name="/stop")  # it waits for the eviction (next tick)
    assert answer.endswith("stopped") and "stopping" not in answer, answer
    final = job.result(timeout=30)
    text = reply_of(final)
    assert text.endswith(STOPPED) and final[2].endswith("stopped"), final[2]
    assert wait_for(engine.scheduler.is_drained), "the stopped request still holds resources"
    assert engine.stats()["tokens_generated"] < 500
    engine.check_invariants()


def test_stop_on_a_queued_request_says_stopped_not_stopping(serve):
    """A queued request's cancel is immediate, so the chat's own last status line comes
    *before* Stop's answer, and the page shows whichever comes last: Stop must answer
    with the final state, or the status says "stopping" for as long as the page is open."""
    engine, url, _ = serve(max_batch_size=1)
    client = Client(url, verbose=False)
    client.predict(1, 1, 512, 60, api_name="/flood_start")  # holds the only row
    assert wait_for(lambda: engine.stats()["queues"]["active"] == 1)
    job = client.submit("Hello there", [], 0.0, 64, api_name="/chat")
    assert wait_for(lambda: engine.stats()["queues"]["pending"] == 1), "the chat is not queued"
    answer = client.predict(api_name="/stop")
    final = job.result(timeout=30)
    assert answer.endswith("stopped") and "stopping" not in answer, answer
    assert final[2].endswith("stopped") and reply_of(final).endswith(STOPPED), final[2]
    assert engine.stats()["queues"]["active"] == 1, "Stop in one session hit another's request"
    client.predict(api_name="/flood_stop")
    assert wait_for(engine.scheduler.is_drained)


def test_the_sessions_table_counts_tokens_of_a_reply_still_streaming(serve):
    engine, url, chat_app = serve()
    client = Client(url, verbose=False)
    job = client.submit("Tell me a long story", [], 0.0, 400, api_name="/chat")
    assert wait_for(lambda: len(job.outputs()) >= 4), "no tokens streamed"
    rows = chat_demo.LivePanel(chat_app).render("nobody")[1]
    mine = [r for r in rows if r[0].startswith("user-")]
    assert mine and mine[0][2] == 1 and mine[0][3] == 0, rows  # running, none done yet
    assert mine[0][4] > 0, f"tokens column {mine[0][4]} for a reply that is streaming"
    client.predict(api_name="/stop")
    job.result(timeout=30)
    assert wait_for(engine.scheduler.is_drained)


def test_the_panel_draws_a_sentence_before_the_first_tick_and_every_id_has_a_legend(serve):
    """No empty plot boxes on a fresh page; and every requirement id the page can show
    (policy line, note, summary, refusals, every panel figure under a flood) is one the
    legend explains, from docs/spec.md."""
    engine, url, chat_app = serve(max_batch_size=4, kv_budget_tokens=200)
    panel = chat_demo.LivePanel(chat_app)
    figs = panel.render("nobody")[2:2 + len(chat_demo.PANEL_FIGURES)]
    assert all("no tick yet" in f.layout.annotations[0].text for f in figs)
    client = Client(url, verbose=False)
    client.predict(12, 8, 64, 60, api_name="/flood_start")
    assert wait_for(lambda: engine.stats()["kv_admit_blocked"]["G2"] > 0), "no G2 hold to show"
    panel._parts = None  # rebuild now
    summary, _, *figs = panel.render("nobody")[:2 + len(chat_demo.PANEL_FIGURES)]
    client.predict(api_name="/flood_stop")
    page = " ".join([summary, chat_demo.TABLE_NOTE, *chat_demo.POLICY_LINES.values(),
                     *(f.to_json() for f in figs),
                     *(friendly_refusal({"gate": g, "numbers": {}}) for g in ("G1", "G2", "G3"))])
    shown = set(re.findall(r"\b[QTPGCRBKDHA][0-9]\b", page))
    assert shown and shown <= set(chat_demo.PAGE_IDS), shown - set(chat_demo.PAGE_IDS)
    legend = chat_demo.spec_legend()
    for rid in chat_demo.PAGE_IDS:
        line = next(x for x in legend.splitlines() if x.startswith(f"- **{rid}** "))
        assert "see docs/spec.md" not in line and len(line) > 30, line
    assert wait_for(engine.scheduler.is_drained)


def test_chat_abandoned_mid_stream_frees_its_row(serve):
    """The client goes away (here: cancels its job): Gradio closes the generator, whose
    `finally` cancels the request, so the row is evicted and its KV released (H3)."""
    engine, url, _ = serve()
    client = Client(url, verbose=False)
    job = client.submit("Tell me a long story", [], 0.0, 500, api_name="/chat")
    assert wait_for(lambda: len(job.outputs()) >= 3), "no tokens streamed"
    assert job.cancel()
    assert wait_for(engine.scheduler.is_drained), "the abandoned request still holds resources"
    assert engine.stats()["tokens_generated"] < 500


def test_noisy_neighbour_is_bounded_and_stoppable(serve):
    engine, url, chat_app = serve(max_batch_size=2)
    client = Client(url, verbose=False)
    client.predict(3, 3, 8, 60, api_name="/flood_start")  # bounded: ends by itself
    assert wait_for(lambda: not chat_app.noisy.running)
    assert chat_app.noisy.state == "done" and chat_app.noisy.counts["done"] == 3
    assert engine.stats()["policy"]["counters"][NOISY_SESSION] > 0
    client.predict(5, 2, 400, 60, api_name="/flood_start")  # long: stopped by hand
    assert wait_for(lambda: engine.stats()["queues"]["active"] == 2)
    assert "already flooding" in client.predict(5, 2, 400, 60, api_name="/flood_start")
    status = client.predict(api_name="/flood_stop")
    assert status.startswith("**stopped**") and "in flight 0" in status
    assert "stopped 2" in status
    assert wait_for(engine.scheduler.is_drained)


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_noisy_backlog_is_overtaken_by_a_chat_under_fair_but_not_fcfs(serve, policy):
    """The demo's point (P1 vs P2), read from the tick records: when the chat's request is
    admitted, are noisy requests that arrived *before* it still waiting?"""
    engine, url, chat_app = serve(policy=policy, max_batch_size=4)
    client = Client(url, verbose=False)
    client.predict(24, 16, 64, 60, api_name="/flood_start")
    assert wait_for(lambda: engine.stats()["queues"]["pending"] >= 8)
    out = client.predict("Hello", [], 0.0, 8, api_name="/chat")
    mine = next(w for w in out[2].split(" · ") if w.startswith("req-"))
    admitted = [t for t in engine.trace.ticks()
                if any(a["request_id"] == mine for a in t.admit.admitted)]
    assert len(admitted) == 1
    seq = int(mine.split("-")[1])
    overtaken = [r for r in admitted[0].queues["pending"] if int(r.split("-")[1]) < seq]
    client.predict(api_name="/flood_stop")
    if policy == "fair":
        assert overtaken, "under fair, the chat should go ahead of the noisy backlog"
    else:
        assert not overtaken, f"under fcfs, {overtaken} arrived first and should go first"
    assert wait_for(engine.scheduler.is_drained)


def test_a_light_user_gets_a_row_at_the_next_tick_under_the_demos_defaults(serve):
    """The demo's engine (APP_DEFAULTS: fair + a row cap per session) under its default
    flood: the flood never holds more than its cap of the batch, so a chat is admitted
    at the tick after it arrives instead of waiting for a flood reply to finish
    (docs/demo.md, "How long a light user waits", times the same on the real model)."""
    cap = APP_DEFAULTS["max_rows_per_session"]
    engine, url, chat_app = serve(**{**APP_DEFAULTS, "max_batch_size": 8})
    client = Client(url, verbose=False)
    # long replies, so without the cap no flood row would free for dozens of ticks
    client.predict(FLOOD_DEFAULTS["total"], FLOOD_DEFAULTS["in_flight"], 256, 60,
                   api_name="/flood_start")
    assert wait_for(lambda: engine.stats()["queues"]["pending"] >= 8)
    out = client.predict("Hello", [], 0.0, 8, api_name="/chat")
    client.predict(api_name="/flood_stop")
    mine = next(w for w in out[2].split(" · ") if w.startswith("req-"))
    ticks = engine.trace.ticks()
    seen = next(i for i, t in enumerate(ticks)
                if any(mine in t.queues.get(q, []) for q in ("pending", "prefilling", "active"))
                or any(a["request_id"] == mine for a in t.admit.admitted))
    admitted = next(i for i, t in enumerate(ticks)
                    if any(a["request_id"] == mine for a in t.admit.admitted))
    assert admitted - seen <= 1, f"the chat waited {admitted - seen} ticks for a row"
    flood_rows = [sum(r != mine for q in ("prefilling", "active") for r in t.queues.get(q, []))
                  for t in ticks]
    assert max(flood_rows) == cap, f"the flood held {max(flood_rows)} rows; its cap is {cap}"
    assert wait_for(engine.scheduler.is_drained)


def test_history_sent_to_the_model_drops_the_apps_own_notices():
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": NOTICE + "The server is busy"},
               {"role": "user", "content": [{"type": "text", "text": "hello"}]},
               {"role": "assistant", "content": "Hi there\n\n" + STOPPED},
               {"role": "user", "content": "more"}]
    assert chat_messages(history, keep=12) == [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "more"}]
    assert chat_messages(history, keep=2) == [{"role": "user", "content": "more"}]


def test_flags_beat_environment_beat_app_defaults():
    args = chat_demo.parse_args(["--max-batch-size", "3", "--port", "9999"])
    cfg, host, port = chat_demo.config_from_args(args, env={"MINSERVE_MAX_BATCH_SIZE": "5",
                                                            "MINSERVE_PREFILL_CHUNK_SIZE": "32"})
    assert (cfg.max_batch_size, cfg.prefill_chunk_size, cfg.prefill_mode) == (3, 32, "chunked")
    assert (cfg.policy, cfg.max_queue_size, host, port) == ("fair", 64, "127.0.0.1", 9999)
    cfg, host, port = chat_demo.config_from_args(
        chat_demo.parse_args([]), env={"MINSERVE_POLICY": "fcfs", "MINSERVE_APP_PORT": "7000"})
    assert (cfg.policy, port) == ("fcfs", 7000)
    with pytest.raises(SystemExit):
        chat_demo.parse_args(["--policy", "lottery"])


@pytest.mark.real_model
def test_python_app_py_serves_two_concurrent_chats_on_the_embedded_model(tmp_path):
    port = free_port()
    env = dict(os.environ, MINSERVE_APP_PORT=str(port), GRADIO_ANALYTICS_ENABLED="False")
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "app.py", "--max-batch-size", "4"], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        assert wait_for(lambda: proc.poll() is None and _up(url), timeout=180), \
            (tmp_path / "app.log").read_text()[-3000:]
        clients = [Client(url, verbose=False) for _ in range(2)]
        questions = ["What is the capital of France?", "Name three colours."]
        jobs = [c.submit(q, [], 0.0, 32, api_name="/chat") for c, q in zip(clients, questions)]
        for job in jobs:  # both run at once: submit() returns at once, the server streams
            job.result(timeout=120)
            texts = [reply_of(o) for o in job.outputs() if reply_of(o) not in ("", "…")]
            assert len(texts) > 1 and texts[-1] and not texts[-1].startswith(NOTICE)
        assert "Paris" in reply_of(jobs[0].outputs()[-1])
        printed = (tmp_path / "app.log").read_text()
        assert f"http://127.0.0.1:{port}" in printed, printed  # where to point the browser
        # ... and no clutter: Gradio's share=True hint, transformers' weight-loading bar
        assert "share=True" not in printed and "Loading weights" not in printed, printed
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _up(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_waiting_user_is_told_why_instead_of_a_spinner(serve):
    """Before its first token the chat bubble says where the request is and what holds
    it (engine.explain), refreshed while it waits."""
    engine, url, _ = serve(max_batch_size=1)
    client = Client(url, verbose=False)
    client.predict(1, 1, 512, 60, api_name="/flood_start")  # holds the only row
    assert wait_for(lambda: engine.stats()["queues"]["active"] == 1)
    engine.stop()  # ... and keeps it: on a busy machine its 512 tokens could end first
    job = client.submit("Hello there", [], 0.0, 8, api_name="/chat")
    said = lambda: [reply_of(o) for o in job.outputs()]  # noqa: E731
    assert wait_for(lambda: any("batch is full: 1/1 rows are running, all of them "
                                f"{NOISY_SESSION}'s" in t for t in said())), said()
    engine.start()
    waiting = next(o for o in job.outputs() if "batch is full" in reply_of(o))
    assert reply_of(waiting).startswith(WAITING) and waiting[2].endswith("pending"), waiting
    client.predict(api_name="/flood_stop")
    final = job.result(timeout=120)
    assert "batch is full" not in reply_of(final) and final[2].endswith("length"), final[2]
    assert wait_for(engine.scheduler.is_drained)


# --- one turn at a time: Enter while a reply streams, Stop before the message is sent ----------
class _Tab:
    """What Gradio passes as `request`: a browser tab's session hash."""

    def __init__(self, session_hash: str) -> None:
        self.session_hash = session_hash


@pytest.fixture
def chat_app(chat_model):
    from minserve.chat.logic import ChatApp

    app = ChatApp(Engine(EngineConfig(device="cpu", policy="fair"), model=chat_model[0],
                         tokenizer=chat_model[1]))
    yield app
    app.close()


def test_enter_while_a_reply_streams_is_refused_visibly_and_the_message_is_kept(chat_app):
    """One reply at a time per session: a second Enter is refused with a reason (the page
    keeps the text in the box), never dropped; once the reply ends, the same text goes."""
    import asyncio

    from minserve.chat.logic import BUSY

    tab = _Tab("tab-one")

    async def scenario():
        assert chat_app.take("Tell me a long story", tab) == (True, "`user-tab-on` · sending")
        stream = chat_app.reply([], 0.0, 64, tab)
        statuses = [(await anext(stream))[1]]  # "queued": the request is in the engine
        refused = chat_app.take("and then?", tab)
        statuses += [status async for _, status in stream]
        return refused, statuses

    refused, statuses = asyncio.run(scenario())
    assert refused == (False, f"`user-tab-on` · {BUSY}")
    assert any(s.endswith(BUSY) for s in statuses[1:-1]), statuses  # said while streaming
    assert "64 tokens" in statuses[-1] and BUSY not in statuses[-1], statuses[-1]
    assert chat_app.take("and then?", tab)[0], "after the reply, the next message goes"
    assert chat_app.take("", _Tab("tab-two")) == (False, "Type a message first.")


def test_stop_pressed_before_the_message_is_submitted_still_stops_it(chat_app):
    """The race behind "one Stop press left a reply streaming for 20 s": Stop came after
    Enter but before the chat had submitted its request, found no handle, answered
    "nothing to stop", and the reply then streamed to its end. A turn exists from
    Enter on, so Stop reaches it: nothing is sent, and Stop says so."""
    import asyncio

    tab = _Tab("tab-one")

    async def scenario():
        assert chat_app.take("Tell me a long story", tab)[0]
        stop = asyncio.ensure_future(chat_app.stop(tab))
        await asyncio.sleep(0.05)  # Stop is waiting for the turn to end
        outs = [o async for o in chat_app.reply([], 0.0, 400, tab)]
        return outs, await stop

    outs, answer = asyncio.run(scenario())
    history, status = outs[-1]
    assert history[-1] == {"role": "assistant", "content": STOPPED}, history
    assert status.endswith("stopped before it was sent") and answer.endswith("before it was sent")
    assert chat_app.engine.stats()["tokens_generated"] == 0 and not chat_app.handles.get(
        "user-tab-on")
    assert chat_app.take("hello again", tab)[0], "the stopped turn does not block the next"


def test_a_closed_tab_leaves_the_sessions_table(chat_app):
    """Closed tabs no longer pile up in the demo's sessions table."""
    import asyncio

    tabs = [_Tab("tab-one"), _Tab("tab-two")]

    async def one_turn(tab):
        assert chat_app.take("Hi", tab)[0]
        return [o async for o in chat_app.reply([], 0.0, 4, tab)]

    for tab in tabs:
        asyncio.run(one_turn(tab))
    assert set(chat_app.book.snapshot()) == {"user-tab-on", "user-tab-tw"}
    chat_app.forget(tabs[0])
    assert set(chat_app.book.snapshot()) == {"user-tab-tw"}
    chat_app.book.finished("user-tab-on", chat_app.engine.generate(["x"])[0])  # a late end
    assert set(chat_app.book.snapshot()) == {"user-tab-tw"}


# --- why a chat waits: the real cause, read from engine.explain -------------------------
def _waiting_chat(chat_model, **cfg):
    """A step-mode engine whose batch session A fills (cfg decides the cap), and B's chat
    pending behind A's backlog: (engine, B's handle)."""
    from minserve import SamplingParams

    engine = Engine(EngineConfig(device="cpu", max_batch_size=2, **cfg), model=chat_model[0],
                    tokenizer=chat_model[1])
    for _ in range(4):
        engine.submit([5, 6, 7], SamplingParams(max_tokens=50), session_id="a")
    engine.step()
    engine.step()
    return engine, engine.submit([5, 6, 7], SamplingParams(max_tokens=4), session_id="b")


def test_a_chat_behind_a_full_batch_is_told_the_batch_is_full_not_the_cap(chat_model):
    """FCFS with a cap equal to the batch (`--max-rows-per-session 8` on the demo): every row
    is A's and A is at its cap. explain names the head's cap; what B waits for is a free
    row, and the bubble says so, with whose rows they are."""
    engine, h = _waiting_chat(chat_model, policy="fcfs", max_rows_per_session=2)
    why = engine.explain(h.request_id)
    assert why["held_by"]["reason"] == "session_cap"  # the engine's view of the head
    words = waiting_words(why, {"a": 2})
    assert words == ("waiting, 2 requests ahead of you; the batch is full: 2/2 rows are "
                     "running, all of them a's"), words


def test_a_chat_held_by_a_share_rule_with_rows_free_is_told_that_rule(chat_model):
    """With a free row the share rule is the cause: the session cap in words, and a rule
    this page has no words for (a new share reason) in the rejection's own message."""
    engine, h = _waiting_chat(chat_model, policy="fcfs", max_rows_per_session=1)
    why = engine.explain(h.request_id)
    assert why["rows"] == 1 and why["held_by"]["reason"] == "session_cap", why
    assert "the session cap: the head's session holds 1 rows" in waiting_words(why), why
    why["held_by"] = {**why["held_by"], "reason": "fair_share", "message": "A holds its share"}
    assert waiting_words(why).endswith("; A holds its share"), waiting_words(why)
    why["held_by"] = {**why["held_by"], "gate": "G2", "reason": "kv_budget", "numbers": {
        "need": 9, "active_kv_reserved": 100, "kv_budget_tokens": 104}}
    assert waiting_words(why).endswith("G2: 100 of 104 KV tokens are reserved, the head "
                                       "needs 9"), waiting_words(why)


def test_the_demo_caps_no_session_under_fcfs_unless_told_to():
    """Under FCFS the demo shows FCFS's hog (docs/demo.md, step 4): no row cap by default;
    a flag or variable still sets one; under fair the cap stays."""
    assert app_defaults("fcfs")["max_rows_per_session"] is None
    assert app_defaults("fair")["max_rows_per_session"] == APP_DEFAULTS["max_rows_per_session"]
    cfg = lambda argv, env=None: chat_demo.config_from_args(chat_demo.parse_args(argv),  # noqa: E731
                                                           env=env or {})[0]
    assert cfg(["--policy", "fcfs"]).max_rows_per_session is None
    assert cfg([], {"MINSERVE_POLICY": "fcfs"}).max_rows_per_session is None
    assert cfg([]).max_rows_per_session == 6
    assert cfg(["--policy", "fcfs", "--max-rows-per-session", "8"]).max_rows_per_session == 8
    assert cfg(["--policy", "fcfs"], {"MINSERVE_MAX_ROWS_PER_SESSION": "3"}
               ).max_rows_per_session == 3


def test_a_tab_refused_by_g1_is_in_the_table_and_the_page_gives_one_refusal_count(chat_model):
    """A tab whose only request G1 refused has its row, with its refusal; and the summary's
    refusals (summed by gate), the table's column and the flood's line are one count, read
    from one snapshot (they once read 15, 16 and 17 at the same moment)."""
    import asyncio

    from minserve.chat.logic import ChatApp

    engine = Engine(EngineConfig(device="cpu", policy="fair", max_batch_size=1,
                                 max_queue_size=2), model=chat_model[0], tokenizer=chat_model[1])
    app = ChatApp(engine)
    panel = chat_demo.LivePanel(app, ttl=0.0)
    try:
        engine.stop()  # the worker paused: the flood fills the queue and it stays full
        app.noisy.start(6, 6, 8, 30)
        assert wait_for(lambda: app.noisy.counts["sent"] >= 4)  # two queued, the rest refused
        tab = _Tab("refused-tab")

        async def one_turn():
            assert app.take("Are you there?", tab)[0]
            return [o async for o in app.reply([], 0.0, 8, tab)]

        assert "refused by G1" in asyncio.run(one_turn())[-1][1]
        summary, rows, *_, flood = panel.render("user-refuse")
        table = {r[0].removesuffix(" (you)"): r for r in rows}
        assert table["user-refuse"][3:6] == [0, 0, 1], table  # done 0, tokens 0, refused 1
        refused = re.search(r"refused: ([^·\n]*)", summary)[1]
        total = sum(int(n) for n in re.findall(r"G\d (\d+)", refused))
        assert total == sum(r[5] for r in rows) >= 2, (summary, rows)
        assert f"refused {table[NOISY_SESSION][5]} " in flood, (flood, rows)
        # the book alone moving (the engine paused, its stats still) redraws the table
        app.book.sent("user-latecomer")
        assert any(r[0] == "user-latecomer" for r in panel.render("x")[1])
    finally:
        app.noisy.stop()
        engine.start()
        app.close()

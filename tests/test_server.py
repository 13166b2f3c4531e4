"""The HTTP server (SPEC H1–H3, G1, G4–G6), driven over real loopback sockets.

Every test starts uvicorn on 127.0.0.1 and a free port, talks to it with the
official `openai` package or raw httpx, and stops it. The model is a tiny
random Llama with SmolLM2's vocabulary, paired with the real SmolLM2 tokenizer,
so chat templates and detokenisation are the real ones while a forward pass
costs a millisecond. The text it writes is gibberish; what we check is that the
server returns exactly what the engine produces for the same request alone
(step mode, no HTTP): the engine is the oracle here.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest

from minserve import Engine, EngineConfig, SamplingParams
from minserve.bench.health import wait_healthy
from minserve.server.api import create_app
from minserve.server.cli import BackgroundServer, add_serve_arguments, engine_config_from_args

# Gate-friendly defaults: a 128-token block pool (8 x 16) and a 200-token KV budget,
# so a 130-token prompt can never pass G3 and prompt + max_tokens > 200 never passes G2.
SMALL = dict(model="tiny-llama", device="cpu", max_model_len=256, max_batch_size=4,
             max_queue_size=16, block_size=16, num_blocks=8, kv_budget_tokens=200)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


@functools.lru_cache(maxsize=1)
def tiny_chat():
    """(model, tokenizer): a tiny random Llama over SmolLM2's 49152-token vocabulary and the
    real SmolLM2 tokenizer. Built once per test process, shared by the server test modules."""
    from transformers import AutoTokenizer

    from minserve.models import embedded_model_dir, tiny_llama

    return tiny_llama(vocab_size=49152), AutoTokenizer.from_pretrained(embedded_model_dir())


@contextmanager
def serving(api_key=None, app_kw=None, **cfg):
    """(base url, engine) of a freshly started server; stopped (engine too) on exit."""
    model, tokenizer = tiny_chat()
    engine = Engine(EngineConfig(**{**SMALL, **cfg}), model=model, tokenizer=tokenizer)
    with BackgroundServer(create_app(engine, api_key=api_key, **(app_kw or {}))) as srv:
        yield srv.url, engine


@pytest.fixture(scope="module")
def server():
    # priority is a grant (H5): this server's operator lets every client set it
    with serving(app_kw={"allow_priority": True}) as (url, engine):
        yield url, engine


def sdk(url, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "unused"),
                         max_retries=0, timeout=20, **kw)


def reference(prompt, **sampling):
    """The oracle: the same request alone on a step-mode engine (no HTTP, no worker)."""
    model, tokenizer = tiny_chat()
    engine = Engine(EngineConfig(**SMALL), model=model, tokenizer=tokenizer)
    return engine.generate(prompt, SamplingParams(**sampling))[0]


def wait_until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ============================================================ the happy path, via the SDK
@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_gets_exactly_what_the_engine_generates(server, kind, stream):
    url, _ = server
    client, n = sdk(url), 7
    prompt = CHAT if kind == "chat" else "The capital of France is"
    want = reference(prompt, max_tokens=n, ignore_eos=True)
    kw = dict(model="tiny-llama", max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    kw["messages" if kind == "chat" else "prompt"] = prompt
    if not stream:
        resp = create(**kw)
        choice = resp.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        finish, usage, ext = choice.finish_reason, resp.usage, resp.to_dict()["minserve"]
    else:
        chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
        with_choice = [c for c in chunks if c.choices]
        if kind == "chat":
            assert with_choice[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in with_choice)
        else:
            text = "".join(c.choices[0].text for c in with_choice)
        finish = with_choice[-1].choices[0].finish_reason
        assert all(c.choices[0].finish_reason is None for c in with_choice[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage is not None  # include_usage
        usage, ext = chunks[-1].usage, chunks[-1].to_dict()["minserve"]
    assert text == want.text and finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), n)
    assert usage.total_tokens == usage.prompt_tokens + n
    assert ext["prefill_chunks"] == 1 and 0 <= ext["queue_time"] <= ext["ttft"] <= ext["e2e"]


def test_raw_sse_stream_is_data_lines_ending_with_done(server):
    url, _ = server
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=20) as c:
        r = c.post(url + "/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and '"finish_reason": "length"' in events[-2]
    assert "usage" not in events[-2]  # only when stream_options.include_usage


def test_stop_string_and_seed_are_honoured(server):
    url, _ = server
    client = sdk(url)
    full = reference("Once upon a time", max_tokens=8, ignore_eos=True)
    stop = full.text[len(full.text) // 2:][:4]
    resp = client.completions.create(model="minserve", prompt="Once upon a time", max_tokens=8,
                                     temperature=0, stop=stop, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == full.text[:full.text.find(stop)]
    seeded = [client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=6,
                                        temperature=1.0, seed=7).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1] == reference("Hi", max_tokens=6,
                                               temperature=1.0, seed=7).text


def test_session_comes_from_user_then_header_and_priority_from_the_body(server):
    url, _ = server
    with httpx.Client(timeout=20) as c:
        def ext(body, headers=None):
            r = c.post(url + "/v1/completions", headers=headers,
                       json={"prompt": "Hi", "max_tokens": 2, **body})
            assert r.status_code == 200, r.text
            return r.json()["minserve"]

        assert ext({"user": "alice", "priority": 3}, {"X-Session-Id": "bob"})["session"] == "alice"
        got = ext({"priority": 3}, {"X-Session-Id": "bob"})
        assert (got["session"], got["priority"]) == ("bob", 3)
        assert ext({})["session"] == "default"


def test_fair_policy_charges_the_session_named_by_user_or_header():
    """H2 end to end: the session a request names is the one the VTC counters charge
    (read here with session_stats on: per-session detail is not public by default)."""
    with serving(policy="fair", app_kw={"session_stats": True}) as (url, _):
        httpx.post(url + "/v1/completions", timeout=20, json={"prompt": "Hi", "max_tokens": 3,
                                                             "user": "alice"})
        httpx.post(url + "/v1/completions", timeout=20, headers={"X-Session-Id": "bob"},
                   json={"prompt": "Hello there", "max_tokens": 5, "ignore_eos": True})
        counters = httpx.get(url + "/scheduler/stats", timeout=5).json()["policy"]["counters"]
    assert set(counters) == {"alice", "bob"} and counters["bob"] > counters["alice"] > 0


def test_models_endpoint_lists_the_engine_model_and_accepts_aliases(server):
    url, _ = server
    client = sdk(url)
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert client.models.retrieve("minserve").id == "tiny-llama"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)


# ============================================================ gates -> 429 (G1, G2, G3, G6)
def test_queue_full_is_refused_at_once_with_429_naming_g1():
    with serving(max_queue_size=1) as (url, engine):
        lock = engine.scheduler.lock
        lock.acquire()  # the worker cannot tick: the first request stays pending
        try:
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(httpx.post, url + "/v1/completions", timeout=20,
                                    json={"prompt": "Hi", "max_tokens": 2, "stream": True})
                wait_until(lambda: engine.stats()["queues"]["pending"] == 1, what="pending")
                r = httpx.post(url + "/v1/completions", timeout=5,
                               json={"prompt": "Hi", "max_tokens": 2, "stream": True})
                assert r.status_code == 429 and r.headers["content-type"] == "application/json"
                err = r.json()["error"]
                assert (err["gate"], err["code"], err["type"]) == ("G1", "queue_full",
                                                                   "rate_limit_exceeded")
                assert err["numbers"] == {"pending": 1, "max_queue_size": 1}
                assert err["retryable"] is True and r.headers["retry-after"] == "1"
                assert r.headers["x-should-retry"] == "true"
                lock.release()
                lock = None
                assert first.result(timeout=20).status_code == 200  # the queued one is served
        finally:
            if lock is not None:
                lock.release()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("gate, prompt, max_tokens, code", [
    ("G2", [7] * 5, 200, "kv_budget_exceeded"),  # 5 + 200 > 200-token budget: never fits
    ("G3", [7] * 130, 4, "prompt_exceeds_block_pool"),  # 9 blocks > an 8-block pool
])
def test_never_fitting_request_gets_429_not_a_200_stream(server, gate, prompt, max_tokens, code,
                                                         stream):
    """G2/G3 refuse at admit, after submit returned: the status line waits for that answer."""
    url, _ = server
    r = httpx.post(url + "/v1/completions", timeout=20,
                   json={"prompt": prompt, "max_tokens": max_tokens, "stream": stream})
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert (err["gate"], err["code"], err["retryable"]) == (gate, code, False)
    assert "never fit" in err["message"] and err["numbers"]
    assert r.headers["x-should-retry"] == "false" and "retry-after" in r.headers


def test_sdk_sees_a_refusal_as_rate_limit_error_with_the_gate(server):
    url, _ = server
    with pytest.raises(openai.RateLimitError) as exc:
        sdk(url).chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=199)
    assert exc.value.body["gate"] == "G2" and exc.value.body["numbers"]["kv_budget_tokens"] == 200


# ============================================================ health and stats
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_answers_while_a_tick_holds_the_lock_and_503_when_worker_dies():
    with serving() as (url, engine):
        with engine.scheduler.lock:  # as if a tick were running forever
            r = httpx.get(url + "/health", timeout=2)
        assert r.status_code == 200 and r.json()["worker_alive"] is True

        def boom():
            raise SystemExit("worker crashed")  # not an Exception: the worker's guard lets it die

        engine.scheduler.has_work = boom
        engine._wake.set()
        wait_until(lambda: not engine.running, what="the worker to die")
        r = httpx.get(url + "/health", timeout=2)
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_dead"
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, timeout=2)
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_dead"  # no hang
        del engine.scheduler.has_work


def test_scheduler_stats_are_the_engine_stats(server):
    url, engine = server
    s = httpx.get(url + "/scheduler/stats", timeout=5).json()
    for key in ("queues", "active_kv_reserved", "kv_admit_blocked", "kv_pressure", "rejected",
                "policy", "worker_alive"):
        assert key in s
    assert s["kv_budget_tokens"] == 200 and s["model"] == "tiny-llama"


# ============================================================ API key
def test_api_key_is_required_everywhere_but_health():
    with serving(api_key="s3cret") as (url, _):
        body = {"prompt": "Hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
            r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=5)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(url + "/v1/completions", content=b"{not json", timeout=5)
        assert r.status_code == 401  # checked before the body is even parsed
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            sdk(url, api_key="wrong").models.list()
        assert sdk(url, api_key="s3cret").completions.create(
            model="tiny-llama", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


# ============================================================ command line
def test_flags_override_env_which_overrides_defaults():
    import argparse

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    env = {"MINSERVE_MAX_QUEUE_SIZE": "7", "MINSERVE_POLICY": "fair",
           "MINSERVE_ENABLE_PREFIX_CACHING": "false", "MINSERVE_NUM_BLOCKS": "",
           "POLICY": "fcfs", "DEVICE": "cuda", "MAX_BATCH_SIZE": "99"}  # other tools' names
    cfg = engine_config_from_args(p.parse_args(["--max-queue-size", "3"]), env)
    assert (cfg.max_queue_size, cfg.policy, cfg.enable_prefix_caching) == (3, "fair", False)
    assert cfg.num_blocks is None and cfg.max_batch_size == EngineConfig().max_batch_size
    assert cfg.device == EngineConfig().device  # bare DEVICE is not ours
    with pytest.raises(ValueError, match="MINSERVE_MAX_BATCH_SIZE='lots'"):
        engine_config_from_args(p.parse_args([]), {"MINSERVE_MAX_BATCH_SIZE": "lots"})
    with pytest.raises(ValueError, match="max_queue_size=0"):
        engine_config_from_args(p.parse_args(["--max-queue-size", "0"]), {})


# ============================================================ the real model
@pytest.mark.real_model
def test_real_model_chat_completion_through_the_sdk(real_model):
    model, tok = real_model
    engine = Engine(EngineConfig(device="cpu", max_batch_size=2), model=model, tokenizer=tok)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = engine.generate(messages, SamplingParams(max_tokens=12))[0]
    with BackgroundServer(create_app(engine)) as srv:
        client = sdk(srv.url)
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        resp = client.chat.completions.create(model="HuggingFaceTB/SmolLM2-135M-Instruct",
                                              messages=messages, max_tokens=12, temperature=0)
    assert resp.choices[0].message.content == want.text
    assert "Paris" in want.text
    assert resp.choices[0].finish_reason == want.finish_reason


@pytest.mark.real_model
def test_python_dash_m_minserve_serve_starts_with_flags_and_env():
    """The real command line: flags and env reach the engine; the embedded model answers."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a free port (the tiny race with other processes is fine here)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MINSERVE_MAX_QUEUE_SIZE": "3", "MINSERVE_MAX_BATCH_SIZE": "5",
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "minserve", "serve", "--port", str(port), "--device", "cpu",
           "--max-batch-size", "2", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 90, probe_s=1, said=lambda: proc.stdout.read().decode())
        stats = httpx.get(url + "/scheduler/stats", timeout=5).json()
        assert (stats["max_queue_size"], stats["max_batch_size"]) == (3, 2)  # env, then flag
        r = sdk(url).chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4,
                                             messages=[{"role": "user", "content": "Hi"}])
        assert r.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn shuts down, the engine stops
        try:
            assert proc.wait(timeout=20) == 0
        finally:
            proc.kill()


@pytest.mark.real_model
def test_sigterm_ends_a_running_stream_with_a_reason_and_done_then_exits_0():
    """A real `minserve serve` process, a real SIGTERM: the stream that cannot finish
    within the grace period ends with a server_shutdown error chunk and [DONE]."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minserve", "serve", "--port", str(port), "--device", "cpu",
           "--log-level", "warning", "--shutdown-grace-s", "1"]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        wait_healthy(proc, url, 90, probe_s=1, said=lambda: proc.stdout.read().decode())

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}) as r:
                lines.extend(line for line in r.iter_lines() if line)

        t = threading.Thread(target=stream)
        t.start()
        wait_until(lambda: len(lines) >= 3, timeout=30, what="the stream to start")
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-3].removeprefix("data: "))["error"]["code"] == "server_shutdown"

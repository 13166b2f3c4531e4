"""Nobody can break the server for everyone else: each finding of the hostile-client
review, reproduced against a real server on 127.0.0.1 (docs/security.md).

Bad single fields (surrogates, seed, stop lists, temperature, unsupported OpenAI
fields) are rows of the bad-input table in tests/test_server_errors.py; engine
faults are tests/test_failure_isolation.py. Here: what needs sockets, threads,
timing of the protocol itself, or a look at what a client can read.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from minserve import Engine, EngineConfig
from minserve.server.api import create_app
from minserve.server.cli import BackgroundServer
from minserve.server.limits import ServerLimits

from .test_server import SMALL, tiny_chat


@contextmanager
def serving(limits=None, api_key=None, slow_decode_s=0.0, **cfg):
    model, tokenizer = tiny_chat()
    engine = Engine(EngineConfig(**{**SMALL, **cfg}), model=model, tokenizer=tokenizer)
    if slow_decode_s:  # make requests last long enough to be caught mid-flight
        real = engine.scheduler.backend.decode_step_batched

        def slow(reqs, toks):
            time.sleep(slow_decode_s)
            return real(reqs, toks)

        engine.scheduler.backend.decode_step_batched = slow
    app = create_app(engine, api_key=api_key, limits=limits or ServerLimits())
    with BackgroundServer(app) as srv:
        yield srv, engine


def post(url, body, **kw):
    return httpx.post(url + "/v1/completions", json=body, timeout=kw.pop("timeout", 20), **kw)


def stream_lines(url, body):
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=30) as r:
        return r.status_code, [line for line in r.iter_lines() if line]


def openai_error(r):
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    return err


# ------------------------------------------------------------------ 1. one request, everyone's error
def test_a_tiny_temperature_does_not_end_the_other_streams():
    with serving() as (srv, engine):
        with ThreadPoolExecutor(3) as pool:
            others = [pool.submit(stream_lines, srv.url, {"prompt": f"Hello {i}",
                                                          "max_tokens": 24, "ignore_eos": True})
                      for i in range(2)]
            bad = pool.submit(post, srv.url, {"prompt": "Hi", "max_tokens": 8,
                                              "temperature": 1e-40, "seed": 3})
            assert bad.result().status_code == 200
            for f in others:
                status, lines = f.result()
                assert status == 200 and lines[-1] == "data: [DONE]"
                assert not any('"error"' in line for line in lines)
        assert engine.scheduler.failed_rows == 0 and engine.scheduler.is_drained()


# ------------------------------------------------------------------ 2. body size, tokenising
def test_a_huge_body_is_refused_with_413_before_it_is_read():
    with serving() as (srv, _):
        big = b'{"prompt": "' + b"x" * (20 << 20) + b'"}'  # 20 MB
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", content=big, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and openai_error(r)["code"] == "body_too_large"
        assert time.monotonic() - t0 < 30
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200


def test_a_chunked_body_without_content_length_is_cut_off_at_the_limit():
    limits = ServerLimits(max_body_bytes=4096)
    with serving(limits) as (srv, _):
        def chunks():
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"y" * 1024
            yield b'"}'

        r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=20,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and "larger than 4096" in openai_error(r)["message"]


def test_a_prompt_over_the_character_limit_is_refused_before_tokenising(monkeypatch):
    limits = ServerLimits(max_prompt_chars=1000)
    with serving(limits) as (srv, engine):
        calls = []
        monkeypatch.setattr(engine, "encode", lambda p: calls.append(p) or [1, 2])
        r = post(srv.url, {"prompt": "z" * 1001, "max_tokens": 2})
        assert r.status_code == 400 and openai_error(r)["code"] == "prompt_too_long"
        assert calls == []


def test_tokenising_runs_off_the_event_loop(monkeypatch):
    with serving() as (srv, engine):
        seen = []
        real = engine.encode

        def encode(prompt):
            if isinstance(prompt, str):  # text: the expensive call (ids pass through cheaply)
                seen.append(threading.current_thread().name)
            return real(prompt)

        monkeypatch.setattr(engine, "encode", encode)
        assert post(srv.url, {"prompt": "Hello there", "max_tokens": 2}).status_code == 200
        # minserve-http is the thread that runs the server's event loop
        assert seen and all(name != "minserve-http" for name in seen), seen


# ------------------------------------------------------------------ 5. SIGTERM
def test_sigterm_drains_then_ends_streams_with_a_reason_and_waiting_requests_with_503():
    limits = ServerLimits(shutdown_grace_s=0.6)
    with serving(limits, slow_decode_s=0.03, max_model_len=512, kv_budget_tokens=4096,
                 num_blocks=64) as (srv, engine):
        with ThreadPoolExecutor(3) as pool:
            short = pool.submit(post, srv.url, {"prompt": "a", "max_tokens": 3, "ignore_eos": True})
            long_stream = pool.submit(stream_lines, srv.url, {"prompt": "b", "max_tokens": 300,
                                                               "ignore_eos": True})
            long_plain = pool.submit(post, srv.url, {"prompt": "c", "max_tokens": 300,
                                                      "ignore_eos": True}, timeout=60)
            deadline = time.monotonic() + 20
            while engine.scheduler.stats()["queues"]["active"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            srv.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
            assert short.result().status_code == 200  # finished within the grace period
            status, lines = long_stream.result()
            plain = long_plain.result()
        assert status == 200 and lines[-1] == "data: [DONE]"
        error = json.loads(lines[-3].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutdown" and "shutting down" in error["message"]
        assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
        assert plain.status_code == 503 and openai_error(plain)["code"] == "server_shutdown"
        assert engine.scheduler.is_drained()
        srv.thread.join(15)
        assert not srv.thread.is_alive()


# ------------------------------------------------------------------ 6, 7. privacy, internals
def test_stats_are_aggregate_by_default_and_leak_no_traceback():
    with serving(policy="fair") as (srv, engine):
        for user in ("alice", "bob-secret-name"):
            assert post(srv.url, {"prompt": "Hi", "max_tokens": 2, "user": user}).status_code == 200
        real = engine.scheduler.backend.prefill_chunk
        engine.scheduler.backend.prefill_chunk = lambda *a: (_ for _ in ()).throw(
            RuntimeError("boom"))
        r = post(srv.url, {"prompt": "Hi", "max_tokens": 2})
        engine.scheduler.backend.prefill_chunk = real
        assert r.status_code == 500 and "Traceback" not in r.text
        stats = httpx.get(srv.url + "/scheduler/stats", timeout=5,
                          headers={"X-Session-Id": "alice"})
        body = stats.text
        assert "bob-secret-name" not in body and "counters" not in stats.json()["policy"]
        assert stats.json()["policy"]["sessions"] == 3
        assert stats.json()["policy"]["own_session"]["session"] == "alice"
        assert "Traceback" not in body and "/" not in (stats.json()["last_error"] or "")
        health = httpx.get(srv.url + "/health", timeout=5).json()
        assert "last_error" not in health and "boom" not in json.dumps(health)


def test_with_an_api_key_the_authenticated_caller_sees_every_session():
    with serving(api_key="k", policy="fair") as (srv, _):
        auth = {"Authorization": "Bearer k"}
        post(srv.url, {"prompt": "Hi", "max_tokens": 2, "user": "carol"}, headers=auth)
        stats = httpx.get(srv.url + "/scheduler/stats", headers=auth, timeout=5).json()
        assert "carol" in stats["policy"]["counters"]


def test_an_unexpected_error_is_a_500_in_openai_shape_with_no_detail(monkeypatch):
    with serving() as (srv, engine):
        def broken(prompt):
            raise KeyError("/root/secret/path.py")

        monkeypatch.setattr(engine, "encode", broken)
        r = post(srv.url, {"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 500
        err = openai_error(r)
        assert err["code"] == "internal_error" and "secret" not in r.text
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200


# ------------------------------------------------------------------ 9. timeouts, connections
def raw_connection(url):
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed_within(sock, seconds) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b"" or True  # data then close, or close: both end it
    except TimeoutError:
        return False


def test_a_silent_or_half_sent_request_is_closed_after_the_header_timeout():
    limits = ServerLimits(header_timeout_s=0.5)
    with serving(limits) as (srv, _):
        silent = raw_connection(srv.url)
        partial = raw_connection(srv.url)
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        assert closed_within(silent, 5) and closed_within(partial, 5)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200


def test_a_body_that_stops_arriving_gets_408():
    limits = ServerLimits(body_timeout_s=0.5)
    with serving(limits) as (srv, _):
        s = raw_connection(srv.url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        s.settimeout(5)
        reply = b""
        while b"request_timeout" not in reply:  # headers and body may come in two segments
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        assert b" 408 " in reply.split(b"\r\n")[0] and b"request_timeout" in reply


def test_an_idle_keep_alive_connection_is_closed():
    limits = ServerLimits(keep_alive_s=1)
    with serving(limits) as (srv, _):
        s = raw_connection(srv.url)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        assert b"200" in s.recv(4096)
        t0 = time.monotonic()
        assert closed_within(s, 5) and time.monotonic() - t0 < 4


def slow_body(url, declared=100_000):
    """A request whose headers are complete and whose body has only begun (docs/security.md)."""
    s = raw_connection(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: " + str(declared).encode() + b"\r\n\r\n{")
    return s


def test_a_body_trickled_a_byte_at_a_time_gets_408_at_the_total_deadline():
    """Once, the deadline was per chunk: a byte every 20 s held a connection
    forever. Each byte here comes well inside body_timeout_s; the body as a whole never
    does."""
    limits = ServerLimits(body_timeout_s=1.0)
    with serving(limits) as (srv, _):
        s = slow_body(srv.url)
        s.settimeout(0.3)
        reply = b""
        for _ in range(30):  # up to ~9 s of trickling, a byte every 0.3 s
            try:
                s.sendall(b" ")
                reply += s.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if b"request_timeout" in reply:
                break
        assert b" 408 " in reply.split(b"\r\n")[0] and b"request_timeout" in reply


def test_slow_bodies_in_every_slot_leave_health_answering_and_refuse_others_in_openai_shape():
    limits = ServerLimits(max_connections=3, header_timeout_s=5, body_timeout_s=20)
    with serving(limits) as (srv, _):
        held = [slow_body(srv.url) for _ in range(3)]  # every request slot is taken
        time.sleep(0.3)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        r = post(srv.url, {"prompt": "hi", "max_tokens": 1}, timeout=5)
        assert r.status_code == 503 and openai_error(r)["code"] == "too_many_connections"
        for s in held:
            s.close()


def test_connections_beyond_the_limit_and_its_reserve_get_503_in_openai_shape():
    from minserve.server.limits import HEALTH_RESERVE

    limits = ServerLimits(max_connections=1, header_timeout_s=5)
    with serving(limits) as (srv, _):
        held = [raw_connection(srv.url) for _ in range(1 + HEALTH_RESERVE)]  # silent
        time.sleep(0.2)
        r = httpx.get(srv.url + "/health", timeout=5)
        assert r.status_code == 503 and openai_error(r)["code"] == "too_many_connections"
        for s in held:
            s.close()
        time.sleep(0.2)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200


# ------------------------------------------------------------------ 11. smaller
def test_bearer_scheme_is_case_insensitive_and_two_authorization_headers_are_refused():
    with serving(api_key="s3cret") as (srv, _):
        ok = httpx.get(srv.url + "/v1/models", headers={"Authorization": "bearer s3cret"},
                       timeout=5)
        assert ok.status_code == 200
        two = httpx.get(srv.url + "/v1/models", timeout=5, headers=[
            ("Authorization", "Bearer wrong"), ("Authorization", "Bearer s3cret")])
        assert two.status_code == 400 and openai_error(two)["code"] == "duplicate_authorization"
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Basic s3cret"},
                         timeout=5).status_code == 401


def test_a_body_that_is_not_declared_json_gets_415_saying_what_to_send():
    with serving() as (srv, _):
        r = httpx.post(srv.url + "/v1/completions", content='{"prompt": "Hi"}', timeout=5,
                       headers={"content-type": "text/plain"})
        assert r.status_code == 415 and "application/json" in openai_error(r)["message"]


def test_a_request_whose_worker_dies_after_submit_gets_503_not_a_hang():
    with serving() as (srv, engine):
        real_submit = engine.submit

        def submit_then_die(*a, **kw):
            handle = real_submit(*a, **kw)
            threading.Thread(target=engine.stop, daemon=True).start()  # the worker dies
            return handle

        engine.submit = submit_then_die
        engine.scheduler.step = lambda: time.sleep(0.5)  # it never gets to this request
        r = post(srv.url, {"prompt": "Hi", "max_tokens": 2}, timeout=20)
        assert r.status_code == 503 and openai_error(r)["code"] == "worker_dead"


def test_stats_read_the_kv_length_recorded_under_the_tick_lock(monkeypatch):
    """The paged backend's kv_length walks every row's table: reading it from the stats
    thread while a tick changes the tables raced. Stats now read the value T4 recorded."""
    with serving(backend="paged") as (srv, engine):
        lock = engine.scheduler.lock
        cls = type(engine.scheduler.backend)
        real = cls.kv_length

        def guarded(self):
            assert lock._is_owned(), "kv_length read without the tick lock"
            return real.fget(self)

        monkeypatch.setattr(cls, "kv_length", property(guarded))
        assert post(srv.url, {"prompt": "Hi", "max_tokens": 3}).status_code == 200
        r = httpx.get(srv.url + "/scheduler/stats", timeout=5)
        assert r.status_code == 200 and r.json()["kv_length"] >= 0
        with lock:  # a long tick in progress: stats still answer
            assert httpx.get(srv.url + "/scheduler/stats", timeout=5).status_code == 200


@pytest.mark.parametrize("field, value", [("metadata", {"team": "a"}), ("store", False),
                                          ("service_tier", "auto"),
                                          ("parallel_tool_calls", False),
                                          ("modalities", ["text"])])
def test_openai_fields_that_ask_nothing_of_minserve_are_accepted(field, value):
    with serving() as (srv, _):
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=20, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value})
        assert r.status_code == 200, r.text

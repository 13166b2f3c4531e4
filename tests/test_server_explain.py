"""GET /scheduler/explain/{request_id}: a client names its request (X-Request-Id) and asks
why it waits; only its own session gets an answer (SPEC G6, H5)."""

from __future__ import annotations

import threading
import time

import httpx

from .test_server_hardening import serving


def _send(url, rid, session, out, n=6):
    out[rid] = httpx.post(url + "/v1/completions", timeout=60,
                          headers={"X-Request-Id": rid, "X-Session-Id": session},
                          # ignore_eos: the OpenAI default samples (temperature 1), and a
                          # row that drew EOS early would leave the batch before it is asked
                          json={"prompt": "Hello there", "max_tokens": n, "ignore_eos": True})


def test_a_client_names_its_request_and_asks_why_it_waits_others_get_404():
    # one batch row and a slow decode: the second request waits behind the first
    with serving(max_batch_size=1, slow_decode_s=0.2) as (srv, engine):
        out: dict[str, httpx.Response] = {}
        t1 = threading.Thread(target=_send, args=(srv.url, "alice-1", "alice", out, 30))
        t1.start()
        while not engine.scheduler.active:
            time.sleep(0.02)
        t2 = threading.Thread(target=_send, args=(srv.url, "bob-1", "bob", out))
        t2.start()
        while not engine.scheduler.pending:
            time.sleep(0.02)
        r = httpx.get(srv.url + "/scheduler/explain/bob-1", headers={"X-Session-Id": "bob"})
        assert r.status_code == 200, r.text
        e = r.json()
        assert e["state"] == "pending" and e["held_by"]["reason"] == "batch_full"
        assert "the batch is full (1/1 rows)" in e["sentence"]
        running = httpx.get(srv.url + "/scheduler/explain/alice-1",
                            headers={"X-Session-Id": "alice"}).json()
        assert running["state"] == "active"
        # someone else's id, and an id nobody used: the same 404
        for rid, who in (("alice-1", "bob"), ("alice-1", None), ("nobody-7", "bob")):
            headers = {"X-Session-Id": who} if who else {}
            r = httpx.get(srv.url + f"/scheduler/explain/{rid}", headers=headers)
            assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
        t1.join()
        t2.join()
        assert out["alice-1"].status_code == 200 and out["bob-1"].status_code == 200
        assert out["alice-1"].headers["x-request-id"] == "alice-1"
        done = httpx.get(srv.url + "/scheduler/explain/bob-1",
                         headers={"X-Session-Id": "bob"}).json()
        assert done["state"] == "finished" and done["finish_reason"] == "length"


def test_a_bad_or_live_request_id_is_refused_naming_the_header():
    with serving(max_batch_size=1, slow_decode_s=0.2) as (srv, engine):
        r = httpx.post(srv.url + "/v1/completions", headers={"X-Request-Id": "a b/c"},
                       json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
        out: dict[str, httpx.Response] = {}
        t = threading.Thread(target=_send, args=(srv.url, "same", "s", out))
        t.start()
        while not engine.scheduler.requests:
            time.sleep(0.02)
        r = httpx.post(srv.url + "/v1/completions", headers={"X-Request-Id": "same",
                                                             "X-Session-Id": "s"},
                       json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 400 and "still running" in r.json()["error"]["message"]
        # another session's name space: the same id neither collides nor confirms it (H5)
        r = httpx.post(srv.url + "/v1/completions", headers={"X-Request-Id": "same"},
                       json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        t.join()


# ------------------------------------------------------------------ H7: a queue of others
def test_explain_of_a_request_behind_another_tenants_says_nothing_of_that_request():
    """The head is mallory's, held by G2 for the KV it needs; alice, behind it, learns the
    server's load (KV reserved), never what mallory's request needs. She names her session
    in the body (`user: José`, which no header could carry) and asks by POST."""
    from .test_security import key, shared

    with shared(slow_decode_s=0.02) as (url, engine):
        def send(who, body, rid=None):
            headers = {"X-Request-Id": rid} if rid else {}
            return threading.Thread(target=httpx.post, args=(url + "/v1/completions",), kwargs={
                "json": {"max_tokens": 2, "ignore_eos": True, **body}, "timeout": 60,
                "headers": {**key(who), **headers}})

        running = send("mallory", {"prompt": [9], "max_tokens": 120})  # reserves 121 of 200
        running.start()
        while not engine.scheduler.active:
            time.sleep(0.01)
        head = send("mallory", {"prompt": list(range(10, 20)), "max_tokens": 70}, "m-2")
        head.start()  # needs 80, 79 are free: G2 holds it at the head
        while not engine.scheduler.pending:
            time.sleep(0.01)
        mine = send("alice", {"prompt": [3], "user": "José"}, "a-1")
        mine.start()
        while len(engine.scheduler.pending) < 2:
            time.sleep(0.01)
        r = httpx.post(url + "/scheduler/explain/a-1", json={"user": "José"},
                       headers=key("alice"))
        assert r.status_code == 200, r.text  # before: 405, GET only
        e = r.json()
        assert e["state"] == "pending" and e["position"] == 1 and e["session"] == "José"
        assert "G2: 121 of 200 KV tokens are reserved" in e["sentence"]
        assert "needs" not in e["sentence"] and "80" not in e["sentence"]  # before: "it needs 80"
        # the header names the session "default": someone else's namespace, the same 404
        assert httpx.get(url + "/scheduler/explain/a-1",
                         headers=key("alice")).status_code == 404
        own = httpx.get(url + "/scheduler/explain/m-2", headers=key("mallory")).json()
        assert "it needs 80" in own["sentence"]  # a client still reads its own numbers
        for t in (running, head, mine):
            t.join()


def test_a_utf8_session_header_is_refused_saying_to_use_the_body():
    """A header value is bytes: `José` in UTF-8 was read as `JosÃ©`, another session than
    the body's `user: José`. It is refused, everywhere a session is read."""
    with serving() as (srv, _):
        utf8 = {"X-Session-Id": "José".encode()}
        r = httpx.post(srv.url + "/v1/completions", headers=utf8,
                       json={"prompt": "Hi", "max_tokens": 1})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_session_header"  # before: 200
        assert '"user"' in err["message"] and err["param"] == "X-Session-Id"
        for path in ("/scheduler/explain/x-1", "/scheduler/stats"):
            assert httpx.get(srv.url + path, headers=utf8).status_code == 400
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                                         "user": "José"})
        assert r.json()["minserve"]["session"] == "José"

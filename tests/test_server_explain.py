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

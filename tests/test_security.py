"""A server a class shares (SPEC H5, docs/security.md): one test per attack.

Two tenants, alice and mallory, each with a key; mallory attacks. Each test replays
one attack of docs/security.md's table, small and on loopback, and checks it is refused or
contained. (A fault in a tick: tests/test_failure_isolation.py; slow bodies and
connection limits: tests/test_server_hardening.py.)
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch

from minserve import Engine, EngineConfig, SamplingParams
from minserve.fair import FairPolicy
from minserve.kv_cache import BlockManager
from minserve.sampling import Sampler
from minserve.server.access import parse_api_keys
from minserve.server.api import create_app
from minserve.server.cli import BackgroundServer, tenancy_line
from minserve.server.keys import load_api_keys

from .test_server import SMALL, tiny_chat

KEYS = {"key-alice-0001": {"tenant": "alice"}, "key-mallory-01": {"tenant": "mallory"},
        "key-teacher-01": {"tenant": "teacher", "may_set_priority": True}}
SECRET = list(range(1000, 1040))  # 40 token ids: two full blocks of 16 and a tail


@contextmanager
def shared(slow_decode_s=0.0, app_kw=None, **cfg):
    model, tokenizer = tiny_chat()
    engine = Engine(EngineConfig(**{**SMALL, **cfg}), model=model, tokenizer=tokenizer)
    if slow_decode_s:
        real = engine.scheduler.backend.decode_step_batched

        def slow(reqs, toks):
            time.sleep(slow_decode_s)
            return real(reqs, toks)

        engine.scheduler.backend.decode_step_batched = slow
    app_kw = {"api_keys": KEYS, **(app_kw or {})}
    with BackgroundServer(create_app(engine, **app_kw)) as srv:
        yield srv.url, engine


def key(who):
    return {"Authorization": f"Bearer key-{who}-0001" if who == "alice" else
            f"Bearer key-{who}-01"}


def post(url, who, body, headers=None, timeout=30):
    return httpx.post(url + "/v1/completions", timeout=timeout, json=body,
                      headers={**(key(who) if who else {}), **(headers or {})})


def cached(r):
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def srv():
    with shared(policy="fair", num_blocks=32, kv_budget_tokens=400) as s:
        yield s


# ------------------------------------------------------------------ 4. the prefix cache
def test_another_tenants_prompt_never_hits_the_cache_and_costs_the_same_work(srv):
    url, engine = srv
    body = {"prompt": SECRET, "max_tokens": 1}
    assert cached(post(url, "alice", body)) == 0
    before = engine.stats()["prompt_tokens_computed"]
    assert cached(post(url, "mallory", body)) == 0  # before the tenant salt: 32
    computed = engine.stats()["prompt_tokens_computed"] - before
    assert computed == len(SECRET)  # a cold prefill: no work saved, so no faster TTFT
    assert cached(post(url, "alice", body)) == 32  # within a tenant the cache still works


def test_block_hashes_of_equal_prompts_differ_between_tenants():
    bm = BlockManager(num_blocks=8, block_size=4)
    ids = list(range(9))
    bm.allocate_prompt("a", ids, salt="alice")
    bm.mark_computed("a", ids, 9)
    bm.allocate_prompt("m", ids, salt="mallory")
    assert bm.cached_prefix_len(ids, salt="mallory") == 0
    assert bm.cached_prefix_len(ids, salt="alice") == 8
    assert bm._seq_hashes["a"] and not set(bm._seq_hashes["a"]) & set(bm._seq_hashes["m"])


# ------------------------------------------------------------------ 5. priority
def test_priority_is_a_grant_in_a_bounded_range(srv):
    url, _ = srv
    r = post(url, "mallory", {"prompt": [5, 6], "max_tokens": 1, "priority": 100})
    assert r.status_code == 400 and r.json()["error"]["code"] == "priority_out_of_range"
    r = post(url, "mallory", {"prompt": [5, 6], "max_tokens": 1, "priority": 10 ** 30})
    assert r.status_code == 400
    r = post(url, "mallory", {"prompt": [5, 6], "max_tokens": 1, "priority": 1})
    err = r.json()["error"]
    assert r.status_code == 403 and err["code"] == "priority_not_granted"
    assert "may_set_priority" in err["message"]
    r = post(url, "teacher", {"prompt": [5, 6], "max_tokens": 1, "priority": 5})
    assert r.status_code == 200 and r.json()["minserve"]["priority"] == 5


def test_an_open_server_fixes_priority_unless_the_operator_allows_it():
    with shared(app_kw={"api_keys": None}) as (url, _):
        r = post(url, None, {"prompt": [5], "max_tokens": 1, "priority": 2})
        assert r.status_code == 403
    with shared(app_kw={"api_keys": None, "allow_priority": True}) as (url, _):
        assert post(url, None, {"prompt": [5], "max_tokens": 1, "priority": 2}).status_code == 200


# ------------------------------------------------------------------ 6. fair shares
def test_a_tenant_cannot_charge_or_read_another_tenants_counter(srv):
    url, engine = srv
    post(url, "alice", {"prompt": [3, 4], "max_tokens": 2, "user": "alice"})
    counters = engine.scheduler.policy.counters
    before = counters["alice"]
    for _ in range(3):  # mallory poses as alice's session
        post(url, "mallory", {"prompt": [3, 4, 5], "max_tokens": 4, "user": "alice"})
    assert counters["alice"] == before  # before sessions lived in their tenant: 5 -> 2,242
    mine = httpx.get(url + "/scheduler/stats", headers={**key("mallory"),
                                                        "X-Session-Id": "alice"}).json()
    own = mine["policy"]["own_session"]
    assert own["session"] == "mallory" and "counters" not in mine["policy"]


def test_fresh_sessions_do_not_raise_a_tenants_fair_share():
    """The fair policy counts per tenant: a new `user` per request is still one tenant."""
    p = FairPolicy()
    from minserve.request import Request

    for i in range(6):
        r = Request(request_id=f"m{i}", prompt_token_ids=[1], sampling=SamplingParams(),
                    arrival_seq=i, session_id=f"mallory/s{i}", tenant="mallory")
        p.on_request_arrived(r)
    assert set(p.counters) == {"mallory"}


def test_a_tenant_that_fills_its_share_of_the_queue_gets_the_429_and_the_others_queue():
    """G1 per tenant (H6): mallory alone may fill the queue; then her next request gets
    the 429 naming the gate and her share, and alice's request still queues and runs
    (mallory's newest waiting request makes room). Stats show alice her own share only."""
    with shared(slow_decode_s=0.03, shares="equal", max_batch_size=1,
                max_queue_size=2) as (url, engine):
        out = {}

        def send(i):
            out[i] = post(url, "mallory", {"prompt": [5, i], "max_tokens": 30,
                                           "ignore_eos": True, "user": f"s{i}"}, timeout=60)
        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.2)  # in order: one runs, two wait
        assert engine.scheduler.active and len(engine.scheduler.policy) == 2
        r = post(url, "mallory", {"prompt": [5, 9], "max_tokens": 2, "user": "s9"})
        err = r.json()["error"]
        assert r.status_code == 429 and err["gate"] == "G1" and err["code"] == "queue_share"
        assert "share" in err["message"] and err["numbers"]["share"] == 2
        mine = httpx.get(url + "/scheduler/stats", headers=key("alice")).json()["shares"]
        assert set(mine) == {"contenders", "own"}  # no other tenant's holdings
        a = post(url, "alice", {"prompt": [7, 8], "max_tokens": 2, "ignore_eos": True},
                 timeout=60)
        assert a.status_code == 200, a.text
        for t in threads:
            t.join()
        codes = sorted(o.status_code for o in out.values())
        assert codes == [200, 200, 429], codes  # the newest waiting one made room
        pushed = next(o for o in out.values() if o.status_code == 429).json()["error"]
        assert pushed["code"] == "queue_share" and pushed["gate"] == "G1"


# ------------------------------------------------------------------ 7. bounded state
def test_sessions_and_priorities_stay_under_the_cap():
    engine = Engine(EngineConfig(**{**SMALL, "policy": "fair", "fair_max_sessions": 20}),
                    model=tiny_chat()[0])
    p = engine.scheduler.policy
    for i in range(200):  # before the bound: 200 sessions kept, one per priority value
        engine.submit([1, 2], SamplingParams(max_tokens=1), session_id=f"s{i}", priority=i)
        while engine.scheduler.has_work():
            engine.step()
    assert len(p.counters) <= 20 and len(p._last_left) <= 20 and len(p._last_active) <= 20


# ------------------------------------------------------------------ 3. one request, everyone
def test_a_request_over_its_share_of_the_kv_budget_is_refused_naming_the_rule():
    with shared(max_request_kv_share=0.5) as (url, engine):
        r = post(url, "mallory", {"prompt": [1], "max_tokens": 199, "ignore_eos": True})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "request_too_large"
        assert "max_request_kv_share" in err["message"] and err["param"] == "max_tokens"
        # omitted max_tokens: the default shrinks to fit instead
        assert post(url, "mallory", {"prompt": [1]}).status_code == 200


def test_small_chats_get_rows_while_the_largest_allowed_request_runs():
    with shared(slow_decode_s=0.05, max_request_kv_share=0.5,
                max_tenant_kv_share=0.5) as (url, engine):
        big = {}
        t = threading.Thread(target=lambda: big.update(r=post(
            url, "mallory", {"prompt": [1], "max_tokens": 99, "ignore_eos": True}, timeout=60)))
        t.start()
        while not engine.scheduler.active:
            time.sleep(0.01)
        small = [post(url, "alice", {"prompt": [2, 3, 4], "max_tokens": 2, "ignore_eos": True})
                 for _ in range(3)]
        assert [r.status_code for r in small] == [200] * 3
        assert t.is_alive()  # the maximal request is still running: nobody waited for it
        t.join()
        assert big["r"].status_code == 200


def test_a_tenant_over_its_kv_share_waits_while_another_tenant_goes_first(tiny_model):
    engine = Engine(EngineConfig(device="cpu", max_batch_size=4, kv_budget_tokens=100,
                                 num_blocks=16, max_tenant_kv_share=0.5), model=tiny_model)
    ids = list(range(10))
    m1 = engine.submit(ids, SamplingParams(max_tokens=30, ignore_eos=True), tenant="mallory")
    m2 = engine.submit(ids, SamplingParams(max_tokens=30, ignore_eos=True), tenant="mallory")
    a = engine.submit(ids, SamplingParams(max_tokens=30, ignore_eos=True), tenant="alice")
    engine.step()
    running = {r.request_id for r in engine.scheduler.prefilling + engine.scheduler.active}
    assert running == {m1.request_id, a.request_id}  # m2 would take mallory past 50 of 100
    why = engine.explain(m2.request_id)
    assert why["held_by"]["reason"] == "tenant_share"
    while engine.scheduler.has_work():
        engine.step()
    assert all(h.output.finish_reason == "length" for h in (m1, m2, a))


# ------------------------------------------------------------------ 8. explain
def test_explain_names_no_other_request_or_session_and_ids_cannot_be_hijacked():
    with shared(slow_decode_s=0.05, max_batch_size=1,
                app_kw={"api_keys": None}) as (url, engine):
        out = {}

        def send(name, session, n):
            out[name] = post(url, None, {"prompt": [7, 8], "max_tokens": n, "ignore_eos": True},
                             headers={"X-Request-Id": "job-1", "X-Session-Id": session},
                             timeout=60)

        t1 = threading.Thread(target=send, args=("bob", "bob", 20))
        t1.start()
        while not engine.scheduler.active:
            time.sleep(0.01)
        t2 = threading.Thread(target=send, args=("eve", "eve", 3))  # same id, other session
        t2.start()
        while not engine.scheduler.pending:
            time.sleep(0.01)
        t3 = threading.Thread(target=send, args=("carol", "carol", 3))
        t3.start()
        while len(engine.scheduler.pending) < 2:
            time.sleep(0.01)
        ex = httpx.get(url + "/scheduler/explain/job-1", headers={"X-Session-Id": "carol"})
        held = ex.json()["held_by"]
        assert held["request_id"] is None and "bob" not in ex.text and "eve" not in ex.text
        # bob's explain is bob's, whatever eve named her request
        mine = httpx.get(url + "/scheduler/explain/job-1", headers={"X-Session-Id": "bob"})
        assert mine.json()["state"] == "active" and mine.json()["session"] == "bob"
        for t in (t1, t2, t3):
            t.join()
        assert {r.status_code for r in out.values()} == {200}
        assert out["eve"].headers["x-request-id"] == "job-1"
        done = httpx.get(url + "/scheduler/explain/job-1", headers={"X-Session-Id": "bob"})
        assert done.json()["state"] == "finished" and done.json()["tokens_so_far"] == 20


# ------------------------------------------------------------------ 9. smaller defects
def test_the_smaller_defects_of_item_9_are_answered_properly(srv):
    url, _ = srv
    ok = {"prompt": [1, 2], "max_tokens": 2}
    assert post(url, "alice", {**ok, "temperature": 1e-46}).status_code == 200
    assert post(url, "alice", {**ok, "temperature": 1.0, "top_p": 1e-300}).status_code == 200
    r = post(url, "alice", {"prompt": [1] * 300_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
    r = httpx.post(url + "/v1/nothing", headers=key("alice"), content=b"x")
    assert r.status_code == 404
    r = httpx.post(url + "/v1/completions", json=ok, headers=[
        *key("alice").items(), ("X-Session-Id", "a"), ("X-Session-Id", "b")])
    assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_session_id"
    assert httpx.head(url + "/health").status_code == 200
    r = httpx.post(url + "/v1/completions", headers={**key("alice"),
                                                     "Content-Type": "application/json"})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]


def test_nan_logits_fail_their_row_under_greedy_too():
    with pytest.raises(ValueError, match="NaN"):
        Sampler.sample_row(torch.tensor([0.1, float("nan"), 0.3]), SamplingParams(), None)
    assert SamplingParams(temperature=1e-46).greedy


# ------------------------------------------------------------------ the keys file
def test_the_keys_file_is_validated_and_the_start_up_line_says_who_shares_what(tmp_path):
    f = tmp_path / "keys.json"
    strong = {k + "-strong": v for k, v in KEYS.items()}  # a file's keys: 16 or more
    f.write_text(json.dumps(strong))
    keys = load_api_keys(str(f))
    assert keys["key-teacher-01-strong"].may_set_priority
    assert not keys["key-alice-0001-strong"].may_set_priority
    assert "priority granted to: teacher" in tenancy_line(keys, None, False)
    assert "one tenant (no key)" in tenancy_line(None, None, False)
    for bad, says in (({"short": {"tenant": "a"}}, "use 8 or more"),
                      ({"key-long-enough": {"tenant": "a/b"}}, "letters, digits"),
                      ({"key-long-enough": {"tenant": "a", "admin": True}}, "unknown field"),
                      ([], "JSON object")):
        with pytest.raises(ValueError, match=says):
            parse_api_keys(bad)

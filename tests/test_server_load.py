"""Overload and hang-ups over real sockets (SPEC G1, G4, H3, R2).

* Load: 64 concurrent streaming clients send 300 requests at a server whose
  pending queue holds 8. Every request must end one of two honest ways: a 200
  stream with exactly `max_tokens` tokens, or a 429 naming its gate. Nothing
  may hang (every wait has a timeout), and afterwards the engine is drained:
  no reservation, no block referenced, no queue (R2).
* Disconnect: clients that hang up mid-stream, or while still queued, get their
  requests cancelled; nothing they held stays behind (H3).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from .test_server import serving, wait_until

N_REQUESTS, N_CLIENTS = 300, 64
LOAD = dict(max_model_len=512, max_batch_size=4, max_queue_size=8, kv_budget_tokens=400,
            num_blocks=128)


def plan(i: int) -> tuple[str, dict]:
    """Request i: chat or completion, prompts of 1..23 tokens, 1..12 new tokens; every 30th
    asks for more KV than the whole budget (G2 can never admit it)."""
    max_tokens = 420 if i % 30 == 29 else 1 + i % 12
    body = {"max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}, "user": f"user-{i % 5}"}
    if i % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user",
                                                              "content": f"request {i}"}]}
    return "/v1/completions", {**body, "prompt": [100 + (7 * i + j) % 40000
                                                  for j in range(1 + i % 23)]}


async def one_request(client: httpx.AsyncClient, i: int) -> dict:
    path, body = plan(i)
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            err = json.loads(await r.aread())["error"]
            return {"status": r.status_code, "gate": err.get("gate"), "code": err.get("code"),
                    "numbers": err.get("numbers"), "retry_after": r.headers.get("retry-after"),
                    "max_tokens": body["max_tokens"]}
        datas = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
    chunks = [json.loads(d) for d in datas[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    return {"status": 200, "done": datas[-1] == "[DONE]", "finish": finishes[-1],
            "open_finishes": [f for f in finishes[:-1] if f is not None],
            "usage": chunks[-1]["usage"], "max_tokens": body["max_tokens"]}


async def run_load(url: str) -> list[dict]:
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(N_REQUESTS):
        todo.put_nowait(i)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=N_CLIENTS, max_keepalive_connections=N_CLIENTS)

    async def client_loop(client):
        while not todo.empty():
            res = await one_request(client, todo.get_nowait())
            results.append(res)
            if res["status"] == 429:  # a polite client backs off a little before its next try
                await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        await asyncio.wait_for(asyncio.gather(*(client_loop(client) for _ in range(N_CLIENTS))),
                               timeout=120)
    return results


def test_overload_gives_every_request_a_full_stream_or_a_429_and_drains():
    with serving(**LOAD) as (url, engine):
        t0 = time.perf_counter()
        results = asyncio.run(run_load(url))
        elapsed = time.perf_counter() - t0
        wait_until(engine.scheduler.is_drained, timeout=10, what="R2 drain")
        engine.check_invariants()
        stats = engine.stats()

    assert len(results) == N_REQUESTS
    ok = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    assert len(ok) + len(refused) == N_REQUESTS, {r["status"] for r in results}
    for r in ok:  # accepted -> complete, exact length, a clean end
        assert r["done"] and r["finish"] == "length" and not r["open_finishes"]
        assert r["usage"]["completion_tokens"] == r["max_tokens"] <= 12
    for r in refused:  # refused -> a gate, its reason and numbers, and when to come back
        assert (r["gate"], r["code"]) in (("G1", "queue_full"), ("G2", "kv_budget_exceeded"))
        assert r["numbers"] and r["retry_after"] == "1"
        assert r["gate"] == "G2" or r["numbers"]["pending"] >= LOAD["max_queue_size"]
    assert all(r["status"] == 429 for r in results if r["max_tokens"] == 420)
    by_gate = {g: sum(r["gate"] == g for r in refused) for g in ("G1", "G2")}
    assert stats["rejected"]["G1"] == by_gate["G1"] and stats["rejected"]["G2"] == by_gate["G2"]
    assert stats["finished"] == N_REQUESTS and ok and refused
    assert stats["active_kv_reserved"] == 0 and stats["blocks"]["used"] == 0  # R2
    print(f"\nload: {len(ok)} x 200, {by_gate['G1']} x 429 G1, {by_gate['G2']} x 429 G2 in "
          f"{elapsed:.1f} s; {sum(r['usage']['completion_tokens'] for r in ok)} tokens streamed")


# ============================================================ disconnects (H3)
def read_content_chunks(lines, n: int) -> None:
    got = 0
    for line in lines:
        if line.startswith("data: {") and ('"content": "' in line or '"text": "' in line):
            got += 1
            if got == n:
                return
    raise AssertionError("the stream ended early")


@pytest.mark.parametrize("queued_stream", [True, False])
def test_clients_that_hang_up_leave_nothing_behind(queued_stream):
    """Two clients fill the batch and hang up mid-stream; a third hangs up while queued."""
    big = 900  # tokens asked: only a cancel can end these requests early
    with serving(max_batch_size=2, max_model_len=1024, num_blocks=None,
                 kv_budget_tokens=None) as (url, engine):
        engine.trace = []
        body = {"prompt": "Tell me everything.", "max_tokens": big, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=url, timeout=20) as a, httpx.Client(base_url=url,
                                                                       timeout=20) as b:
            with a.stream("POST", "/v1/completions", json=body) as ra, \
                    b.stream("POST", "/v1/completions", json=body) as rb:
                assert ra.status_code == rb.status_code == 200
                # keep the line iterators alive: dropping one closes its connection early
                lines_a, lines_b = ra.iter_lines(), rb.iter_lines()
                read_content_chunks(lines_a, 2)
                read_content_chunks(lines_b, 2)
                # The batch is full: a third request waits in `pending`, its client gives up.
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(url + "/v1/completions", timeout=httpx.Timeout(20, read=0.5),
                               json={**body, "stream": queued_stream})
                wait_until(lambda: engine.stats()["queues"]["pending"] == 0, timeout=5,
                           what="the queued request to be cancelled")
                rids = [ra.headers["x-request-id"], rb.headers["x-request-id"]]
            # leaving both `with` blocks closes the two connections mid-stream
        wait_until(engine.scheduler.is_drained, timeout=10, what="R2 after hang-ups")
        engine.check_invariants()
        stats = engine.stats()
        trace = list(engine.trace)
    admitted = [a["request_id"] for rec in trace for a in rec.admit.admitted]
    evicted = {e["request_id"]: e["finish_reason"] for rec in trace for e in rec.evict.evicted}
    assert admitted == rids  # the queued request was never admitted: cancelled while pending
    assert evicted == {rid: "cancelled" for rid in rids}
    assert stats["tokens_generated"] < big  # two requests of 900 tokens each, cut short
    assert stats["active_kv_reserved"] == 0 and stats["blocks"]["used"] == 0


def test_non_streaming_client_that_times_out_cancels_its_running_request():
    """Without a stream there is no write to fail: the server must notice the hang-up itself."""
    with serving(max_model_len=1024, num_blocks=None,
                 kv_budget_tokens=None) as (url, engine):
        engine.trace = []
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", timeout=httpx.Timeout(20, read=0.5),
                       json={"prompt": "Go on and on.", "max_tokens": 900, "ignore_eos": True})
        wait_until(engine.scheduler.is_drained, timeout=10, what="R2 after the hang-up")
        evicted = [e["finish_reason"] for rec in engine.trace for e in rec.evict.evicted]
        assert evicted == ["cancelled"] and engine.stats()["tokens_generated"] < 900

"""The attacks on a shared server (docs/security.md), replayed small and on loopback: one figure each.

    python scripts/shared_server_attacks.py [NAME ...]    # all attacks, a JSON line each

Each attack runs the HTTP server (`BackgroundServer`) over a tiny random model, so a
run takes about a minute on two cores, and uses only the HTTP API (and, for the
fault, the engine's model), so the same script measures the code before and after
the fix. Where the server knows tenants (`create_app(..., api_keys=...)`), the
attacker and the victim get a key each; before, they differ only by `user`.
docs/security.md lists the figures before and after.
"""

from __future__ import annotations

import inspect
import json
import socket
import sys
import threading
import time
from typing import Any

import httpx

from minserve.config import EngineConfig
from minserve.engine import Engine
from minserve.models import tiny_llama
from minserve.sampling import SamplingParams
from minserve.server.api import create_app
from minserve.server.cli import BackgroundServer
from minserve.server.limits import ServerLimits

TENANTS = "api_keys" in inspect.signature(create_app).parameters
KEYS = {"key-alice": {"tenant": "alice"}, "key-mallory": {"tenant": "mallory"}}
# with the shared-server limits, what `minserve serve` sets for a shared server (cli.SERVING_DEFAULTS)
SHARED = ({"max_request_kv_share": 0.5, "max_tenant_kv_share": 0.5, "max_rows_per_session": 4}
          if hasattr(EngineConfig, "max_request_kv_share") else {})


def engine(**cfg) -> Engine:
    cfg = {"device": "cpu", **SHARED, **cfg}
    return Engine(EngineConfig(**cfg), model=tiny_llama(eos_token_id=0))


def server(eng: Engine, limits: ServerLimits | None = None, **kw) -> BackgroundServer:
    if TENANTS:
        kw.setdefault("api_keys", KEYS)
    return BackgroundServer(create_app(eng, limits=limits, **kw))


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{who}"} if TENANTS else {}


def complete(url: str, who: str, prompt: list[int], max_tokens: int, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=auth(who), timeout=60,
                      json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                            "temperature": 0, **body})


def fault() -> dict[str, Any]:
    """Item 1: one layer raises once in the decode forward of 8 rows (padded backend)."""
    eng = engine(max_batch_size=8, prefill_chunk_size=8)
    layer, real, fired = eng.model.model.layers[1], None, []
    real = layer.forward

    def faulty(*a, **k):
        if len(eng.scheduler.active) == 8 and not fired:
            fired.append(1)
            raise RuntimeError("injected")
        return real(*a, **k)

    layer.forward = faulty
    with eng:
        hs = [eng.submit(list(range(5, 10 + i)), SamplingParams(max_tokens=6, ignore_eos=True))
              for i in range(8)]
        deadline = time.monotonic() + 10
        while not all(h.finished for h in hs) and time.monotonic() < deadline:
            time.sleep(0.05)
        errors = [h.events[-1].error for h in hs if h.finished]
        alive = eng.running
    return {"attack": "fault in the decode forward, 8 rows", "worker_alive_after": alive,
            "rows_ended": len(errors), "rows_left_hanging": 8 - len(errors)}


def slow_bodies(n: int = 7, seconds: float = 6.0) -> dict[str, Any]:
    """Item 2: all but one connection send Content-Length 100000, then a byte at a time."""
    eng = engine()
    limits = ServerLimits(max_connections=n + 1, body_timeout_s=2.0, header_timeout_s=2.0)
    with server(eng, limits) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        socks, answered = [], []
        for _ in range(n):
            s = socket.create_connection((host, int(port)))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 100000\r\n\r\n{")
            s.settimeout(0.05)
            socks.append(s)
        t0, health = time.monotonic(), None
        while time.monotonic() - t0 < seconds:
            for s in socks:
                if s in answered:
                    continue
                try:
                    s.sendall(b" ")
                    if s.recv(4096):
                        answered.append(s)
                except TimeoutError:
                    pass  # nothing yet: the server still waits for the body
                except OSError:
                    answered.append(s)
            if health is None and time.monotonic() - t0 > 1.0:
                try:
                    r = httpx.get(srv.url + "/health", timeout=2)
                    health = f"{r.status_code} {r.headers.get('content-type', '')}"
                except httpx.HTTPError as e:
                    health = type(e).__name__
            time.sleep(0.5)
        for s in socks:
            s.close()
    return {"attack": f"{n} slow bodies of max_connections={n + 1}, a byte every ~0.9 s, "
                      "body_timeout_s=2",
            "connections_answered_within_s": {str(seconds): len(answered)},
            "health_during": health}


def maximal_request() -> dict[str, Any]:
    """Item 3: one request reserves the whole KV budget; three small chats arrive."""
    eng = engine(num_blocks=32, block_size=16, max_model_len=512, max_batch_size=8)
    with server(eng) as srv:
        big = {}

        def maximal():
            big["r"] = complete(srv.url, "mallory", [1], 511)
            big["done"] = time.monotonic()

        t = threading.Thread(target=maximal)
        t.start()
        time.sleep(0.05)
        t0 = time.monotonic()
        small = [complete(srv.url, "alice", [2, 3, 4], 8) for _ in range(3)]
        waited, small_done = time.monotonic() - t0, time.monotonic()
        t.join()
        big_status = big["r"].status_code
        largest = None
        if big_status == 400:  # refused: the largest request allowed, with the same chats
            cap = eng.request_kv_cap
            t = threading.Thread(target=lambda: (big.update(r=complete(
                srv.url, "mallory", [1], cap - 1)), big.update(done=time.monotonic())))
            t.start()
            time.sleep(0.05)
            t0 = time.monotonic()
            small = [complete(srv.url, "alice", [2, 3, 4], 8) for _ in range(3)]
            waited, small_done = time.monotonic() - t0, time.monotonic()
            t.join()
            largest = cap - 1
        big_tokens = (big["r"].json().get("usage") or {}).get("completion_tokens")
    return {"attack": "prompt [1], max_tokens 511 of a 512-token KV budget",
            "maximal_status": big_status, "then_ran_max_tokens": largest,
            "maximal_tokens": big_tokens,
            "small_statuses": [r.status_code for r in small],
            "small_chats_ended_after_the_maximal": small_done >= big["done"],
            "three_small_chats_s": round(waited, 2)}


def cache_probe() -> dict[str, Any]:
    """Item 4: alice sends a prompt; mallory tries candidates and reads cached_tokens."""
    eng = engine(block_size=16, enable_prefix_caching=True)
    secret = list(range(40, 72))  # 32 tokens: two full blocks
    candidates = [list(range(40 + d, 72 + d)) for d in range(4)]
    with server(eng) as srv:
        complete(srv.url, "alice", secret, 2, user="alice")
        got = [complete(srv.url, "mallory", c, 2, user="mallory").json()["usage"]
               ["prompt_tokens_details"]["cached_tokens"] for c in candidates]
        own = complete(srv.url, "alice", secret, 2, user="alice").json()["usage"][
            "prompt_tokens_details"]["cached_tokens"]
    return {"attack": "prefix-cache probe", "mallory_cached_tokens_per_candidate": got,
            "alice_cached_tokens_again": own}


def priority_starvation(loops: int = 3, priority: int = 100) -> dict[str, Any]:
    """Item 5: loops at priority 100 against one innocent request at priority 0."""
    eng = engine(max_batch_size=1)
    out: dict[str, Any] = {"attack": f"{loops} loops at priority {priority}, batch of 1"}
    with server(eng) as srv:
        stop, statuses = threading.Event(), []

        def loop():
            while not stop.is_set():
                statuses.append(complete(srv.url, "mallory", [5, 6, 7], 16,
                                         priority=priority).status_code)

        threads = [threading.Thread(target=loop) for _ in range(loops)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        r = complete(srv.url, "alice", [8, 9], 4)
        out["innocent_wait_s"] = round(time.monotonic() - t0, 3)
        served_before = sum(s == 200 for s in statuses)
        stop.set()
        for t in threads:
            t.join()
        out.update(innocent_status=r.status_code, attacker_statuses=sorted(set(statuses)),
                   attacker_requests_served_meanwhile=served_before)
        big = complete(srv.url, "mallory", [5], 2, priority=10**30)
        out["priority_1e30_status"] = big.status_code
    return out


def fair_counters(n: int = 20) -> dict[str, Any]:
    """Item 6: mallory sends `user: alice`, then reads alice's counter."""
    eng = engine(policy="fair")
    with server(eng) as srv:
        complete(srv.url, "alice", [3, 4], 2, user="alice")

        def alice_counter(who: str):
            s = httpx.get(srv.url + "/scheduler/stats", headers={**auth(who),
                          "X-Session-Id": "alice"}).json()["policy"]
            own = s.get("own_session") or {}
            counters = s.get("counters") or {}
            return own.get("counter", counters.get("alice", counters.get("alice/alice")))

        before = alice_counter("alice")
        for _ in range(n):
            complete(srv.url, "mallory", [3, 4, 5, 6], 8, user="alice")
        after = alice_counter("alice")
        seen = httpx.get(srv.url + "/scheduler/stats", headers={
            **auth("mallory"), "X-Session-Id": "alice"}).json()["policy"].get("own_session")
    return {"attack": f"mallory sends {n} requests as user alice",
            "alice_counter_before": before, "alice_counter_after": after,
            "mallory_asks_for_alice_and_reads": seen}


def session_flood(n: int = 1000, cap: int = 100) -> dict[str, Any]:
    """Item 7: fresh sessions and fresh priorities under fair_max_sessions."""
    eng = engine(policy="fair", fair_max_sessions=cap, max_batch_size=8)
    p = eng.scheduler.policy
    for i in range(n):
        try:
            eng.submit([1, 2], SamplingParams(max_tokens=1), session_id=f"s{i}", priority=i)
        except ValueError:
            pass
        if i % 8 == 7:
            while eng.scheduler.has_work():
                eng.step()
    while eng.scheduler.has_work():
        eng.step()
    stored = {len(getattr(p, name, {})) for name in ("counters", "_last_left")}
    return {"attack": f"{n} sessions, each its own priority, fair_max_sessions={cap}",
            "sessions_stored": max(stored)}


def explain_leak() -> dict[str, Any]:
    """Item 8: explain names the request that holds the caller's."""
    eng = engine(max_batch_size=1)
    with server(eng) as srv:
        ts = [threading.Thread(target=lambda: complete(srv.url, "mallory", [1, 2], 400))
              for _ in range(2)]  # one runs, one waits at the head
        for t in ts:
            t.start()
            time.sleep(0.1)
        mine = threading.Thread(target=lambda: httpx.post(
            srv.url + "/v1/completions", headers={**auth("alice"), "X-Request-Id": "a-1"},
            json={"prompt": [3], "max_tokens": 2}, timeout=60))
        mine.start()
        time.sleep(0.2)
        ex = httpx.get(srv.url + "/scheduler/explain/a-1", headers=auth("alice")).json()
        for t in ts:
            t.join()
        mine.join()
    held = ex.get("held_by") or {}
    return {"attack": "explain of a waiting request", "held_by_names_a_request":
            held.get("request_id") is not None, "held_by": held}


def small_defects() -> dict[str, Any]:
    eng = engine()
    with server(eng) as srv:
        u, h = srv.url, auth("alice")
        out = {
            "temperature_1e-46": complete(u, "alice", [1, 2], 2, temperature=1e-46).status_code,
            "top_p_1e-300": complete(u, "alice", [1, 2], 2, temperature=1.0,
                                     top_p=1e-300).status_code,
            "500k_token_ids": httpx.post(u + "/v1/completions", headers=h, timeout=60, json={
                "prompt": [1] * 500_000, "max_tokens": 1}).status_code,
            "unknown_post_path": httpx.post(u + "/v1/nothing", headers=h,
                                            content=b"x").status_code,
            "two_session_headers": httpx.post(
                u + "/v1/completions", json={"prompt": [1], "max_tokens": 1},
                headers=[*h.items(), ("X-Session-Id", "a"), ("X-Session-Id", "b")]).status_code,
            "head_health": httpx.head(u + "/health").status_code,
        }
        empty = httpx.post(u + "/v1/completions", headers={**h, "Content-Type": "application/json"})
        out["empty_body"] = f"{empty.status_code} {empty.json()['error']['message'][:60]}"
    return {"attack": "item 9", **out}


def equal_priority() -> dict[str, Any]:
    """Item 5's baseline: the same loops at priority 0."""
    return priority_starvation(priority=0)


# ---------------------------------------------------------------- shares (SPEC H6)
# The server's own defaults (cli.SERVING_DEFAULTS as the measured code has them), small:
# what a student meets. The innocent's first token is counted in ticks (robust on a busy
# machine) and seconds.
def served(**over) -> Engine:
    from minserve.server.cli import SERVING_DEFAULTS

    cfg = {**SERVING_DEFAULTS, "device": "cpu", "decode_attention": "torch", **over}
    return Engine(EngineConfig(**cfg), model=tiny_llama(eos_token_id=0))


def ids(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


def watch(eng: Engine) -> dict[str, dict[str, Any]]:
    """Request id -> tenant, the tick and time it was submitted and admitted (in
    mixed_batch prefill a short prompt's first token comes in its admission tick). Read
    from the engine, not the stream: a random model's tokens often detokenize to nothing."""
    seen: dict[str, dict[str, Any]] = {}
    s = eng.scheduler
    submit, admit = s.submit, s._admit

    def on_submit(req):
        seen[req.request_id] = {"tenant": req.tenant, "submitted": (s.tick_count, time.monotonic())}
        return submit(req)

    def on_admit(req):
        seen.setdefault(req.request_id, {}).setdefault("admitted", (s.tick_count, time.monotonic()))
        return admit(req)

    s.submit, s._admit = on_submit, on_admit
    return seen


def first_token(url: str, eng: Engine, seen: dict, who: str, prompt: list[int],
                max_tokens: int) -> dict[str, Any]:
    """Send one request; its status and the ticks and seconds to its admission (its
    first token: a short prompt prefills in one tick)."""
    before = set(seen)
    r = complete(url, who, prompt, max_tokens)
    mine = [v for k, v in seen.items() if k not in before and v.get("tenant") == who]
    if r.status_code != 200 or not mine or "admitted" not in mine[0]:
        return {"status": r.status_code}
    (t0, s0), (t1, s1) = mine[0]["submitted"], mine[0]["admitted"]
    return {"status": 200, "ticks": t1 - t0 + 1, "s": round(s1 - s0, 3)}


def flood(url: str, who: str, n: int, prompt_len: int, max_tokens: int,
          sessions: bool = True, gap_s: float = 0.0) -> list[threading.Thread]:
    out = []
    for i in range(n):
        body = {"user": f"s{i}"} if sessions else {}
        t = threading.Thread(target=complete, args=(url, who, ids(i, prompt_len), max_tokens),
                             kwargs=body, daemon=True)
        t.start()
        out.append(t)
        time.sleep(gap_s)
    return out


def wait_rows(eng: Engine, n: int, timeout: float = 30.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rows = len(eng.scheduler.active) + len(eng.scheduler.prefilling)
        if rows >= n:
            return rows
        time.sleep(0.01)
    return len(eng.scheduler.active) + len(eng.scheduler.prefilling)


def lone_client() -> dict[str, Any]:
    """One client, no `user` (most SDKs), 16 requests at once on a 16-row batch."""
    eng = served(max_batch_size=16, num_blocks=256)
    with server(eng) as srv:
        threads = flood(srv.url, "mallory", 16, 16, 200, sessions=False)
        peak = 0
        for _ in range(200):
            peak = max(peak, len(eng.scheduler.active) + len(eng.scheduler.prefilling))
            time.sleep(0.01)
        for t in threads:
            t.join()
    return {"attack": "one client without `user`, 16 requests, 16 rows",
            "peak_rows": peak, "max_batch_size": 16}


def session_flood_ttft() -> dict[str, Any]:
    """mallory: 32 requests in 16 invented sessions on an 8-row batch; alice's first token."""
    eng = served(max_batch_size=8, num_blocks=512)
    seen = watch(eng)
    with server(eng) as srv:
        idle = first_token(srv.url, eng, seen, "alice", ids(99, 16), 4)
        threads = flood(srv.url, "mallory", 32, 16, 120, gap_s=0.005)
        wait_rows(eng, 8)
        time.sleep(0.1)
        hit = first_token(srv.url, eng, seen, "alice", ids(98, 16), 4)
        for t in threads:
            t.join()
    return {"attack": "32 requests of mallory in 16 sessions (max_tokens 120), 8 rows",
            "alice_idle": idle, "alice_under_attack": hit,
            "bound_ticks": 120 + 1 + 2}


def queue_flood() -> dict[str, Any]:
    """mallory fills the pending queue (16 places); alice sends 3 requests."""
    eng = served(max_batch_size=4, max_queue_size=16, num_blocks=256)
    with server(eng) as srv:
        threads = flood(srv.url, "mallory", 24, 16, 100, gap_s=0.005)
        wait_rows(eng, 4)
        time.sleep(0.2)
        alice = [complete(srv.url, "alice", ids(90 + i, 8), 4) for i in range(3)]
        for t in threads:
            t.join()
    return {"attack": "mallory: 24 requests on 4 rows and a 16-place queue; alice: 3",
            "alice_statuses": [r.status_code for r in alice],
            "alice_codes": [(r.json().get("error") or {}).get("code") for r in alice
                            if r.status_code != 200]}


def preempt_victim() -> dict[str, Any]:
    """--admission preempt: mallory's 3 rows grow past its share; alice arrives last."""
    eng = served(admission="preempt", max_batch_size=4, num_blocks=24)
    seen = watch(eng)
    with server(eng) as srv:
        threads = flood(srv.url, "mallory", 3, 16, 150, gap_s=0.01)
        wait_rows(eng, 3)
        time.sleep(0.1)
        alice = first_token(srv.url, eng, seen, "alice", ids(97, 16), 150)
        for t in threads:
            t.join()
    pre: dict[str, int] = {}
    for done in eng.scheduler.recent_finished.values():
        who = str(done.get("session", "")).split("/")[0]
        pre[who] = pre.get(who, 0) + done["preemptions"]
    return {"attack": "preempt: 3 rows of mallory, then alice, 384 KV tokens",
            "preemptions": pre, "alice_first_token": alice}


def split_prompt() -> dict[str, Any]:
    """alice's stream runs; mallory sends 16 prompts of 256 tokens at once. Every tick
    decodes alice's row, so her longest gap between tokens is the longest tick."""
    eng = served(max_batch_size=32, num_blocks=1024)
    planned: list[int] = []
    ticks: list[float] = []
    plan, tick = eng.scheduler._plan_prefill, eng.scheduler.step

    def counted():
        pieces = plan()
        planned.append(sum(end - start for _, start, end in pieces))
        return pieces

    def timed():
        t0 = time.monotonic()
        rec = tick()
        ticks.append(time.monotonic() - t0)
        return rec

    eng.scheduler._plan_prefill, eng.scheduler.step = counted, timed
    with server(eng) as srv:
        t = threading.Thread(target=complete, args=(srv.url, "alice", ids(96, 8), 300))
        t.start()
        wait_rows(eng, 1)
        time.sleep(0.1)
        quiet = max(ticks[-20:])
        threads = flood(srv.url, "mallory", 16, 256, 4)
        for th in threads + [t]:
            th.join()
    return {"attack": "16 prompts of 256 tokens at once beside alice's stream",
            "max_prompt_tokens_in_a_tick": max(planned),
            "alice_longest_gap_s": round(max(ticks), 3), "quiet_tick_s": round(quiet, 3)}


ATTACKS = [fault, slow_bodies, maximal_request, cache_probe, priority_starvation,
           equal_priority, fair_counters, session_flood, explain_leak, small_defects,
           lone_client, session_flood_ttft, queue_flood, preempt_victim, split_prompt]


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or [a.__name__ for a in ATTACKS]
    for attack in ATTACKS:
        if attack.__name__ in names:
            try:
                print(json.dumps({"name": attack.__name__, **attack()}), flush=True)
            except Exception as e:  # an attack the old code cannot even run: say so
                print(json.dumps({"name": attack.__name__, "error": repr(e)[:300]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

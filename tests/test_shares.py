"""Shares of what is contended (SPEC H6, minserve/shares.py, docs/security.md).

Each test runs the engine `minserve serve` builds (its SERVING_DEFAULTS: the fair policy,
shares on, a per-tick prompt budget), made small, and replays one finding of a shared
server: a lone client held to a few rows, a flood of invented sessions, a full queue,
a KV cap that ignores who is there, preemption of the newcomer, a prompt split across
many requests. Every tick is checked (R1 and the queues) as it runs.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from minserve import Engine, SamplingParams
from minserve.server.cli import SERVING_DEFAULTS, add_serve_arguments, engine_config_from_args


def served(model, **over) -> Engine:
    """The engine `minserve serve` runs (its defaults), small, on the CPU."""
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    cfg = engine_config_from_args(p.parse_args([]), {}, defaults=SERVING_DEFAULTS)
    return Engine(cfg.replace(device="cpu", decode_attention="torch", **over), model=model)


def sp(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def prompt(i: int, n: int = 8) -> list[int]:
    """A prompt no other request shares (no prefix cache hit between tenants)."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(1, 256, (n,), generator=g).tolist()


def step(engine: Engine):
    rec = engine.step()
    engine.check_invariants()  # R1, the queues
    return rec


def running(engine: Engine, tenant: str | None = None) -> list:
    s = engine.scheduler
    return [r for r in s.prefilling + s.active if tenant is None or r.tenant == tenant]


def drain(engine: Engine) -> None:
    for _ in range(2000):
        if not engine.scheduler.has_work():
            return
        step(engine)
    raise AssertionError("did not drain")


def test_one_session_alone_fills_the_batch(tiny_model):
    """A client that sends no `user` (session 'default') and is alone gets every row,
    not a fixed 4 of 64."""
    engine = served(tiny_model, max_batch_size=8, num_blocks=64)
    for i in range(10):
        engine.submit(prompt(i), sp(4))
    step(engine)
    assert len(running(engine)) == 8
    drain(engine)


def test_a_second_tenant_is_admitted_within_one_row_lifetime_and_borrowed_rows_give_way(tiny_model):
    """mallory invents 12 sessions and borrows every row; alice arrives. mallory admits
    nothing new until alice is in, and alice is in within the stated bound: one row's
    lifetime, ceil(prompt / chunk) + max_tokens ticks (docs/security.md). Stats and
    explain say who borrows, who is held back and what each share is now."""
    engine = served(tiny_model, max_batch_size=4, num_blocks=64)
    chunk = engine.config.prefill_chunk_size
    flood = [engine.submit(prompt(i), sp(12), tenant="mallory", session_id=f"s{i}")
             for i in range(12)]
    step(engine)
    step(engine)
    assert len(running(engine, "mallory")) == 4  # alone: it borrows every row
    alice = engine.submit(prompt(99), sp(3), tenant="alice")
    # the rows' remaining lifetime; then the tick whose T3 evicts them (its T1 ran first,
    # T5); alice is admitted by the next tick's T1
    bound = max(math.ceil((r.prefill_len - r.num_computed_prompt_tokens) / chunk)
                + r.max_tokens - len(r.output_token_ids) for r in running(engine)) + 2
    stats, why = engine.stats(), engine.explain(alice.request_id)
    why_flood = engine.explain(flood[6].request_id)
    for ticks in range(1, bound + 1):
        rec = step(engine)
        admitted = [a["request_id"] for a in rec.admit.admitted]
        if alice.request_id in admitted:
            break
        assert not admitted, f"tick {ticks}: {admitted} admitted while alice waits"
    else:
        raise AssertionError(f"alice not admitted within {bound} ticks")
    assert len(running(engine, "mallory")) <= 2 + 1  # its share, plus what nobody wanted
    assert engine.stats()["kv_admit_blocked"]["share"] >= 1  # a share held the head back
    shares = stats["shares"]  # what stats and explain said while alice waited
    assert shares["mallory"]["borrowing"] and shares["mallory"]["held_back"]
    assert shares["mallory"]["share_rows"] == shares["alice"]["share_rows"] == 2
    assert not shares["alice"]["held_back"] and not shares["alice"]["borrowing"]
    assert why["sentence"].startswith("next to be admitted"), why["sentence"]
    assert why["share"]["share_rows"] == 2 and why["share"]["rows"] == 0
    assert why_flood["share"]["borrowing"] and why_flood["share"]["held_back"]
    assert "borrowing" in why_flood["sentence"] and "holds this request back" in why_flood["sentence"]
    drain(engine)


@pytest.mark.parametrize("tenant", [None, "class"])
def test_sessions_share_too_without_keys_and_inside_one_tenant(tiny_model, tenant):
    """Without tenants the sessions are the units; inside one tenant its sessions split
    the tenant's share. Under FCFS (so that only the shares reorder): a session that
    borrowed every row gives the next free row to a newer session, ahead of its own
    earlier requests."""
    engine = served(tiny_model, policy="fcfs", max_batch_size=2, num_blocks=64)
    heavy = [engine.submit(prompt(i), sp(6), session_id="heavy", tenant=tenant)
             for i in range(5)]
    step(engine)
    assert len(running(engine)) == 2  # alone, it borrows both rows
    light = engine.submit(prompt(9), sp(2), session_id="light", tenant=tenant)
    admitted = []
    while light.request_id not in admitted:
        admitted += [a["request_id"] for a in step(engine).admit.admitted]
    # the tick its rows free, each session takes its share, one row: heavy's 4th and 5th
    # wait behind light although they came first
    assert sorted(admitted) == sorted([light.request_id, heavy[2].request_id]), admitted
    drain(engine)


def test_a_tenant_that_fills_its_share_of_the_queue_gets_the_429_not_the_others(tiny_model):
    """G1 per tenant: alone, mallory may fill the queue; a full queue then refuses
    mallory, naming its share, and makes room for alice by pushing out mallory's newest."""
    engine = served(tiny_model, max_batch_size=1, max_queue_size=4, num_blocks=64)
    m = [engine.submit(prompt(i), sp(2), tenant="mallory") for i in range(5)]
    refused = m[4].events[-1].rejection
    assert refused["gate"] == "G1" and refused["reason"] == "queue_share", refused
    assert "share" in refused["message"] and refused["numbers"]["share"] == 4
    a1 = engine.submit(prompt(10), sp(2), tenant="alice")
    assert not a1.finished  # queued: a place was made for it
    pushed = m[3].events[-1].rejection
    assert pushed["gate"] == "G1" and pushed["reason"] == "queue_share"
    a2 = engine.submit(prompt(11), sp(2), tenant="alice")  # alice: 1 of a share of 2
    assert not a2.finished and m[2].finished
    a3 = engine.submit(prompt(12), sp(2), tenant="alice")  # alice now at her share
    assert a3.events[-1].rejection["reason"] == "queue_share"
    assert [h.finished for h in m[:2]] == [False, False]
    drain(engine)
    assert a1.output.finish_reason == a2.output.finish_reason == "length"


def test_kv_shares_follow_how_many_tenants_want_them(tiny_model):
    """Two tenants take the whole KV budget; a third and a fourth arrive. Each share is
    now a quarter: as KV frees, the newcomers go in before the first two's next requests
    (a fixed max_tenant_kv_share=0.5 let those two keep the whole budget)."""
    # FCFS, so that the shares alone put the newcomers first (the fair policy would too)
    engine = served(tiny_model, policy="fcfs", max_batch_size=8, num_blocks=32,
                    kv_budget_tokens=400)
    assert engine.scheduler.kv_budget_tokens == 400
    first = {t: [engine.submit(prompt(10 * k + j, 10), sp(n), tenant=t)
                 for j, n in enumerate((38, 142))] for k, t in enumerate("ab")}
    step(engine)
    assert engine.scheduler.active_kv_reserved == 400
    later = {t: engine.submit(prompt(50 + k, 10), sp(38), tenant=t) for k, t in enumerate("ab")}
    new = {t: engine.submit(prompt(60 + k, 10), sp(20), tenant=t) for k, t in enumerate("cd")}
    share_c = engine.stats().get("shares", {}).get("c", {}).get("share_kv")
    order = []
    for _ in range(60):
        rec = step(engine)
        order += [a["request_id"] for a in rec.admit.admitted]
        if len(order) == 2:
            break
    assert sorted(order) == sorted(h.request_id for h in new.values()), order
    assert all(not h.finished for hs in first.values() for h in hs[1:])  # a2, b2 still run
    assert all(later[t].request_id not in order for t in "ab")
    assert share_c == 100  # a quarter of 400 (stats said so while they waited)
    drain(engine)


def test_under_preempt_rows_above_their_share_are_the_victims(tiny_model):
    """admission="preempt": mallory's three rows grow past its share after admission;
    when decode runs out of KV, its rows are preempted, never alice's (the newest
    arrival, the victim before shares)."""
    engine = served(tiny_model, admission="preempt", max_batch_size=4, num_blocks=12)
    budget = engine.scheduler.kv_budget_tokens  # 192
    mallory = [engine.submit(prompt(i, 10), sp(80), tenant="mallory") for i in range(3)]
    step(engine)
    step(engine)
    alice = engine.submit(prompt(9, 10), sp(80), tenant="alice")
    grown_past_share, victims = False, []
    while engine.scheduler.has_work():
        rec = step(engine)
        victims += [p["request_id"] for p in rec.decode.preempted]
        held = sum(r.reserved_tokens for r in running(engine, "mallory"))
        grown_past_share |= held > budget / 2  # what rows grow counts against the share
    assert grown_past_share and victims
    assert set(victims) <= {h.request_id for h in mallory}, victims
    assert alice.output.finish_reason == "length"
    assert all(h.output.finish_reason == "length" for h in mallory)


def test_a_ticks_prompt_pieces_stay_within_the_budget_split_between_tenants(tiny_model):
    """16 requests of 256 tokens froze another stream: nothing bounded a tick's prompt
    work across rows. Now the pieces of one tick stay within `max_prefill_tokens` (512
    by default), and a tenant with one prompt gets half of it beside the sixteen."""
    engine = served(tiny_model, max_batch_size=32, num_blocks=512)
    budget = 512  # serve's max_prefill_tokens (checked below)
    for i in range(16):
        engine.submit(prompt(i, 256), sp(2), tenant="mallory", session_id=f"s{i}")
    alice = engine.submit(prompt(99, 256), sp(2), tenant="alice")
    per_tick, alice_got = [], []
    while engine.scheduler.has_work():
        rec = step(engine)
        chunks = rec.prefill.chunks
        per_tick.append(sum(c["end"] - c["start"] for c in chunks))
        alice_got.append(sum(c["end"] - c["start"] for c in chunks
                             if c["request_id"] == alice.request_id))
    assert max(per_tick) <= budget, per_tick
    assert alice_got[0] == min(256, budget // 2), alice_got  # half the budget, a chunk at most
    assert sum(per_tick) == 17 * 256
    assert engine.config.max_prefill_tokens == budget


def test_split_is_max_min_fair_and_work_conserving():
    from minserve.shares import split

    assert split(10, [3, 100, 100]) == [3, 4, 3] or sorted(split(10, [3, 100, 100])) == [3, 3, 4]
    assert sum(split(10, [3, 100, 100])) == 10 and split(10, [3, 100, 100])[0] == 3
    assert split(100, [3, 5]) == [3, 5]  # nobody wants more: nothing is forced on anyone
    assert split(0, [4, 4]) == [0, 0] and split(7, []) == []

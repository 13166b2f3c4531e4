"""Disaggregated prefill (SPEC C2, C3, C4, C5, H8): prompts on a worker process, their KV
spliced in at `_promote_to_decode`. Token-exact against HF `generate`, R1 after every phase;
the worker's queue shared between tenants within a budget per forward; a cancel reaching
the worker; each fault (the worker raising on one prompt, dying, hanging, dying too often)
costing as little as it can; and the worker never outliving, hanging or deafening its server.

The worker is a real process (torch.multiprocessing, spawn): each engine here starts one,
~3 s, so the tests share engines where they can.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve import Engine, EngineConfig, SamplingParams, shares
from minserve.bench.health import wait_healthy
from minserve.models import tiny_llama

from .conftest import ROOT, hf_greedy, make_engine, run_checked

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SYSTEM = [7, 8, 9, 10] * 6  # 24 tokens: 6 whole blocks of 4 shared by two prompts
RAISE_ON, KILL_ON = 254, 255  # prompt tokens the worker's model traps (`Trap`): no other prompt has them


class Trap(torch.nn.Module):
    """The model's embedding, as it was, except in a prefill worker process: a forward
    whose tokens hold RAISE_ON raises; one holding KILL_ON waits `hold_s` (time for a test
    to step the engine while it computes), then kills the worker (SIGKILL: what the
    kernel's out-of-memory killer does). Module-level, so that it pickles by name."""

    def __init__(self, embed: torch.nn.Module, hold_s: float = 1.0) -> None:
        super().__init__()
        self.embed, self.hold_s = embed, hold_s

    def forward(self, input_ids):
        if multiprocessing.parent_process() is not None:  # the worker; never the decode side
            if (input_ids == RAISE_ON).any():
                raise ValueError(f"a trap on token {RAISE_ON}")
            if (input_ids == KILL_ON).any():
                time.sleep(self.hold_s)
                os.kill(os.getpid(), signal.SIGKILL)
        return self.embed(input_ids)


@pytest.fixture(scope="module")
def model():
    m = tiny_llama()  # no EOS: every row runs to max_tokens, as HF greedy does here
    m.model.embed_tokens = Trap(m.model.embed_tokens)
    return m


def disagg(model, **cfg):
    cfg = {"backend": "paged", "block_size": 4, "max_batch_size": 4, "max_model_len": 256,
           "prefill_mode": "disaggregated", "prefill_worker_threads": 1,
           "prefill_chunk_size": 16, "max_prefill_tokens": 32, **cfg}
    return make_engine(model, **cfg)


@pytest.fixture(scope="module")
def engine(model):
    # SIGHUP as a terminal leaves it (under nohup the worker would inherit its "ignore")
    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        e = disagg(model)
    finally:
        signal.signal(signal.SIGHUP, old)
    yield e
    e.close()


def tokens(engine, handle) -> list[int]:
    """The tokens a running request has so far (its output is set only at the end)."""
    if handle.finished:
        return handle.output.token_ids
    return list(engine.scheduler.requests[handle.request_id].output_token_ids)


def step_until(engine, cond, limit=2000):
    for _ in range(limit):
        if cond():
            return
        engine.step()
        engine.check_invariants()
    raise AssertionError("condition never held")


def wait_until(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def test_token_exact_with_prefix_caching_and_r1_after_every_phase(engine, model):
    """Three prompts, two sharing a 24-token system prompt: every output equals HF greedy;
    the second of the pair sends only its uncached suffix (its prefix's KV travels to the
    worker instead), and the KV comes back block by block into the row's own blocks."""
    prompts = [SYSTEM + [3, 4, 5], [11, 12, 13, 14, 15] * 5, SYSTEM + [21, 22]]
    s = engine.scheduler
    first = engine.submit(prompts[0], GREEDY)
    run_checked(engine)  # the first computes the system prompt: its blocks are now cached
    handles = [engine.submit(p, GREEDY) for p in prompts[1:]]
    transfers, chunks = {}, []

    def on_phase(name, rec):
        if name == "advance_prefill_chunk":
            transfers.update(rec.remote.get("transfers", {}))
            chunks.extend(rec.chunks)

    run_checked(engine, on_phase=on_phase)
    outs = [first.output] + [h.output for h in handles]
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, p, 6)
    warm = handles[1].request_id
    assert outs[2].num_cached_tokens == 24
    pieces = {}
    for c in chunks:
        pieces.setdefault(c["request_id"], []).append((c["start"], c["end"]))
    assert pieces[warm] == [(24, 26)]  # only the suffix remotely
    cold = handles[0].request_id
    cuts = [a for a, _ in pieces[cold]] + [25]  # in pieces, each at most a chunk (16)
    assert pieces[cold] == list(zip(cuts, cuts[1:])) and len(cuts) > 2
    assert all(b - a <= 16 for a, b in pieces[cold])
    assert transfers[warm]["bytes_to_worker"] == 24 * s.backend.storage.bytes_per_token()
    assert transfers[warm]["blocks"] == 1  # tokens 24..25: one block came back
    assert transfers[cold]["blocks"] == 7 and transfers[cold]["bytes_to_worker"] == 0
    assert transfers[cold]["bytes"] == 7 * 4 * s.backend.storage.bytes_per_token()
    assert s.is_drained() and s.remote.snapshot()["staging_blocks_used"] == 0


def test_the_decode_batch_ticks_on_while_a_prompt_is_on_the_worker(engine, model):
    """The point of it: a row keeps getting a token every tick while another's prompt is
    computed elsewhere; `explain` says where that prompt is."""
    s = engine.scheduler
    stream = engine.submit([1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0,
                                                     ignore_eos=True))
    step_until(engine, lambda: len(tokens(engine, stream)) >= 2)
    os.kill(s.remote.proc.pid, signal.SIGSTOP)  # hold the worker: the prompt stays there
    try:
        long = engine.submit(list(range(30, 130)), GREEDY)
        engine.step()
        assert long.request_id in [j["request_id"] for j in s.remote.snapshot()["on_worker"]]
        said = engine.explain(long.request_id)
        assert said["queue"] == "prefilling" and "on the prefill worker" in said["sentence"]
        before = len(tokens(engine, stream))
        for _ in range(5):
            rec = engine.step()
            engine.check_invariants()
            assert rec.decode.rows == [stream.request_id]  # decoded without waiting
        assert len(tokens(engine, stream)) == before + 5
    finally:
        os.kill(s.remote.proc.pid, signal.SIGCONT)
    run_checked(engine)
    assert long.output.token_ids == hf_greedy(model, list(range(30, 130)), 6)
    assert stream.output.token_ids == hf_greedy(model, [1, 2, 3], 40)


def test_a_cancel_reaches_the_worker_and_an_idle_engine_gets_the_staging_back(engine):
    """A row cancelled with a piece queued on the worker: stats list it as abandoned
    while the worker holds it; the worker drops the queued piece ("drop": never computed,
    never more sent); and an engine with nothing else to do polls the worker, so the
    staging blocks come back without a new request."""
    s = engine.scheduler
    before = dict(s.remote.counters)
    os.kill(s.remote.proc.pid, signal.SIGSTOP)
    try:
        h = engine.submit(list(range(40, 140)), GREEDY)  # 100 tokens: 7 pieces of 16
        engine.step()
        assert s.remote.holds(h.request_id)
        h.cancel()
        engine.step()
        engine.check_invariants()
        assert h.output.finish_reason == "cancelled" and not s.prefilling
        snap = s.remote.snapshot()
        assert [(j["request_id"], j["abandoned"]) for j in snap["on_worker"]] == \
            [(h.request_id, True)]
        assert snap["staging_blocks_used"] > 0  # still the worker's to write
        engine.start()  # serving mode: the worker thread, idle (no request has work)
        time.sleep(0.5)  # the "drop" reaches the worker's queue behind the piece
    finally:
        os.kill(s.remote.proc.pid, signal.SIGCONT)
    try:
        wait_until(lambda: s.remote.snapshot()["staging_blocks_used"] == 0, 30,
                   "the idle engine to free the abandoned prompt's staging")
    finally:
        engine.stop()
    after = s.remote.counters
    assert after["dropped_tokens"] - before["dropped_tokens"] == 16  # its queued piece
    assert after["batches"] - before["batches"] == 1  # nothing more was sent for it
    assert not s.remote.jobs and s.is_drained()


def test_the_decode_side_settles_its_copies_before_the_worker_may_use_the_blocks(
        engine, model, monkeypatch):
    """On a GPU a copy is only queued when it returns, and the worker is another process
    that does not wait for this one's queue: the cached prefix copied into staging must
    be done before the piece is put on the queue, and the splice's read of the staging
    blocks before they are freed for the next prompt (`connector.settle`; on a CPU it has
    nothing to wait for)."""
    from minserve.disagg import connector

    s, log = engine.scheduler, []
    remote = s.remote
    prefix = [61, 62, 63, 64] * 4  # 16 tokens: 4 whole blocks of 4
    first = engine.submit(prefix + [1, 2], GREEDY)
    run_checked(engine)  # its blocks are now cached

    def recorded(what, fn):
        return lambda *a, **kw: (log.append(what(*a)), fn(*a, **kw))[1]

    def put_what(msg):
        return ("put", *[p[0] for p in msg[2]]) if msg and msg[0] == "batch" else ("put",)

    monkeypatch.setattr(connector, "settle", lambda device: log.append("settle"))
    monkeypatch.setattr(remote.process.jobs, "put", recorded(put_what, remote.process.jobs.put))
    monkeypatch.setattr(remote.staging, "copy_blocks",
                        recorded(lambda *a: "copy into staging", remote.staging.copy_blocks))
    monkeypatch.setattr(remote.storage, "copy_blocks",
                        recorded(lambda *a: "copy from staging", remote.storage.copy_blocks))
    monkeypatch.setattr(remote, "_free", recorded(lambda job: ("free", job.req.request_id),
                                                  remote._free))
    warm = engine.submit(prefix + [3, 4, 5], GREEDY)
    run_checked(engine)
    rid = warm.request_id
    assert warm.output.num_cached_tokens == 16
    sent = log.index(("put", rid))
    assert log[sent - 2:sent + 1] == ["copy into staging", "settle", ("put", rid)]
    freed = log.index(("free", rid))
    assert log[freed - 2:freed + 1] == ["copy from staging", "settle", ("free", rid)]
    assert first.output.token_ids == hf_greedy(model, prefix + [1, 2], 6)
    assert warm.output.token_ids == hf_greedy(model, prefix + [3, 4, 5], 6)


def test_the_worker_raising_on_one_prompt_fails_that_row_alone(engine, model):
    """A piece the worker cannot compute (its model raises on it) shares a forward with
    another row's: the worker runs that forward again piece by piece, so the trapped row
    fails with the worker's error and the other comes out exact."""
    s = engine.scheduler
    bad = engine.submit([RAISE_ON] + list(range(50, 60)), GREEDY)
    good = engine.submit(list(range(90, 100)), GREEDY)
    forwards = []
    run_checked(engine, on_phase=lambda name, rec: forwards.append(rec.remote.get("sent"))
                if name == "advance_prefill_chunk" else None)
    assert [bad.request_id, good.request_id] in forwards  # one forward carried both
    assert bad.output.finish_reason == "error"
    err = s.recent_finished[bad.request_id]["error"]
    assert "the prefill worker raised on this prompt" in err and "a trap on token" in err
    assert good.output.token_ids == hf_greedy(model, list(range(90, 100)), 6)
    assert s.is_drained() and s.remote.snapshot()["errors"] >= 1


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=2, max_size=5),
       sessions=st.lists(st.sampled_from("abc"), min_size=5, max_size=5),
       budget=st.integers(8, 64))
def test_each_forward_on_the_worker_is_shared_max_min_between_sessions_within_the_budget(
        engine, model, lengths, sessions, budget):
    """H6 and C5 on the worker's queue: every forward sent carries at most half the budget
    (max_prefill_tokens: the worker holds two), a piece at most a chunk; and it is shared
    max-min fair between
    the sessions whose rows want prompt tokens (a session gets less than another only if
    it got all it wanted), so a long prompt goes in pieces beside the others' and a
    short one is not held behind it. The forward is padded to one of a few sizes (a
    power of two to 64, then multiples of 64, or the budget: the worker's memory stays
    bounded whatever the pieces). The tokens are HF's."""
    s, remote = engine.scheduler, engine.scheduler.remote
    remote.budget_tokens = budget
    try:
        prompts = [[(7 * i + k) % 200 + 1 for k in range(n)] for i, n in enumerate(lengths)]
        handles = [engine.submit(p, GREEDY, session_id=sess)
                   for p, sess in zip(prompts, sessions)]
        sent: dict[str, int] = {}  # prompt tokens sent so far, per row

        def on_phase(name, rec):
            if name != "advance_prefill_chunk" or not rec.remote.get("pieces"):
                return
            given, wants = {}, {}
            for r in s.prefilling:  # the rows T2 planned for (promoted ones had nothing left)
                rid = r.request_id
                want = min(remote.chunk_tokens, r.prefill_len - sent.get(rid, r.num_cached_tokens))
                a, b = rec.remote["pieces"].get(rid, (0, 0))
                assert b - a <= remote.chunk_tokens
                unit = shares.unit(r)
                wants[unit] = wants.get(unit, 0) + max(0, want)
                given[unit] = given.get(unit, 0) + b - a
                if b:
                    sent[rid] = b
            total, half = sum(given.values()), budget // 2
            assert total == min(half, sum(wants.values()))  # within it, work-conserving
            sizes = {1, 2, 4, 8, 16, 32, 64, half} | set(range(128, half, 64))
            assert rec.remote["forward_tokens"] in sizes and rec.remote["forward_tokens"] >= total
            for u in given:  # max-min: less than another (by more than the odd token of
                # a budget that does not divide) only when it got all it wanted
                assert all(given[u] >= given[v] - 1 or given[u] == wants[u] for v in given), \
                    (given, wants)

        run_checked(engine, on_phase=on_phase)
    finally:
        remote.budget_tokens = 32
    for p, h in zip(prompts, handles):
        assert h.output.token_ids == hf_greedy(model, p, 6)


def test_a_death_costs_at_most_the_prompt_it_was_computing_and_the_restarts_are_budgeted(
        model, caplog):
    """The worker dies (SIGKILL, as the out-of-memory killer does) computing a forward
    that holds a poisoned prompt P and a good one Q1, while Q2 and R wait in the forward
    queued behind it. The KV already written stays (the staging pool is the decode
    side's): Q2 and R are sent again, unblamed; P and Q1 once more, each alone; P kills
    the new worker too and fails, alone; Q1, Q2 and R come out exact. Each restart is
    logged with what is left of the budget (here 2 in any 600 s). A worker that hangs
    is killed like one that died; past the budget, prompts are refused, saying so,
    `health()` says until when, and the decode side keeps going."""
    e = disagg(model, prefill_timeout_s=3)
    try:
        s, remote = e.scheduler, e.scheduler.remote
        remote.budget.max_restarts = 2
        caplog.set_level(logging.WARNING, logger="minserve.disagg")
        prompts = {"P": [KILL_ON] + list(range(60, 67)), "Q1": list(range(80, 88)),
                   "Q2": list(range(100, 140)), "R": list(range(150, 160))}
        h = {k: e.submit(prompts[k], GREEDY) for k in ("P", "Q1")}  # one forward: 8 + 8
        step_until(e, lambda: any(b.started for b in remote.batches.values()))
        h.update({k: e.submit(prompts[k], GREEDY) for k in ("Q2", "R")})
        step_until(e, lambda: any(not b.started for b in remote.batches.values()))
        queued = {job.req.request_id for b in remote.batches.values() if not b.started
                  for job, *_ in b.pieces}
        assert queued == {h["Q2"].request_id, h["R"].request_id}  # behind the forward
        step_until(e, lambda: remote.counters["deaths"] == 1, limit=100_000)
        assert not any(x.finished for x in h.values())  # the first death failed nothing
        run_checked(e)
        assert remote.counters["deaths"] == 2 and remote.counters["restarts"] == 2
        assert h["P"].output.finish_reason == "error"
        assert "twice while computing this prompt" in s.recent_finished[h["P"].request_id]["error"]
        for k in ("Q1", "Q2", "R"):
            assert h[k].output.token_ids == hf_greedy(model, prompts[k], 6), k
        logged = [rec.getMessage() for rec in caplog.records]
        assert any("restart 1; 1 left in any 600 s" in m for m in logged), logged
        assert any("restart 2; 0 left in any 600 s" in m for m in logged), logged

        # Nothing waits for ever: a worker silent for prefill_timeout_s with a forward on
        # it (stopped) is killed; a third failure in the window: no more restarts for now.
        stream = e.submit([1, 2, 3], SamplingParams(max_tokens=30, temperature=0.0,
                                                    ignore_eos=True))
        step_until(e, lambda: len(tokens(e, stream)) >= 2)
        os.kill(remote.proc.pid, signal.SIGSTOP)
        hung = e.submit(list(range(30, 60)), GREEDY)
        t0 = time.perf_counter()
        step_until(e, lambda: remote.counters["timeouts"] == 1, limit=1_000_000)
        assert time.perf_counter() - t0 >= 3
        health = remote.health()
        assert health["state"] == "given_up" and health["retry_in_s"] > 0
        late = e.submit([5, 6, 7], GREEDY)
        run_checked(e)
        for x in (hung, late):
            assert "takes no new prompts" in s.recent_finished[x.request_id]["error"]
        assert stream.output.token_ids == hf_greedy(model, [1, 2, 3], 30)  # decode went on
        assert remote.counters["restarts"] == 2 and s.is_drained()
    finally:
        e.close()


def test_config_says_where_disaggregated_prefill_runs():
    with pytest.raises(ValueError, match="built on the paged backend"):
        EngineConfig(prefill_mode="disaggregated")  # the padded backend
    c = EngineConfig(backend="paged", prefill_mode="disaggregated", max_prefill_tokens=64)
    assert c.max_prefill_tokens == 64  # C5: the budget of one of the worker's forwards
    with pytest.raises(ValueError, match="prefill_timeout_s"):
        EngineConfig(backend="paged", prefill_mode="disaggregated", prefill_timeout_s=0)


def test_serve_takes_prefill_mode_disaggregated_with_its_prompt_budget():
    import argparse

    from minserve.server.cli import SERVING_DEFAULTS, add_serve_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    c = engine_config_from_args(p.parse_args(["--prefill-mode", "disaggregated"]), {},
                                defaults=SERVING_DEFAULTS)
    assert (c.prefill_mode, c.max_prefill_tokens, c.backend) == ("disaggregated", 512, "paged")
    c = engine_config_from_args(p.parse_args(["--prefill-mode", "disaggregated",
                                              "--max-prefill-tokens", "64"]), {},
                                defaults=SERVING_DEFAULTS)
    assert c.max_prefill_tokens == 64


def test_the_openai_sdk_gets_what_the_engine_generates_and_health_tells_the_workers_state():
    """Through a disaggregated server: the SDK's answers are the engine's; `/health`
    reports the worker ready, and once it has died past its restart budget, 503 with
    the state and when it starts again, and a new prompt gets 503, not a 500 per row."""
    from minserve.server.api import create_app
    from minserve.server.cli import BackgroundServer, engine_line

    from .test_server import CHAT, SMALL, reference, sdk, tiny_chat

    model, tokenizer = tiny_chat()
    e = Engine(EngineConfig(**{**SMALL, "backend": "paged", "prefill_mode": "disaggregated",
                               "prefill_worker_threads": 1}), model=model, tokenizer=tokenizer)
    try:
        with BackgroundServer(create_app(e)) as srv:
            client = sdk(srv.url)
            r = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=5,
                                               temperature=0)
            want = reference(CHAT, max_tokens=5, temperature=0.0)
            assert r.choices[0].message.content == want.text
            parts = client.completions.create(model="tiny-llama", prompt="Once upon",
                                              max_tokens=5, temperature=0, stream=True)
            text = "".join(c.choices[0].text for c in parts)
            assert text == reference("Once upon", max_tokens=5, temperature=0.0).text
            assert e.stats()["prefill_worker"]["prompts"] == 2
            assert "prompts on a prefill worker process (pid" in engine_line(e)
            ok = httpx.get(srv.url + "/health").json()
            assert ok["status"] == "ok" and ok["prefill_worker"]["state"] == "ready"

            e.scheduler.remote.budget.max_restarts = 0  # its next death is one too many
            os.kill(e.scheduler.remote.proc.pid, signal.SIGKILL)
            down = wait_until(lambda: (h := httpx.get(srv.url + "/health")).status_code == 503
                              and h, 30, "/health to say the worker is down")
            body = down.json()
            assert body["status"] == "unhealthy"
            assert body["prefill_worker"]["state"] == "given_up"
            assert body["prefill_worker"]["retry_in_s"] > 0
            refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi",
                                                                     "max_tokens": 2})
            assert refused.status_code == 503
            assert "takes no new prompts" in refused.json()["error"]["message"]
    finally:
        e.close()


@pytest.mark.real_model
def test_real_model_token_exact_disaggregated(real_model, real_oracle):
    model, tokenizer = real_model
    e = make_engine(model, tokenizer, backend="paged", max_batch_size=4, max_model_len=512,
                    prefill_mode="disaggregated", prefill_worker_threads=1)
    try:
        prompts = [e.encode("The capital of France is"),
                   e.encode([{"role": "user", "content": "Name three colours."}])]
        outs = e.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                  ignore_eos=True))
        for p, out in zip(prompts, outs):
            assert out.token_ids == real_oracle(p, 8)
        assert e.stats()["prefill_worker"]["prompts"] == 2
    finally:
        e.close()


def test_ctrl_c_or_a_hangup_for_the_process_group_leaves_the_worker_running(engine, model):
    """A terminal's Ctrl-C (or Jupyter's "interrupt the kernel") and its hangup signal the
    whole process group: the worker ignores both, so no prompt fails and no restart is
    spent."""
    s = engine.scheduler
    pid = s.remote.proc.pid
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGHUP)
    time.sleep(0.5)
    assert s.remote.proc.is_alive() and s.remote.proc.pid == pid
    h = engine.submit([4, 5, 6, 7], GREEDY)
    run_checked(engine)
    assert h.output.token_ids == hf_greedy(model, [4, 5, 6, 7], 6)
    assert s.remote.counters["deaths"] == 0


def test_a_model_that_does_not_pickle_is_refused_saying_why():
    """The worker gets the model by pickling: a model with a local function patched in
    fails at construction with a ValueError that names the cause, not deep in pickle."""
    m = tiny_llama()
    m.model.layers[0].forward = lambda *a, **k: None  # a local function: it cannot pickle
    with pytest.raises(ValueError, match="cannot be sent to the prefill worker"):
        disagg(m)


def test_preemption_with_prompts_on_the_worker_stays_exact(model):
    """admission="preempt" (P6): a row may be preempted while its prompt is on the worker
    (its pieces there are dropped and its staging freed) and sent again when re-admitted;
    every stream still equals HF generate alone, and everything drains."""
    from .test_preemption import NEW, PROMPTS, SETUPS, run

    setup = {**SETUPS["paged"], "prefill_mode": "disaggregated", "prefill_worker_threads": 1}
    engine, handles, _ = run(model, "preempt", setup)
    try:
        assert engine.stats()["preemptions"] >= 2
        for p, h in zip(PROMPTS, handles):
            assert h.output.token_ids == hf_greedy(model, p, NEW)
        assert engine.scheduler.remote.snapshot()["staging_blocks_used"] == 0
    finally:
        engine.close()


# ------------------------------------------------------------------ the real process tree
def children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (Linux's /proc)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts: it holds no memory)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.fixture(scope="module")
def tiny_server_model(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer, as a folder `minserve serve` loads."""
    from transformers import AutoTokenizer

    from minserve.models import embedded_model_dir

    path = tmp_path_factory.mktemp("disagg") / "model"
    tiny_llama(vocab_size=49152, max_positions=1024).save_pretrained(path)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(path)
    return path


def serve(model_dir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`minserve serve --prefill-mode disaggregated` in a process group of its own (as a
    terminal starts it), up."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "minserve", "serve", "--model", str(model_dir), "--port",
         str(port), "--threads", "1", "--prefill-mode", "disaggregated",
         "--prefill-worker-threads", "1", "--log-level", "warning", *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # as from a shell
    url = f"http://127.0.0.1:{port}"

    # a deadline: a loaded machine is slow
    wait_healthy(proc, url, 300, probe_s=1, said=lambda: proc.stdout.read().decode())
    return proc, url


def test_a_hangup_spares_the_worker_and_one_sigterm_ends_the_server_with_its_worker_stopped(
        tiny_server_model):
    """The real server, its worker and multiprocessing's resource tracker: a terminal's
    hangup to the process group (`kill -HUP -- -PGID`) leaves all three running; then,
    with the worker stopped (SIGSTOP: the worst state it can be in) and a request on it,
    ONE SIGTERM ends the server within its drain timeout, and nothing is left behind."""
    proc, url = serve(tiny_server_model, "--shutdown-grace-s", "2")
    try:
        worker = httpx.get(url + "/scheduler/stats").json()["prefill_worker"]["pid"]
        kids = children(proc.pid)
        assert worker in kids and len(kids) == 2  # the worker and the resource tracker
        os.killpg(proc.pid, signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None and not any(gone(k) for k in kids)
        assert httpx.get(url + "/health").json()["prefill_worker"]["state"] == "ready"
        os.kill(worker, signal.SIGSTOP)
        threading.Thread(target=lambda: httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": "Once upon a time", "max_tokens": 4}), daemon=True).start()
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)  # 2 s of grace, then the worker is killed
        assert time.monotonic() - t0 < 20
        wait_until(lambda: all(gone(k) for k in kids), 10, "the worker and tracker to exit")
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None


def test_kill_9_of_the_server_leaves_no_process_behind(tiny_server_model):
    """`kill -9` of the server: its worker (and with it, the resource tracker) exits within
    seconds, releasing the shared memory it mapped, instead of living on as an orphan."""
    proc, url = serve(tiny_server_model)
    kids = children(proc.pid)
    try:
        assert len(kids) == 2
        proc.kill()
        proc.wait(10)
        wait_until(lambda: all(gone(k) for k in kids), 15, "the server's children to exit")
    finally:
        for k in kids:
            if not gone(k):
                os.kill(k, signal.SIGKILL)


UNGUARDED = '''\
from minserve import Engine, EngineConfig, SamplingParams

engine = Engine(EngineConfig(backend="paged", prefill_mode="disaggregated", device="cpu"))
print(engine.generate(["Hi"], SamplingParams(max_tokens=2))[0].text)
'''
IDIOM = ('if __name__ == "__main__":', "#the-spawn-and-forkserver-start-methods")


def run_script(path: Path, cwd: Path) -> tuple[str, float]:
    """`python path`; its last line of stderr (it must fail), and how long it took."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(path)], cwd=cwd, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1, r.stderr
    return r.stderr.strip().splitlines()[-1], time.monotonic() - t0


@pytest.mark.real_model
def test_a_script_without_the_main_guard_fails_at_once_naming_the_idiom(tmp_path):
    """A student's first script, run as `python script.py`, builds a disaggregated engine
    on the embedded model at its top level. The worker would run the script again
    ("spawn"): the constructor raises at once, before loading anything, naming the line,
    the idiom and the page that explains it, instead of waiting for ever on a child that
    is gone."""
    script = tmp_path / "first.py"
    script.write_text(UNGUARDED)
    last, took = run_script(script, tmp_path)
    assert last.startswith(f"RuntimeError: {script}, line 3, builds an Engine"), last
    assert all(s in last for s in IDIOM), last
    print(f"the unguarded script ended in {took:.1f} s")


def test_a_worker_that_runs_the_script_again_stops_there_with_a_code_its_parent_names(
        capsys, monkeypatch):
    """Where the script's source cannot be read (the check above cannot see the missing
    guard), the worker being started runs the script again: building the Engine there
    stops at once, before any model is loaded, with a line that says why and the exit
    code the parent turns into a RuntimeError naming the idiom."""
    import multiprocessing.process

    from minserve.disagg import process

    me = multiprocessing.process.current_process()
    monkeypatch.setattr(me, "_inheriting", True, raising=False)  # what spawn's bootstrap sets
    with pytest.raises(SystemExit) as stop:
        Engine(EngineConfig(backend="paged", prefill_mode="disaggregated", device="cpu",
                            model="no-such-model-is-loaded"))
    assert stop.value.code == process.SPAWN_REIMPORT_EXIT
    assert IDIOM[0] in capsys.readouterr().err
    worker = process.WorkerProcess(threads=1)
    worker.proc = type("Exited", (), {"exitcode": process.SPAWN_REIMPORT_EXIT})()
    said = worker.start_failure()
    assert said.startswith("the prefill worker could not start") and all(s in said for s in IDIOM)

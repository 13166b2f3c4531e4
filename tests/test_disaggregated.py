"""Disaggregated prefill (SPEC C2, C3): prompts on a worker process, their KV spliced in at
`_promote_to_decode`. Token-exact against HF `generate`, R1 after every phase, and each
fault (the worker raising on one prompt, dying, hanging) ending only the rows it held.

The worker is a real process (torch.multiprocessing, spawn): each engine here starts one,
~3 s, so the tests share engines where they can.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from minserve import Engine, EngineConfig, SamplingParams
from minserve.models import tiny_llama

from .conftest import hf_greedy, make_engine, run_checked

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SYSTEM = [7, 8, 9, 10] * 6  # 24 tokens: 6 whole blocks of 4 shared by two prompts


@pytest.fixture(scope="module")
def model():
    return tiny_llama()  # no EOS: every row runs to max_tokens, as HF greedy does here


def disagg(model, **cfg):
    cfg = {"backend": "paged", "block_size": 4, "max_batch_size": 4, "max_model_len": 256,
           "prefill_mode": "disaggregated", "prefill_worker_threads": 1, **cfg}
    return make_engine(model, **cfg)


@pytest.fixture(scope="module")
def engine(model):
    e = disagg(model)
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
            assert not s.backend.staging.keys() & set(rec.remote.get("on_worker", [])) - {
                r.request_id for r in s.prefilling}

    run_checked(engine, on_phase=on_phase)
    outs = [first.output] + [h.output for h in handles]
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, p, 6)
    warm = handles[1].request_id
    assert outs[2].num_cached_tokens == 24
    by_id = {c["request_id"]: c for c in chunks}
    assert (by_id[warm]["start"], by_id[warm]["end"]) == (24, 26)  # only the suffix remotely
    assert transfers[warm]["bytes_to_worker"] == 24 * s.backend.storage.bytes_per_token()
    assert transfers[warm]["blocks"] == 1  # tokens 24..25: one block came back
    cold = handles[0].request_id
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


def test_cancel_while_the_prompt_is_on_the_worker_frees_everything(engine):
    s = engine.scheduler
    os.kill(s.remote.proc.pid, signal.SIGSTOP)
    try:
        h = engine.submit(list(range(40, 140)), GREEDY)
        engine.step()
        assert s.remote.holds(h.request_id)
        h.cancel()
        engine.step()
        engine.check_invariants()
        assert h.output.finish_reason == "cancelled" and not s.prefilling
        assert s.remote.snapshot()["staging_blocks_used"] > 0  # still the worker's to write
    finally:
        os.kill(s.remote.proc.pid, signal.SIGCONT)
    step_until(engine, lambda: s.remote.snapshot()["staging_blocks_used"] == 0
               and not s.remote.jobs, limit=200)
    assert s.is_drained()


def test_the_decode_side_settles_its_copies_before_the_worker_may_use_the_blocks(
        engine, model, monkeypatch):
    """On a GPU a copy is only queued when it returns, and the worker is another process
    that does not wait for this one's queue: the cached prefix copied into staging must
    be done before the job is put on the queue, and the splice's read of the staging
    blocks before they are freed for the next job (`connector.settle`; on a CPU it has
    nothing to wait for)."""
    from minserve.disagg import connector

    s, log = engine.scheduler, []
    remote = s.remote
    prefix = [61, 62, 63, 64] * 4  # 16 tokens: 4 whole blocks of 4
    first = engine.submit(prefix + [1, 2], GREEDY)
    run_checked(engine)  # its blocks are now cached

    def recorded(what, fn):
        return lambda *a, **kw: (log.append(what(*a)), fn(*a, **kw))[1]

    monkeypatch.setattr(connector, "settle", lambda device: log.append("settle"))
    monkeypatch.setattr(remote._jobs, "put", recorded(lambda job: ("put", job and job[1]),
                                                      remote._jobs.put))
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
    """A job the worker cannot run (its staging table cut short: the worker's own check
    raises) fails its row with the worker's error; the other prompt comes out exact."""
    s = engine.scheduler
    real_put = s.remote._jobs.put
    bad = engine.make_request(list(range(50, 90)), GREEDY)

    def put(job):
        if job is not None and job[1] == bad.request_id:
            job = (*job[:4], job[4][:1], *job[5:])  # one block for a 40-token prompt
        real_put(job)

    s.remote._jobs.put = put
    try:
        s.submit(bad)
        good = engine.submit(list(range(90, 120)), GREEDY)
        run_checked(engine)
    finally:
        s.remote._jobs.put = real_put
    assert bad.handle.output.finish_reason == "error"
    assert "the prefill worker raised on this prompt" in bad.error
    assert "do not fit a table" in bad.error
    assert good.output.token_ids == hf_greedy(model, list(range(90, 120)), 6)
    assert s.is_drained() and s.remote.snapshot()["errors"] >= 1


def test_the_worker_dying_fails_the_rows_it_held_and_a_new_one_takes_the_next(model):
    e = disagg(model)
    try:
        s = e.scheduler
        stream = e.submit([1, 2, 3], SamplingParams(max_tokens=30, temperature=0.0,
                                                    ignore_eos=True))
        step_until(e, lambda: len(tokens(e, stream)) >= 2)
        old = s.remote.proc.pid
        os.kill(old, signal.SIGSTOP)  # it cannot answer before it dies
        held = e.submit(list(range(30, 90)), GREEDY)
        e.step()
        assert s.remote.holds(held.request_id)
        os.kill(old, signal.SIGKILL)
        s.remote.proc.join(10)
        e.step()
        e.check_invariants()
        assert held.output.finish_reason == "error"
        assert "the prefill worker died" in s.recent_finished[held.request_id]["error"]
        assert stream.request_id in [r.request_id for r in s.active]  # the stream goes on
        assert s.remote.proc.pid != old and s.remote.counters["restarts"] == 1
        after = e.submit(list(range(60, 100)), GREEDY)
        run_checked(e)
        assert after.output.token_ids == hf_greedy(model, list(range(60, 100)), 6)
        assert stream.output.token_ids == hf_greedy(model, [1, 2, 3], 30)
        assert s.is_drained()
    finally:
        e.close()


def test_a_hung_worker_times_out_is_restarted_and_after_too_many_deaths_prompts_are_refused(
        model):
    """Nothing waits forever: a worker silent for prefill_timeout_s with prompts on it is
    killed, its rows fail saying why; past MAX_RESTARTS the engine refuses new prompts,
    saying so, and keeps decoding."""
    e = disagg(model, prefill_timeout_s=1.5)
    try:
        s = e.scheduler
        os.kill(s.remote.proc.pid, signal.SIGSTOP)
        h = e.submit(list(range(30, 60)), GREEDY)
        t0 = time.perf_counter()
        step_until(e, lambda: h.finished, limit=10_000)
        assert 1.5 <= time.perf_counter() - t0 < 30
        assert "did not finish a prompt within 1.5 s" in s.recent_finished[h.request_id]["error"]
        assert s.remote.counters["timeouts"] == 1 and s.remote.counters["restarts"] == 1
        ok = e.submit(list(range(30, 60)), GREEDY)
        run_checked(e)
        assert ok.output.token_ids == hf_greedy(model, list(range(30, 60)), 6)

        s.remote.MAX_RESTARTS = 1  # the next death is one too many
        os.kill(s.remote.proc.pid, signal.SIGKILL)
        s.remote.proc.join(10)
        e.step()
        late = e.submit([5, 6, 7], GREEDY)
        run_checked(e)
        assert late.output.finish_reason == "error"
        assert "takes no new prompts" in s.recent_finished[late.request_id]["error"]
        assert s.is_drained()
    finally:
        e.close()


def test_config_says_where_disaggregated_prefill_runs():
    with pytest.raises(ValueError, match="built on the paged backend"):
        EngineConfig(prefill_mode="disaggregated")  # the padded backend
    with pytest.raises(ValueError, match="disaggregated prefill computes each whole"):
        EngineConfig(backend="paged", prefill_mode="disaggregated", max_prefill_tokens=64)
    with pytest.raises(ValueError, match="prefill_timeout_s"):
        EngineConfig(backend="paged", prefill_mode="disaggregated", prefill_timeout_s=0)


def test_serve_takes_prefill_mode_disaggregated_and_drops_its_prompt_budget():
    import argparse

    from minserve.server.cli import SERVING_DEFAULTS, add_serve_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    c = engine_config_from_args(p.parse_args(["--prefill-mode", "disaggregated"]), {},
                                defaults=SERVING_DEFAULTS)
    assert (c.prefill_mode, c.max_prefill_tokens, c.backend) == ("disaggregated", None, "paged")
    with pytest.raises(ValueError, match="computes each whole"):  # asked for: still refused
        engine_config_from_args(p.parse_args(["--prefill-mode", "disaggregated",
                                              "--max-prefill-tokens", "64"]), {},
                                defaults=SERVING_DEFAULTS)


def test_the_openai_sdk_gets_what_the_engine_generates_through_a_disaggregated_server():
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


def test_preemption_with_prompts_on_the_worker_stays_exact(model):
    """admission="preempt" (P6): a row may be preempted while its prompt is on the worker
    (its answer is then dropped and its staging freed) and sent again when re-admitted;
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


def test_ctrl_c_for_the_process_group_leaves_the_worker_running(engine, model):
    """A terminal's Ctrl-C (or Jupyter's "interrupt the kernel") signals the whole process
    group: the worker ignores it, so no prompt fails and no restart is spent."""
    s = engine.scheduler
    pid = s.remote.proc.pid
    os.kill(pid, signal.SIGINT)
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

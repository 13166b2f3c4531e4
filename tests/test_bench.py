"""The benchmark harness (docs/benchmarks.md): metrics, load generator, targets, report.

Benchmarks measure; these tests check behaviour, never timings: metrics are
computed right from a hand-made stream, the load generator has the statistics
it claims, every target completes a small workload on a tiny model, refusals
are counted by gate, and the report files are written.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from minserve import Engine, EngineConfig
from minserve.bench.metrics import RequestResult, describe, jain_index, percentile
from minserve.bench.report import comparison, markdown_table
from minserve.bench.targets import EngineTarget, RunResult
from minserve.bench.workload import (
    BenchRequest,
    LengthDist,
    Workload,
    arrival_times,
    make_workload,
    parse_sessions,
)
from minserve.peers.run_report import write_html, write_json

VOCAB = (1, 256)  # the tiny model's ids; 0 is its EOS


def tiny_engine(model, **cfg) -> Engine:
    base = dict(device="cpu", max_batch_size=4)
    return Engine(EngineConfig(**{**base, **cfg}), model=model)


def synthetic_run() -> RunResult:
    """Two served requests, one refused by G1, one by G2; times by hand (t0 = 10)."""
    a = RequestResult(0, "alice", prompt_len=6, max_tokens=4, arrival=10.0,
                      token_times=[10.5, 10.7, 11.0, 11.6], finished=11.6, output_len=4)
    b = RequestResult(1, "bob", prompt_len=4, max_tokens=2, arrival=10.2,
                      token_times=[10.4, 10.5], finished=10.5, output_len=2)
    g1 = RequestResult(2, "bob", 3, 2, 10.3, finished=10.3, finish_reason="error",
                       rejection={"gate": "G1", "reason": "queue_full"})
    g2 = RequestResult(3, "alice", 3, 2, 10.3, finished=10.4, finish_reason="error",
                       rejection={"gate": "G2", "reason": "kv_budget_exceeded"})
    return RunResult("minserve", [a, b, g1, g2], t_start=10.0, t_end=11.6)


# ============================================================== metrics
def test_metrics_from_synthetic_stream_match_hand_computed_values():
    a, b = synthetic_run().results[:2]
    assert a.ttft == pytest.approx(0.5) and b.ttft == pytest.approx(0.2)
    assert a.itls == pytest.approx([0.2, 0.3, 0.6])
    assert a.tpot == pytest.approx(1.1 / 3)  # (11.6 - 10.5) / (4 - 1)
    assert a.e2e == pytest.approx(1.6) and b.e2e == pytest.approx(0.3)

    s = synthetic_run().summary()
    assert s["requests"] == {"total": 4, "completed": 2, "refused": 2, "errors": 0}
    assert s["refusals_by_gate"] == {"G1": 1, "G2": 1}
    assert s["duration_s"] == pytest.approx(1.6)
    assert s["output_tokens"] == 6 and s["prompt_tokens"] == 10
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(6 / 1.6)
    assert s["throughput"]["total_tokens_per_s"] == pytest.approx(16 / 1.6)
    # TTFT over requests: [0.2, 0.5]
    assert s["ttft"]["p50"] == pytest.approx(0.35) and s["ttft"]["max"] == pytest.approx(0.5)
    # ITL pooled over requests: [0.1, 0.2, 0.3, 0.6]
    itl = s["itl"]
    assert itl["n"] == 4 and itl["mean"] == pytest.approx(0.3)
    assert itl["p50"] == pytest.approx(0.25)
    assert itl["p99"] == pytest.approx(0.3 + 0.97 * 0.3)  # rank 2.97 of 0..3, linear
    assert itl["max"] == pytest.approx(0.6)
    assert s["tpot"]["n"] == 2 and s["tpot"]["mean"] == pytest.approx((1.1 / 3 + 0.1) / 2)
    # per session: alice 4 tokens, bob 2 tokens over 1.6 s; Jain = 6^2 / (2 * (16 + 4)) = 0.9
    assert s["sessions"]["alice"]["output_tokens_per_s"] == pytest.approx(2.5)
    assert s["sessions"]["bob"]["refused"] == 1
    assert s["jain"]["throughput"] == pytest.approx(0.9)
    # ... divided by the sessions' weights (alice asked for twice bob's share): equal -> 1
    assert synthetic_run().summary({"alice": 2, "bob": 1})["jain"]["throughput"] == \
        pytest.approx(1.0)


def test_percentiles_interpolate_linearly_and_jain_spans_one_over_n_to_one():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([], 50) is None
    assert describe([2.0])["p99"] == 2.0
    assert jain_index([3, 3, 3]) == pytest.approx(1.0)
    assert jain_index([5, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([]) is None


# ============================================================== load generator
@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_have_the_requested_mean_rate_and_burstiness(burstiness):
    t = arrival_times(20_000, rate=5.0, burstiness=burstiness, rng=np.random.default_rng(1))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.05)
    # gamma gaps: coefficient of variation 1/sqrt(shape); Poisson (shape 1) -> 1
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]


def test_workload_is_deterministic_and_sessions_share_the_rate_by_weight():
    kw = dict(rate=10.0, prompt_len="chat", output_len="uniform:2:9", sessions="alice=3,bob=1",
              seed=7, vocab=VOCAB)
    w1, w2 = make_workload(400, **kw), make_workload(400, **kw)
    assert w1.requests == w2.requests
    assert make_workload(400, **{**kw, "seed": 8}).requests != w1.requests
    assert [r.arrival_s for r in w1.requests] == sorted(r.arrival_s for r in w1.requests)
    bob = sum(r.session == "bob" for r in w1.requests) / 400
    assert bob == pytest.approx(0.25, abs=0.06)
    # total rate 10 req/s: 400 requests span about 40 s
    assert w1.requests[-1].arrival_s == pytest.approx(40, rel=0.15)
    assert all(2 <= r.max_tokens <= 9 and 8 <= r.prompt_len <= 512 for r in w1.requests)
    assert all(VOCAB[0] <= t < VOCAB[1] for r in w1.requests for t in r.prompt_ids)
    # request i does not depend on the others
    assert make_workload(5, **kw).requests[3].prompt_ids == w1.requests[3].prompt_ids
    # a shared prefix is shared; closed loop has no arrival times
    w = make_workload(4, shared_prefix=16, concurrency=2, vocab=VOCAB, prompt_len="fixed:40")
    assert len({r.prompt_ids[:16] for r in w.requests}) == 1
    assert all(r.prompt_len == 40 and r.arrival_s is None for r in w.requests)


def test_all_at_once_and_closed_loop_share_requests_by_weight_too():
    """rate = inf (`minserve bench`'s default) and a closed loop have no arrival times to
    merge: the sessions still get requests in proportion to their weights, spread out;
    equal weights still take strict turns."""
    w = make_workload(40, sessions="alice=3,bob=1,carol=1", vocab=VOCAB, seed=1)
    names = [r.session for r in w.requests]
    assert [names.count(s) for s in ("alice", "bob", "carol")] == [24, 8, 8]
    assert names[:5] == ["alice", "bob", "alice", "carol", "alice"]
    assert all(r.arrival_s == 0.0 for r in w.requests)
    closed = make_workload(8, concurrency=2, sessions="a=3,b=1", vocab=VOCAB)
    assert [r.session for r in closed.requests].count("a") == 6
    assert [r.session for r in make_workload(7, sessions=3, vocab=VOCAB).requests] == \
        ["s0", "s1", "s2", "s0", "s1", "s2", "s0"]


def test_length_specs_parse_and_bad_ones_say_what_to_write():
    assert LengthDist.parse("64").sample(np.random.default_rng(0)) == 64
    assert LengthDist.parse("fixed:8") == LengthDist("fixed", 8)
    u = LengthDist.parse("uniform:3:5")
    assert {u.sample(np.random.default_rng(i)) for i in range(50)} == {3, 4, 5}
    ln = LengthDist.parse("lognormal:50:1:10:60")
    assert all(10 <= ln.sample(np.random.default_rng(i)) <= 60 for i in range(50))
    assert LengthDist.parse("chat", "prompt").kind == "lognormal"
    with pytest.raises(ValueError, match="uniform:A:B"):
        LengthDist.parse("gaussian:4")
    assert parse_sessions("3") == [("s0", 1.0), ("s1", 1.0), ("s2", 1.0)]
    with pytest.raises(ValueError):
        parse_sessions("alice=-1")


# ============================================================== targets
def test_engine_target_completes_a_small_open_loop_workload(tiny_model):
    engine = tiny_engine(tiny_model)
    w = make_workload(10, rate=200.0, prompt_len="uniform:4:30", output_len="uniform:2:12",
                      sessions=2, vocab=VOCAB, seed=3)
    run = EngineTarget(engine).run(w, progress=False)
    assert not engine.running  # started for the run, stopped after
    assert engine.scheduler.is_drained()
    for req, res in zip(w.requests, run.results):
        assert res.ok and res.finish_reason == "length"
        assert res.output_len == len(res.token_times) == req.max_tokens  # EOS ignored
        assert res.arrival == pytest.approx(run.t_start + req.arrival_s)
        assert res.arrival <= res.sent and res.ttft > 0
    s = run.summary()
    assert s["requests"]["completed"] == 10 and s["output_tokens"] == w.output_tokens
    assert set(s["sessions"]) == {"s0", "s1"}


def test_closed_loop_keeps_at_most_concurrency_in_flight(tiny_model):
    engine = tiny_engine(tiny_model)
    w = make_workload(6, concurrency=2, prompt_len="fixed:8", output_len="fixed:5", vocab=VOCAB)
    run = EngineTarget(engine).run(w, progress=False)
    assert all(r.ok for r in run.results)
    spans = [(r.arrival, r.finished) for r in run.results]
    for t, _ in spans:  # when each request was sent, at most 2 were in flight (itself included)
        assert sum(a <= t < f for a, f in spans) <= 2


def test_refusals_are_counted_by_the_gate_that_refused(tiny_model):
    # a 4-block pool (64 tokens) and a 300-token KV budget:
    # prompt 80 -> G3 (bigger than the pool); 30 + 280 > 300 -> G2; 20 + 5 fits.
    engine = tiny_engine(tiny_model, block_size=16, num_blocks=4, kv_budget_tokens=300)
    ids = lambda n: tuple(range(1, n + 1))  # noqa: E731
    reqs = [BenchRequest(0, "a", 0.0, ids(20), 5), BenchRequest(1, "a", 0.0, ids(80), 5),
            BenchRequest(2, "b", 0.0, ids(30), 280), BenchRequest(3, "b", 0.0, ids(20), 5)]
    run = EngineTarget(engine).run(Workload(reqs), progress=False)
    s = run.summary()
    assert s["refusals_by_gate"] == {"G2": 1, "G3": 1}
    assert s["requests"]["completed"] == 2 and s["requests"]["refused"] == 2
    assert run.results[1].rejection["gate"] == "G3" and not run.results[1].ok


def test_hf_peers_complete_the_same_workload(tiny_model):
    from minserve.peers.hf import HFContinuousTarget, HFStaticTarget

    w = make_workload(5, rate=100.0, prompt_len="uniform:4:20", output_len="uniform:2:8",
                      vocab=VOCAB, seed=5)
    for target in (HFStaticTarget(tiny_model, 2), HFContinuousTarget(tiny_model, 2)):
        run = target.run(w, progress=False)
        for req, res in zip(w.requests, run.results):
            assert res.ok, (target.name, res)
            assert res.output_len == len(res.token_times) == req.max_tokens, target.name
            assert res.token_times == sorted(res.token_times)


def test_http_target_streams_from_minserve_serve():
    from transformers import AutoTokenizer

    from minserve.models import embedded_model_dir, tiny_llama
    from minserve.peers.openai_target import OpenAITarget
    from minserve.server.api import create_app
    from minserve.server.cli import BackgroundServer

    model, tok = tiny_llama(vocab_size=49152), AutoTokenizer.from_pretrained(embedded_model_dir())
    engine = Engine(EngineConfig(device="cpu", max_batch_size=4, block_size=16, num_blocks=8,
                                 kv_budget_tokens=200), model=model, tokenizer=tok)
    reqs = [BenchRequest(i, "s", 0.01 * i, tuple(range(100, 110 + i)), 6) for i in range(4)]
    reqs.append(BenchRequest(4, "s", 0.0, tuple(range(100, 240)), 4))  # 140 > pool: G3
    with BackgroundServer(create_app(engine)) as srv:
        run = OpenAITarget(srv.url).run(Workload(reqs), progress=False)
        chat = OpenAITarget(srv.url, api="chat", tokenizer=tok).run(Workload(reqs[:2]), False)
    for res in run.results[:4] + chat.results:
        assert res.ok and res.output_len == 6 and 1 <= len(res.token_times) <= 6, res
    assert run.results[4].rejection["gate"] == "G3"
    assert run.summary()["refusals_by_gate"] == {"G3": 1}


def test_sse_lines_and_openai_error_bodies_parse():
    from minserve.peers.openai_target import parse_sse_line, rejection_from_error

    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    assert parse_sse_line(": keep-alive") is None and parse_sse_line("") is None
    body = {"error": {"message": "full", "code": "queue_full", "gate": "G1",
                      "numbers": {"pending": 4}}}
    assert rejection_from_error(body, 429)["gate"] == "G1"
    assert rejection_from_error({"error": {"message": "slow down"}}, 429)["gate"] == "HTTP 429"


def test_overhead_measurement_pairs_pure_decode_ticks(tiny_model):
    from minserve.bench.overhead import measure_overhead

    engine = tiny_engine(tiny_model)
    ov = measure_overhead(engine, batch_size=4, prompt_len=16, ticks=6, warmup=1)
    assert ov["ticks"] == len(ov["tick_ms_all"]) == len(ov["bare_ms_all"]) > 0
    assert ov["tick_ms"] > 0 and ov["bare_forward_ms"] > 0
    assert engine.scheduler.is_drained()


# ============================================================== report
def test_report_json_html_and_ratio_table_are_written(tmp_path):
    fast = synthetic_run()
    slow = synthetic_run()
    slow.target, slow.t_end = "hf-static", slow.t_start + 3.2  # half the throughput
    comp = comparison([fast, slow])
    assert comp["hf-static"]["speedup"] == pytest.approx(2.0)
    assert "**minserve 2.00x faster**" in markdown_table([fast, slow])
    j = write_json(tmp_path / "r.json", {"runs": [fast.to_dict(), slow.to_dict()]})
    data = json.loads(j.read_text())
    assert data["runs"][0]["summary"]["refusals_by_gate"] == {"G1": 1, "G2": 1}
    assert data["runs"][0]["requests"][0]["token_times"][0] == pytest.approx(0.5)
    h = write_html(tmp_path / "r.html", [fast, slow], include_plotlyjs=False)
    html = h.read_text()
    assert "hf-static" in html and "TTFT" in html and "<table" in html


def test_bench_command_writes_its_files(tmp_path, capsys):
    from minserve.__main__ import main

    assert main(["bench", "--tiny", "-n", "4", "--prompt-len", "8", "--output-len", "3",
                 "--peers", "static", "--no-progress", "--out-dir", str(tmp_path),
                 "--name", "t"]) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert [r["target"] for r in data["runs"]] == ["minserve", "hf-static"]
    out = capsys.readouterr().out
    assert "minserve vs this target" in out
    assert re.search(r"\| hf-static \|.*\| \*\*minserve \d+\.\d\dx (faster|as fast \(slower\))\*\* \|", out)
    # the report is small: plotly.js is written once beside it, not inlined in every page
    html = (tmp_path / "t.html").read_text()
    assert len(html) < 500_000 and 'src="plotly.min.js"' in html
    assert (tmp_path / "plotly.min.js").stat().st_size > 1_000_000


def test_bench_help_shows_every_default(capsys):
    from minserve.__main__ import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "(default: 40)" in out and "(default: inf)" in out


# ============================================================== one command per table
ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"`(?:\.venv/bin/)?((?:minserve bench|make peers-bench|bash scripts/gpu_check\.sh)"
                     r"[^`]*)`")


def bench_parser():
    from minserve.bench.cli import add_bench_arguments

    p = argparse.ArgumentParser(prog="minserve bench", exit_on_error=False)
    add_bench_arguments(p)
    return p


def check_command(cmd: str) -> None:
    """A documented command runs what exists: its experiment is registered and its options
    parse (`minserve bench ...`), or its make target and script take its arguments."""
    words = shlex.split(cmd.replace("\n", " "))
    if any(w.isupper() and w.isalpha() for w in words):  # a placeholder: `minserve bench NAME`
        return
    if words[:2] == ["minserve", "bench"]:
        args, unknown = bench_parser().parse_known_args(words[2:])
        assert not unknown, f"`{cmd}`: {unknown} are no options of its experiment"
    elif words[:2] == ["make", "peers-bench"]:
        from minserve.peers.side_by_side import parser

        assert re.search(r"^peers-bench:.*\n(?:\t.*\n)*\t.*minserve\.peers\.side_by_side",
                         (ROOT / "Makefile").read_text(), re.M), "Makefile: no peers-bench"
        extra = [w.partition("=")[2] for w in words[2:] if w.startswith("ARGS=")]
        parser().parse_args(shlex.split(extra[0]) if extra else [])
    else:
        assert (ROOT / words[1]).exists(), cmd


def test_every_table_of_the_benchmarks_page_names_a_command_that_runs():
    """docs/benchmarks.md: every section with a table names the command that reproduces it
    (docs/demo.md's and docs/gpu.md's measured sections too), and each command parses."""
    pages = {name: (ROOT / "docs" / name).read_text() for name in ("benchmarks.md", "demo.md",
                                                                   "gpu.md")}
    checked = 0
    for name, text in pages.items():
        for section in re.split(r"\n(?=#{2,3} )", text):
            commands = COMMAND.findall(section)
            if name == "benchmarks.md" and "\n|---" in section:
                assert commands, f"{name}: a table without its command: {section[:80]!r}"
            for cmd in commands:
                check_command(cmd)
                checked += 1
    assert checked >= 15
    # every experiment the registry lists is run by at least one documented command
    from minserve.bench.cli import DEFAULT, EXPERIMENTS

    named = {w[2] if len(w) > 2 and not w[2].startswith("-") else DEFAULT
             for text in pages.values() for c in COMMAND.findall(text)
             if (w := shlex.split(c))[:2] == ["minserve", "bench"] and w[2:3] != ["EXPERIMENT"]}
    assert named == set(EXPERIMENTS), set(EXPERIMENTS) ^ named


def test_a_command_of_a_missing_experiment_or_option_is_refused():
    check_command("minserve bench kv-cache --batch 8 --threads 1 --no-docs")
    check_command('make peers-bench ARGS="-d 30"')
    for bad in ("minserve bench kv-bench", "minserve bench linear --rouns 3",
                'make peers-bench ARGS="--per-user 30"'):
        with pytest.raises((AssertionError, SystemExit, argparse.ArgumentError)):
            check_command(bad)


def test_no_page_names_a_module_command_that_is_gone():
    """`python -m minserve.X.Y` in the docs or the README names a module that runs."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for mod in re.findall(r"python3? -m (minserve(?:\.\w+)+)", page.read_text()):
            path = ROOT / (mod.replace(".", "/") + ".py")
            pkg_main = ROOT / mod.replace(".", "/") / "__main__.py"
            assert pkg_main.exists() or (path.exists() and "__main__" in path.read_text()), \
                f"{page.name}: `python -m {mod}` runs nothing"


def test_bench_list_names_every_experiment_once_with_its_line(capsys):
    from minserve.__main__ import main
    from minserve.bench.cli import EXPERIMENTS

    assert main(["bench", "--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == list(EXPERIMENTS)
    assert all(len(ln.split(None, 1)[1]) > 20 for ln in lines)


# ============================================================== the floor
def test_a_decode_steps_bytes_and_flops_are_counted_from_the_model(tiny_model):
    """tiny_llama: 2 layers of E=64, I=128, 4 heads over 2 KV heads of D=16, V=256."""
    from minserve.bench.floor import floor_ms, step_cost

    per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)  # q, k+v, o, gate+up+down
    params = 2 * per_layer + 256 * 64  # + the output head
    cost = step_cost(tiny_model, batch=3, context=10)
    assert cost["weights_bytes"] == 4 * params
    assert cost["kv_bytes"] == 3 * 10 * (2 * 2 * 2 * 16 * 4)  # K+V, layers, KV heads, D, fp32
    assert cost["flops"] == 2 * params * 3 + 4 * 3 * 10 * 4 * 16 * 2
    f = floor_ms(cost, read_gbs=1.0, gflops=100.0)  # ms: bytes / 1 GB/s, flops / 100 GFLOP/s
    assert f["bandwidth"] == pytest.approx((cost["weights_bytes"] + cost["kv_bytes"]) / 1e6)
    assert f["compute"] == pytest.approx(cost["flops"] / 1e8)
    assert f["floor"] == max(f["bandwidth"], f["compute"]) == f["bandwidth"]
    assert floor_ms(cost, 1000.0, 1.0)["floor"] == pytest.approx(cost["flops"] / 1e6)


def test_floor_puts_every_path_beside_the_floor_of_each_batch(capsys):
    from minserve.__main__ import main
    from minserve.fast.compact import Linear

    big = str(Linear.PANEL_ROWS + 1)  # past the C matmul: oneDNN, C between the matmuls
    assert main(["bench", "floor", "--tiny", "--batch", "1", "4", big, "--context", "12",
                 "--ticks", "2", "--no-docs"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"read [\d.]+, [\d.]+, [\d.]+ GB/s .* matmul [\d.]+, [\d.]+, [\d.]+ "
                     r"GFLOP/s", out)
    paths, rest = out.split("its C parts added one at a time")
    parts, loops = rest.split("in Python or in C (`decode_rows`")
    row = r"^\| (\d+) \| [\d.]+ \| (.*x\)) \|"  # batch | floor | "ms (ratio x)" cells
    # every batch: readable, compact, serve, hf; up to PANEL_ROWS rows: the 3 variants of
    # the C parts; past them: the layers in Python beside the serve path's C between
    # oneDNN's matmuls
    for table, batches, cells in ((paths, ["1", "4", big], 4), (parts, ["1", "4"], 3),
                                  (loops, [big], 2)):
        rows = re.findall(row, table, re.M)
        assert [b for b, _ in rows] == batches, table
        for _, found in rows:
            assert len(re.findall(r"[\d.]+ \([\d.]+x\)", found)) == cells, found
    assert re.search(rf"^\| {big} \| .* \| \*\*[\d.]+\*\* \|$", loops, re.M), loops  # C / Py


# ============================================================== the timing discipline
def test_interleave_rotates_the_order_and_keeps_the_warmup_off_the_record():
    from minserve.bench.timing import interleave

    calls: list[str] = []
    times = interleave({k: (lambda k=k: calls.append(k)) for k in "abc"}, rounds=3, warmup=1)
    assert "".join(calls) == "abc" + "bca" + "cab" + "abc"  # nobody always runs first
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}  # round 0 dropped


def test_every_published_section_says_its_threads_and_load_average(tmp_path):
    from minserve.bench.registry import Bench

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- bench:x -->\nold\n<!-- /bench:x -->\n\nprose kept\n")
    bench = Bench(argparse.Namespace(no_docs=False))
    bench.publish("x", ["## X", "", "| a |", "|---|", "| 1 |"], doc=doc)
    text = doc.read_text()
    assert "old" not in text and "prose kept" in text
    assert re.search(r"\| 1 \|\n\n_.*, \d+ threads; load average \(1 min\) [\d.]+ at the start, "
                     r"[\d.]+ at the end, on \d+ cores_\n<!-- /bench:x -->", text), text
    Bench(argparse.Namespace(no_docs=True)).publish("x", ["## Y"], doc=doc)
    assert "## Y" not in doc.read_text()  # --no-docs: printed only


def test_a_decode_race_times_pure_decode_ticks_only_and_drain_empties_the_engines(tiny_model):
    from minserve.bench.timing import decode_race, decoding, drain

    engines = {b: tiny_engine(tiny_model, backend=b) for b in ("padded", "paged")}
    handles = [h for e in engines.values() for h in decoding(e, [[5, 6, 7], [8, 9]], 40)]
    assert all(len(e.scheduler.active) == 2 for e in engines.values())
    seen: list[str] = []
    times = decode_race(engines, rounds=3, rows=2, seen=lambda name, rec: seen.append(name),
                        bare=lambda: None)
    assert {k: len(v) for k, v in times.items()} == {"padded": 3, "paged": 3, "bare": 3}
    assert sorted(seen) == ["padded"] * 4 + ["paged"] * 4  # the warm-up round is seen too
    from minserve import SamplingParams

    engines["padded"].submit([11, 12, 13], SamplingParams(max_tokens=2))  # a prefill joins
    with pytest.raises(AssertionError, match="not a pure decode tick"):
        decode_race(engines, rounds=2, rows=2)
    for e in engines.values():
        drain(e, handles, close=True)
        assert e.scheduler.is_drained()

"""The side-by-side peers bench (docs/benchmarks.md, "Side by side"): its SLO arithmetic, its capacity search,
its two ways of sending (32 named users, or no `user` at all) and how the table and the
targets show them, and one real run of `minserve serve` started as a child process and
driven over HTTP both ways.

vLLM and Hugging Face's server are not started here (vLLM needs its own venv and
minutes to compile); `make peers-bench` runs them with the same code.
"""

from __future__ import annotations

import pytest

from minserve.bench.metrics import RequestResult
from minserve.peers.side_by_side import (
    RateRun,
    chat_service,
    main,
    meets_slo,
    parse_users,
    ratios,
    sending,
    slo_share,
    sweep,
    table,
)


def _result(ttft: float | None, gap: float, n: int, error: str | None = None) -> RequestResult:
    r = RequestResult(0, "s", 10, n, arrival=0.0)
    r.sent = 0.0
    if ttft is not None:
        r.token_times = [ttft + k * gap for k in range(n)]
        r.output_len, r.finished, r.finish_reason = n, r.token_times[-1], "stop"
    r.error = error
    return r


def test_slo_needs_both_ttft_and_tpot_and_counts_failures_as_missed():
    ok = _result(1.0, 0.1, 5)
    slow_first = _result(3.5, 0.1, 5)
    slow_tokens = _result(0.5, 0.3, 5)
    one_token = _result(2.0, 0.0, 1)  # no TPOT: TTFT decides
    failed = _result(None, 0.0, 0, error="HTTP 500")
    assert [meets_slo(r) for r in (ok, slow_first, slow_tokens, one_token, failed)] == \
        [True, False, False, True, False]
    assert slo_share([ok, slow_first, slow_tokens, one_token, failed]) == pytest.approx(0.4)


def test_goodput_counts_the_output_tokens_of_the_requests_that_met_the_slo_only():
    ok, slow, failed = _result(1.0, 0.1, 8), _result(0.5, 0.3, 6), _result(None, 0.0, 0, "x")
    run = RateRun.of(1.0, [ok, slow, failed], t0=0.0, t1=2.0)
    assert run.tok_s == pytest.approx((8 + 6) / 2) and run.slo_tok_s == pytest.approx(8 / 2)
    assert run.slo == pytest.approx(1 / 3)


def _run(rate: float, slo: float) -> RateRun:
    return RateRun(rate, 10, 10, 100, 10.0, (0.1, 0.2, 0.3), 0.05, slo)


def test_capacity_is_the_last_rate_meeting_the_slo_before_the_first_miss():
    attained = {0.5: 1.0, 1: 0.95, 1.5: 0.8, 2: 0.92, 3: 0.5}
    tried = []

    def run_at(rate):
        tried.append(rate)
        return _run(rate, attained[rate])

    runs, cap = sweep(run_at, [0.5, 2], [0.5, 1, 1.5, 2, 3])
    assert cap == 1  # 2 meets it again, but 1.5 missed first: capacity stops at 1
    assert tried == [0.5, 1, 1.5, 2]  # 2 still runs (a table rate); 3 never does
    assert set(runs) == {0.5, 1, 1.5, 2}


def test_capacity_is_none_when_even_the_lowest_rate_misses():
    runs, cap = sweep(lambda r: _run(r, 0.2), [0.5, 2], [0.5, 1])
    assert cap is None and set(runs) == {0.5, 2}


# ------------------------------------------------------------ the ways of sending
@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from minserve.models import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir())


class _Recorder:
    """A stand-in OpenAI server on loopback that records each chat request's headers and
    body and streams one token back: what the client sent, as the server saw it."""

    def __init__(self):
        import http.server
        import json
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, json.dumps({"data": [{"id": "tiny"}]}).encode(),
                           "application/json")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
                chunk = {"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}],
                         "usage": {"completion_tokens": 1}}
                self._send(200, f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(),
                           "text/event-stream")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _send_both_ways(tok, users: int | None):
    from minserve.peers.openai_target import OpenAITarget

    w = chat_service(tok, rate=200.0, duration_s=0.01, min_requests=6, users=users)
    with _Recorder() as srv:
        run = OpenAITarget(srv.url, api="chat", ignore_eos=False, tokenizer=tok,
                           send_user=users is not None).run(w, progress=False)
    assert all(r.ok for r in run.results) and len(srv.seen) == len(w.requests)
    return w, srv.seen


def test_the_no_user_way_sends_no_user_field_and_no_session_header(tok):
    """Most OpenAI clients send neither `user` nor X-Session-Id; the no-user way must
    look like them on the wire, or minserve would see sessions they never name."""
    w, seen = _send_both_ways(tok, None)
    assert {r.session for r in w.requests} == {"default"}
    for headers, body in seen:
        assert "user" not in body, body
        assert "x-session-id" not in headers, headers
        assert body["messages"] and body["stream"] is True


def test_the_named_way_sends_each_request_its_user_in_turn_and_the_same_requests(tok):
    named, seen = _send_both_ways(tok, 3)
    assert sorted(body["user"] for _, body in seen) == sorted(f"user{i % 3}" for i in range(6))
    assert all("x-session-id" not in headers for headers, _ in seen)
    lone = chat_service(tok, rate=200.0, duration_s=0.01, min_requests=6, users=None)
    # the same prompts, lengths and arrivals: only who sends them differs
    assert [(r.prompt_ids, r.max_tokens, r.arrival_s) for r in named.requests] == \
        [(r.prompt_ids, r.max_tokens, r.arrival_s) for r in lone.requests]


def test_users_option_takes_numbers_of_users_or_none_each_once():
    import argparse

    assert parse_users("32,none") == [32, None] and parse_users(" None ") == [None]
    for bad in ("0", "all", "32,32", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_users(bad)


def _rr(rate: float, tok_s: float, ttft_p90: float, tpot: float, slo: float) -> RateRun:
    return RateRun(rate, 10, 10, 100, tok_s, (0.1, ttft_p90, 0.5), tpot, slo, tok_s * slo)


def test_the_table_and_the_targets_show_every_server_both_ways():
    both = ["32 users", "no `user`"]
    results = {
        "minserve": {both[0]: ({0.5: _rr(0.5, 20, 0.2, 0.09, 1.0), 2: _rr(2, 80, 0.6, 0.2, 1.0)}, 2),
                     both[1]: ({0.5: _rr(0.5, 21, 0.3, 0.06, 1.0), 2: _rr(2, 60, 9.0, 0.1, 0.3)},
                               0.5)},
        "vLLM CPU": {both[0]: ({0.5: _rr(0.5, 20, 0.4, 0.1, 1.0), 2: _rr(2, 40, 3.0, 0.5, 0.2)},
                               0.5),
                     both[1]: ({0.5: _rr(0.5, 20, 0.6, 0.1, 0.9), 2: _rr(2, 50, 2.0, 0.3, 0.4)},
                               None)}}
    rows = [line for line in table(results, 0.5, 2).splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert cells[0][:2] == ["server", "sent"] and all(len(c) == len(cells[0]) for c in cells)
    assert [c[:2] for c in cells[1:]] == [["minserve", w] for w in both] + \
        [["vLLM CPU", w] for w in both]
    assert cells[2][3].startswith("60.0, 0.10 / 9.00") and cells[2][4] == "0.5 req/s"
    assert cells[4][4] == "below the lowest rate tried"

    said = ratios(results, 0.5, 2).split("\n\n")
    assert [s.split(":")[0] for s in said] == [f"minserve against vLLM CPU, {w}" for w in both]
    assert "tok/s at 2 req/s: **2.00x** vLLM CPU's (SLO met 100 % vs 20 %)" in said[0]
    assert "tok/s at 2 req/s: **1.20x** vLLM CPU's (SLO met 30 % vs 40 %)" in said[1]
    assert "tok/s within the SLO at 2 req/s: **10.00x** vLLM CPU's (80.0 vs 8.0)" in said[0]
    assert cells[1][3].endswith("200 ms, 100 % (80.0)") and cells[3][3].endswith("20 % (8.0)")
    assert "TTFT p90 at 0.5 req/s: **0.50x** vLLM CPU's (SLO met 100 % vs 90 %)" in said[1]
    assert "capacity: 0.5 vs < req/s" in said[1]
    text = sending([32, None])
    assert "as 32 users" in text and "without `user`" in text and "each way" in text
    assert "each way" not in sending([None])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with the embedded model's tokenizer (and chat template), saved
    as a folder any server can load."""
    from transformers import AutoTokenizer

    from minserve.models import embedded_model_dir, tiny_llama

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    path = tmp_path_factory.mktemp("tiny-chat-model")
    model = tiny_llama(vocab_size=len(tok), max_positions=2048, eos_token_id=2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_a_real_minserve_serve_is_started_driven_over_http_and_stopped(tiny_model_dir, capsys,
                                                                       tmp_path):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert main(["--peers", "minserve", "--model", tiny_model_dir, "--no-phenomena",
                 "--rates", "4,8", "--capacity-rates", "4,8", "-d", "1", "--min-requests", "4",
                 "--out-dir", str(tmp_path)]) == 0  # --users: both ways, 32 users and none
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| minserve |")]
    assert [r.split("|")[2].strip() for r in rows] == ["32 users", "no `user`"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] != "—" and cells[3] != "—"  # both table rates ran and were measured
        lo, hi = (int(x) for x in cells[5].split(" / "))
        assert lo > 0 and hi > 0  # tokens came back over HTTP
    assert "up in" in out and (tmp_path / "minserve.log").exists()
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before  # the server's process group is gone


def test_each_phenomena_setting_starts_the_minserve_it_names():
    """The flags each setting gives `minserve serve` make a valid config of that setting:
    "monolithic" must not stay a mixed_batch server whose per-tick prompt budget still
    cuts the prompt (chunk size 0 alone did), and "disaggregated" must start."""
    import argparse

    from minserve.peers import phenomena
    from minserve.server.cli import SERVING_DEFAULTS, add_serve_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    got = {name: engine_config_from_args(p.parse_args(ours), {}, defaults=SERVING_DEFAULTS)
           for name, (ours, _) in phenomena.SETTINGS.items()}
    assert (got["monolithic prefill"].prefill_mode, got["monolithic prefill"].max_prefill_tokens,
            got["monolithic prefill"].prefill_chunk_size) == ("monolithic", None, 0)
    assert got["disaggregated prefill"].prefill_mode == "disaggregated"
    assert got["chunked prefill"].prefill_chunk_size == 256
    assert not got["prefix cache off"].enable_prefix_caching
    figs = {"minserve": {"chunked prefill": {"stall_s": 0.8}, "monolithic prefill": {"stall_s": 11.0},
                         "disaggregated prefill": {"stall_s": 0.07, "long_ttft_s": 9.2}},
            "vLLM": {"chunked prefill": {"stall_s": 0.5}}}
    rows = phenomena.table(figs).splitlines()
    assert rows[2].endswith("| 0.07 s (9.20 s) |") and rows[3].endswith("| — |")

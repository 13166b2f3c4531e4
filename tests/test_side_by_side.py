"""The side-by-side peers bench (docs/benchmarks.md, "Side by side"): its SLO arithmetic, its capacity search, and
one real run of `minserve serve` started as a child process and driven over HTTP.

vLLM and Hugging Face's server are not started here (vLLM needs its own venv and
minutes to compile); `make peers-bench` runs them with the same code.
"""

from __future__ import annotations

import pytest

from minserve.bench.metrics import RequestResult
from minserve.peers.side_by_side import RateRun, main, meets_slo, slo_share, sweep


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
                 "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| minserve |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] != "—" and cells[2] != "—"  # both table rates ran and were measured
    lo, hi = (int(x) for x in cells[4].split(" / "))
    assert lo > 0 and hi > 0  # tokens came back over HTTP
    assert "up in" in out and (tmp_path / "minserve.log").exists()
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before  # the server's process group is gone

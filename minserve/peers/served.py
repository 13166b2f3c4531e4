"""`minserve bench served-token`: where a streamed token's time goes, through the real server.

    minserve bench served-token                    # 0.5 req/s for 60 s, one client
    minserve bench served-token --rate 2 -d 30 --minserve-args "--threads 2"

`minserve serve` is started as a user starts it (its defaults, `servers.minserve_command`)
with MINSERVE_SPANS set (minserve/spans.py: timestamps per tick and per token, off unless
asked), and gets side_by_side's chat-service workload (a shared ~330-token system prompt,
questions of 10..120 tokens, 16..160 tokens out, greedy, stopping at EOS, Poisson
arrivals) from the same client (`OpenAITarget`, streaming chat completions, no `user`).
A few requests first warm the server up, off the record. When the server stops it writes
its spans; `spans.summary` charges each token after a request's first the cycle of the
tick that produced it, so the parts add up to the mean time per output token, which is
printed beside the client's own TPOT (mean and p50).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from ..bench.registry import at_least, experiment, option
from ..bench.report import md_table
from ..bench.shares import model_dir
from ..spans import ENV, summary
from .openai_target import OpenAITarget
from .servers import free_port, minserve_command, running
from .side_by_side import RateRun, chat_service

# summary's parts, in the order of a tick, with what each is
PARTS = {
    "admit": "T1 admit (gates, policy)",
    "prefill": "T2 prefill plan (mixed_batch: chunks ride in T4's forward)",
    "evict": "T3 evict",
    "setup": "T4 setup (KV slots, reservations)",
    "forward": "T4 the model's forward",
    "chunks": "T4 prompt chunks posted (first tokens, promotions, prefix hashes)",
    "sample": "T4 sampling (one batched call, one copy to the host)",
    "detokenise": "T4 detokenising (incremental, per row)",
    "push": "T4 pushing to the handles (wakes the event loop)",
    "post": "T4 the rest of posting (stop checks, policy charges)",
    "record": "the tick's record (T6 snapshot)",
    "gap": "between ticks (the worker's loop)",
}


def served_split(rate: float, duration_s: float, seed: int, extra: list[str], out_dir: Path,
                 warmup: int = 4, model_dir: str | None = None
                 ) -> tuple[dict, RateRun, float | None]:
    """Run `minserve serve` on `model_dir` (the embedded SmolLM2 by default) with spans at
    `rate` for `duration_s`; (spans summary over the measured run only, the client's
    figures, the client's mean TPOT in s)."""
    from transformers import AutoTokenizer

    from ..models import embedded_model_dir

    model_dir = model_dir or str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spans_file = out_dir / "spans.json"
    spans_file.unlink(missing_ok=True)
    cmd = minserve_command(model_dir, free_port(), extra)
    cmd = replace(cmd, env={**cmd.env, ENV: str(spans_file)})
    with running(cmd, out_dir / "minserve.log") as url:
        target = OpenAITarget(url, api="chat", ignore_eos=False, tokenizer=tok, name="minserve",
                              send_user=False)
        if warmup:
            target.run(chat_service(tok, 2.0, 0, seed + 1, warmup, None), progress=False)
        # perf_counter is the system's monotonic clock (Linux, macOS): the server's stamps
        # and this process's compare, so the warm-up's ticks and tokens can be left out
        since = time.perf_counter()
        run = target.run(chat_service(tok, rate, duration_s, seed, 12, None), progress=False)
    # the server wrote its spans when it stopped (Engine.stop), before `running` returned
    data = json.loads(spans_file.read_text())
    data["ticks"] = [t for t in data["ticks"] if t["start"] >= since]
    data["tokens"] = [t for t in data["tokens"] if t.get("detok", since) >= since]
    tpots = [r.tpot for r in run.results if r.ok and r.tpot is not None]
    s = summary(data)
    s["engine"] = next((ln.strip() for ln in (out_dir / "minserve.log").read_text().splitlines()
                        if ln.startswith("engine:")), "engine: (not in the server's log)")
    return (s, RateRun.of(rate, run.results, run.t_start, run.t_end),
            sum(tpots) / len(tpots) if tpots else None)


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1e3 * x:.2f}"


def split_rows(s: dict) -> list[list[str]]:
    """The table's rows: each part's ms per token and share of the cycle."""
    cycle = s["cycle_s"] or 1.0
    rows = [[what, f"{1e3 * s['per_token_s'].get(part, 0.0):.2f}",
             f"{100 * s['per_token_s'].get(part, 0.0) / cycle:.1f}%"]
            for part, what in PARTS.items()]
    return rows + [["**a token's cycle (the sum)**", f"**{1e3 * s['cycle_s']:.1f}**", "100%"]]


@experiment("served-token",
            option("--rate", type=float, default=0.5, help="requests/s, Poisson"),
            option("-d", "--duration-s", type=float, default=60.0, help="seconds of arrivals"),
            option("--seed", type=int, default=0, help="the workload's random seed"),
            option("--warmup", type=at_least(0), default=4,
                   help="requests sent first, off the record"),
            option("--minserve-args", default="", help="extra `minserve serve` flags"),
            option("--out-dir", default="bench-results/served-token",
                   help="the server's log and its spans.json"),
            smallest=("--rate", "8", "-d", "0.5", "--warmup", "0"))
def served_token(bench):
    """Where a streamed token's time goes through `minserve serve` (spans, one client)."""
    a = bench.args
    # --tiny: the shares bench's tiny random Llama saved with SmolLM2's tokenizer (a server
    # needs a folder), for a smoke run in seconds
    s, rr, tpot_mean = served_split(a.rate, a.duration_s, a.seed, a.minserve_args.split(),
                                    Path(a.out_dir), a.warmup,
                                    str(model_dir()) if bench.tiny else None)
    flags = f' --minserve-args "{a.minserve_args}"' if a.minserve_args else ""
    bench.publish("served-token", [
        "## Where a served token's time goes", "",
        f"`.venv/bin/minserve bench served-token --rate {a.rate:g} -d {a.duration_s:g}{flags}`: "
        "`minserve serve` with its defaults and `MINSERVE_SPANS` (minserve/spans.py; the "
        f"server said: {s['engine'].rstrip('.')}), "
        "side_by_side's chat-service workload from one streaming client without `user` "
        f"({rr.requests} requests, {rr.output_tokens} output tokens; {a.warmup} warm-up "
        "requests off the record). Each token after a request's first is charged the cycle of the tick "
        f"that produced it ({s['tokens']} tokens; median {s['rows_median']:g} rows per "
        f"tick; {100 * s['chunk_ticks_share']:.0f} % of them in ticks whose forward also "
        "carried a prompt chunk). The client measured TPOT p50 "
        f"{_ms(rr.tpot_p50)} ms (mean {_ms(tpot_mean)} ms, which the cycle below should "
        f"match), TTFT p50 {_ms(rr.ttft[0])} ms, {rr.tok_s:.1f} tok/s.", "",
        *md_table(["part of the worker's tick", "ms per token", "share"], split_rows(s)), "",
        "On the event loop's thread, in parallel with the next tick (latency each token "
        f"carries, not time between tokens): from the push to the SSE stream getting the "
        f"event {_ms(s['push_to_sse_s'])} ms; building and writing its chunk "
        f"{_ms(s['sse_write_s'])} ms."])
    bench.record({"served.tpot_p50_ms": round(1e3 * (rr.tpot_p50 or 0), 1),
                  "served.cycle_ms": round(1e3 * s["cycle_s"], 1),
                  "served.forward_share_pct": round(100 * s["per_token_s"].get("forward", 0)
                                                    / (s["cycle_s"] or 1), 1)},
                 ".venv/bin/minserve bench served-token")

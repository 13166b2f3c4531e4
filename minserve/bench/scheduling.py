"""Scheduling, seen by the users it schedules: stalls, fairness, the demo's light user.

`scheduling` replays fixed arrival traces in step mode (arrivals pinned to ticks, so
every variant sees the same trace), wall-clock timed:
  1. chunked vs monolithic prefill: four chat streams decode when a `--long`-token prompt
     arrives; monolithic prefill freezes every stream for its whole forward, chunks do not.
     Stream gaps (max, p99, p50), and the long prompt's TTFT (the price of chunking).
  2. FCFS vs VTC: one heavy session floods the queue, three light ones send now and then.
     TTFT per kind, and Jain's index of each session's share of its demand served 8 ticks
     after the last light arrival (1: every session got the same share of what it asked).
`long-prompt`: one chat streams 48 tokens; two tokens in, a `--prompt-tokens` document
  arrives; per prefill setting, the stream's worst gap (the stall) and the document's TTFT.
`disaggregated`: the same, 3,500 tokens, in the three prefill modes on the paged backend,
  monolithic, chunked and disaggregated (a prefill worker process): the stream's worst
  gap against its TPOT alone, the long prompt's TTFT, and the KV bytes moved per token.
`demo-wait`: the chat demo's own logic (`chat.logic.ChatApp`, its default flood); a light
  user's message 3 s in, under fair with the row cap, fair without, FCFS (docs/demo.md).
"""

from __future__ import annotations

import time

from .metrics import jain_index, percentile
from .registry import at_least, experiment, option
from .report import md_table


def run_trace(engine, arrivals: dict[int, list[tuple]], at_tick=None) -> list:
    """arrivals: tick -> [(prompt_ids, SamplingParams, session)]; step until done.
    `at_tick(tick, handles)` is called before every tick. Returns the handles."""
    handles, tick = [], 0
    while tick <= max(arrivals) or engine.scheduler.has_work():
        for ids, sp, session in arrivals.get(tick, []):
            h = engine.submit(ids, sp, session_id=session)
            h.session = session
            handles.append(h)
        if at_tick is not None:
            at_tick(tick, handles)
        engine.step()
        tick += 1
    return handles


def chunked_vs_monolithic(bench, chunk: int, long_len: int) -> dict[str, list]:
    from .. import SamplingParams

    _, tok = bench.model()
    chat = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True) for q in
            ("Tell me about rivers.", "Describe a forest.", "What is a star?", "Explain rain.")]
    chat = [c["input_ids"] if hasattr(c, "keys") else c for c in chat]
    long = [(13 * k) % 30000 + 200 for k in range(long_len)]
    arrivals = {0: [(c, SamplingParams(max_tokens=48, ignore_eos=True), f"s{i}")
                    for i, c in enumerate(chat)],
                6: [(long, SamplingParams(max_tokens=4, ignore_eos=True), "long")]}
    out = {}
    for name, c in (("monolithic", 0), (f"chunked {chunk}", chunk)):
        hs = run_trace(bench.engine(max_batch_size=8, prefill_chunk_size=c, max_model_len=4096,
                                    enable_prefix_caching=False, num_blocks=400), arrivals)
        gaps = []
        for h in hs:
            if h.session != "long":
                times = [e.time for e in h.events if e.token_id is not None]
                gaps += [b - a for a, b in zip(times, times[1:])]
        ttft = next(h for h in hs if h.session == "long").output.timing["ttft"]
        out[name] = [max(gaps), percentile(gaps, 99), percentile(gaps, 50), ttft]
    return out


def fcfs_vs_vtc(bench) -> dict[str, list]:
    from .. import SamplingParams

    heavy = [(list(range(300 + i, 400 + i)), SamplingParams(max_tokens=24, ignore_eos=True), "heavy")
             for i in range(12)]
    arrivals: dict[int, list] = {0: heavy}
    for k, t in enumerate((3, 10, 18)):
        for j in range(3):
            arrivals.setdefault(t + j, []).append(
                (list(range(50 + 10 * j + k, 70 + 10 * j + k)),
                 SamplingParams(max_tokens=12, ignore_eos=True), f"light{j}"))
    asked: dict[str, int] = {}
    for _, sp, s in (a for arr in arrivals.values() for a in arr):
        asked[s] = asked.get(s, 0) + sp.max_tokens
    out = {}
    for policy in ("fcfs", "fair"):
        served: dict[str, int] = {}  # output tokens streamed by the cutoff

        def cutoff(tick, handles, served=served):
            if tick == max(arrivals) + 8:  # a few ticks after the last arrival: who got what
                for h in handles:
                    served[h.session] = served.get(h.session, 0) + sum(
                        e.token_id is not None for e in h.events)

        hs = run_trace(bench.engine(max_batch_size=4, policy=policy, enable_prefix_caching=False),
                       arrivals, cutoff)
        ttft = {s: [h.output.timing["ttft"] for h in hs if h.session == s] for s in asked}
        light = [t for s in asked if s != "heavy" for t in ttft[s]]
        out[policy] = [percentile(light, 50), percentile(light, 99), percentile(ttft["heavy"], 50),
                       percentile(ttft["heavy"], 99),
                       jain_index(served.get(s, 0) / asked[s] for s in sorted(asked)) or 0.0]
    return out


@experiment("scheduling", option("--chunk", type=at_least(1), default=128,
                                 help="the chunked run's prefill_chunk_size"),
            option("--long", type=at_least(1), default=2000, help="the long prompt's tokens"),
            smallest=("--chunk", "32", "--long", "64"))
def scheduling(bench):
    """Chunked vs monolithic prefill (stream stalls); FCFS vs VTC (fairness)."""
    a = bench.args
    cm, fv = chunked_vs_monolithic(bench, a.chunk, a.long), fcfs_vs_vtc(bench)
    mono, chk = cm["monolithic"], cm[f"chunked {a.chunk}"]
    bench.publish("scheduling", [
        "## Scheduling: chunked prefill and fairness", "",
        "`minserve bench scheduling` — embedded SmolLM2-135M, fp32, step mode on a fixed "
        "arrival trace (arrivals pinned to ticks), wall-clock times.", "",
        f"**Chunked vs monolithic prefill**: 4 chat streams decoding (48 tokens each) when a "
        f"{a.long}-token prompt arrives at tick 6.", "",
        *md_table(["prefill", "stream gap max", "stream gap p99", "stream gap p50",
                   "long prompt TTFT"],
                  [[n, f"{r[0]:.2f} s", f"{r[1]:.2f} s", f"{r[2]:.3f} s", f"{r[3]:.2f} s"]
                   for n, r in cm.items()], "---:"), "",
        f"Max gap monolithic / chunked: **{mono[0] / chk[0]:.1f}x**; the long prompt's TTFT "
        f"costs {chk[3] / mono[3]:.2f}x.", "",
        "**FCFS vs VTC**: one heavy session sends 12 requests (100-token prompts, 24 new "
        "tokens) at tick 0; three light sessions each send 3 requests (20-token prompts, 12 "
        "new tokens) around ticks 3, 10 and 18; max_batch_size 4.", "",
        *md_table(["policy", "light TTFT p50", "light TTFT p99", "heavy TTFT p50",
                   "heavy TTFT p99", "Jain (share of demand served)"],
                  [[n, *(f"{x:.2f} s" for x in r[:4]), f"{r[4]:.3f}"] for n, r in fv.items()],
                  "---:")])


STREAM = [{"role": "user", "content": "Count slowly from one to fifty, one number per line."}]


def stall(bench, prefill_chunk_size: int, prompt_tokens: int, mixed: bool = False) -> dict:
    """`stream_beside` on the padded backend, or with `mixed` Version B (mixed_batch on
    the paged backend)."""
    engine = bench.engine(max_batch_size=8, max_model_len=8192, enable_prefix_caching=False,
                          prefill_chunk_size=prefill_chunk_size,
                          **({"backend": "paged", "prefill_mode": "mixed_batch"} if mixed else {}))
    return {"chunk": prefill_chunk_size, "mixed": mixed, **stream_beside(engine, prompt_tokens)}


def stream_beside(engine, prompt_tokens: int, stream_tokens: int = 48) -> dict:
    """A chat streams `stream_tokens` tokens; two tokens in, a `prompt_tokens`-token
    document arrives (0: none). Step the engine by hand, timing every token of the
    stream: its worst gap (the stall), its median gap (TPOT) and the document's TTFT."""
    from .. import SamplingParams

    doc_ids = [(37 * k) % 4000 + 100 for k in range(prompt_tokens)]  # no chat template
    stream = engine.submit(STREAM, SamplingParams(max_tokens=stream_tokens, ignore_eos=True))
    long, stamps, long_t0, long_ttft = None, [], 0.0, None
    while not (stream.finished and (long is None or long.finished)):
        if long is None and len(stamps) >= 2 and prompt_tokens:
            long = engine.submit(doc_ids, SamplingParams(max_tokens=4, ignore_eos=True))
            long_t0 = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        stamps += [now] * (sum(ev.token_id is not None for ev in stream.events) - len(stamps))
        if long is not None and long_ttft is None and long.events:
            long_ttft = now - long_t0
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"max_gap_s": max(gaps), "tpot_s": percentile(gaps, 50),
            "stream_s": stamps[-1] - stamps[0], "long_ttft_s": long_ttft}


@experiment("long-prompt",
            option("--prompt-tokens", type=at_least(1), default=6000,
                   help="the long prompt's length"),
            option("--chunks", type=at_least(0), nargs="+", default=[0, 512, 256, 128],
                   help="prefill_chunk_size values, padded backend (0: monolithic)"),
            option("--mixed-chunks", type=at_least(1), nargs="*", default=[256],
                   help="chunk sizes to run as mixed_batch (Version B) on the paged backend"),
            smallest=("--prompt-tokens", "32", "--chunks", "0", "--mixed-chunks"))
def long_prompt(bench):
    """One long prompt beside a streaming user: how long the stream stalls."""
    a = bench.args
    runs = [stall(bench, c, a.prompt_tokens) for c in a.chunks]
    runs += [stall(bench, c, a.prompt_tokens, mixed=True) for c in a.mixed_chunks]
    rows = [["monolithic" if r["chunk"] == 0 else f"mixed_batch (paged), {r['chunk']} tokens"
             if r["mixed"] else f"chunked, {r['chunk']} tokens", f"**{r['max_gap_s']:.2f} s**",
             f"{r['stream_s']:.1f} s", f"{r['long_ttft_s']:.1f} s"] for r in runs]
    command = f".venv/bin/minserve bench long-prompt --prompt-tokens {a.prompt_tokens}"
    bench.publish("long-prompt-stall", [
        "### One long prompt beside a streaming user", "",
        f"A chat streams 48 tokens; two tokens in, a {a.prompt_tokens:,}-token document arrives "
        "(embedded SmolLM2, fp32, batch 8, stepped by hand). The stream's worst gap between two "
        "tokens is the stall the document's prefill causes; its first token is timed from its "
        f"arrival. `{command}` (one run each):", "",
        *md_table(["prefill", "stream's worst gap", "stream's 48 tokens took",
                   "long prompt's first token"], rows)])
    bench.record({(f"long_prompt.{'mixed' if r['mixed'] else 'chunked'}_{r['chunk']}_gap_s"
                   if r["chunk"] else "long_prompt.monolithic_gap_s"): round(r["max_gap_s"], 2)
                  for r in runs}, command)


# the three ways a prompt gets through the model (SPEC C2), all on the paged backend
PREFILL_MODES = {"monolithic": {"prefill_mode": "monolithic"},
                 "chunked, 256 tokens": {"prefill_mode": "chunked", "prefill_chunk_size": 256},
                 "disaggregated": {"prefill_mode": "disaggregated", "prefill_chunk_size": 256}}


@experiment("disaggregated",
            option("--prompt-tokens", type=at_least(1), default=3500,
                   help="the long prompt's length"),
            option("--stream-tokens", type=at_least(3, "a worst gap and a median need two "
                                                     "gaps"), default=64,
                   help="the stream's tokens"),
            option("--worker-threads", type=at_least(1), nargs="+", default=None,
                   help="the prefill worker's torch threads, one run each (default: half the "
                        "threads, then all of them); the decode side keeps half"),
            smallest=("--prompt-tokens", "32", "--stream-tokens", "3", "--worker-threads", "1"))
def disaggregated(bench):
    """A long prompt beside a stream, three prefill modes: worst gap, TTFT, TPOT, KV moved."""
    import torch

    a, threads = bench.args, torch.get_num_threads()
    half = max(1, threads // 2)
    modes = {k: v for k, v in PREFILL_MODES.items() if k != "disaggregated"}
    for n in a.worker_threads or sorted({half, threads}):
        modes[f"disaggregated, worker {n} of {threads} threads"] = {
            **PREFILL_MODES["disaggregated"], "prefill_worker_threads": n}
    runs = {}
    for name, cfg in modes.items():
        remote = cfg["prefill_mode"] == "disaggregated"
        if remote:  # the same cores in all: the decode side keeps half of them
            torch.set_num_threads(half)
        engine = bench.engine(backend="paged", max_batch_size=8, max_model_len=8192,
                              enable_prefix_caching=False, model_runner="auto",
                              decode_attention="auto", **cfg)
        try:
            stream_beside(engine, 256, 4)  # warm-up: the first forwards allocate
            alone = stream_beside(engine, 0, a.stream_tokens)
            before = engine.stats().get("prefill_worker", {})
            beside = stream_beside(engine, a.prompt_tokens, a.stream_tokens)
            after = engine.stats().get("prefill_worker", {})
        finally:
            engine.close()
            torch.set_num_threads(threads)
        moved = {k: after[k] - before[k] for k in ("bytes_from_worker", "transfer_s",
                                                   "prompt_tokens")} if remote else {}
        runs[name] = {**beside, "alone_tpot_s": alone["tpot_s"], **moved}
    rows = [[name, f"**{r['max_gap_s']:.2f} s**", f"{r['max_gap_s'] / r['alone_tpot_s']:.1f}x",
             f"{r['alone_tpot_s'] * 1e3:.0f} ms", f"{r['tpot_s'] * 1e3:.0f} ms",
             f"{r['stream_s']:.1f} s", f"{r['long_ttft_s']:.1f} s",
             f"{r['bytes_from_worker'] / r['prompt_tokens'] / 1024:.0f} KiB in "
             f"{r['transfer_s'] * 1e3:.0f} ms" if "prompt_tokens" in r else "—"]
            for name, r in runs.items()]
    c = runs["chunked, 256 tokens"]
    d = min((r for n, r in runs.items() if n.startswith("disagg")), key=lambda r: r["long_ttft_s"])
    command = f".venv/bin/minserve bench disaggregated --prompt-tokens {a.prompt_tokens}"
    bench.publish("disaggregated", [
        "## Disaggregated prefill", "",
        f"A chat streams {a.stream_tokens} tokens; two tokens in, a {a.prompt_tokens:,}-token "
        "prompt arrives (embedded SmolLM2, fp32, paged backend, compact forward, stepped by "
        f"hand). The same {threads} torch threads in each mode: disaggregated keeps half for "
        "the decode side and gives the prefill worker its own. TPOT is the stream's median "
        "gap; the long "
        f"prompt's first token is timed from its arrival. `{command}` (one run each):", "",
        *md_table(["prefill", "stream's worst gap", "worst gap / TPOT alone", "TPOT alone",
                   "TPOT beside the prompt", "the stream took", "long prompt's first token",
                   "KV moved per prompt token, the prompt's splice"], rows), "",
        f"Disaggregated, its faster run: the stream's worst gap is "
        f"{d['max_gap_s'] / d['alone_tpot_s']:.1f}x its TPOT alone; the long prompt's first "
        f"token took {d['long_ttft_s']:.1f} s, against chunked prefill's "
        f"{c['long_ttft_s']:.1f} s plus the transfer's {d['transfer_s']:.2f} s, while the "
        f"stream, no longer stalled, took {d['stream_s']:.1f} s instead of "
        f"{c['stream_s']:.1f} s on the same cores."])
    bench.record({"disagg.monolithic_gap_s": round(runs["monolithic"]["max_gap_s"], 2),
                  "disagg.chunked_gap_s": round(c["max_gap_s"], 2),
                  "disagg.disaggregated_gap_s": round(d["max_gap_s"], 2),
                  "disagg.chunked_ttft_s": round(c["long_ttft_s"], 1),
                  "disagg.disaggregated_ttft_s": round(d["long_ttft_s"], 1)}, command)


def light_user_ttft(bench, flood_start_s: float = 3.0, flood: dict | None = None,
                    **engine_cfg) -> dict:
    from .. import SamplingParams
    from ..chat.logic import FLOOD_DEFAULTS, ChatApp, app_defaults

    policy = engine_cfg.pop("policy", "fair")
    engine = bench.engine(**{**app_defaults(policy), "policy": policy, **engine_cfg})
    app = ChatApp(engine)  # starts the worker, as the demo does
    try:
        app.noisy.start(**(flood or FLOOD_DEFAULTS))
        time.sleep(flood_start_s)
        t0 = time.perf_counter()
        h = engine.submit([{"role": "user", "content": "What is the capital of France? Answer "
                            "in one sentence."}], SamplingParams(max_tokens=16, temperature=0.0),
                          session_id="user-light")
        next(iter(h))
        ttft = time.perf_counter() - t0
        h.cancel()
        return {"policy": policy, "cap": engine.config.max_rows_per_session, "ttft_s": ttft}
    finally:
        app.noisy.stop()
        app.close()


@experiment("demo-wait",
            option("--after", type=float, default=3.0,
                   help="seconds into the flood the light user sends"),
            option("--flood", type=at_least(1), default=None,
                   help="the flood's requests in all (default: the demo's, "
                        "chat.logic.FLOOD_DEFAULTS)"),
            smallest=("--after", "0.2", "--flood", "4"))
def demo_wait(bench):
    """The chat demo's light user: first token under its flood (docs/demo.md)."""
    from ..chat.logic import FLOOD_DEFAULTS
    from .report import DOC

    a = bench.args
    flood = dict(FLOOD_DEFAULTS)
    if a.flood:  # a smaller flood, as many in flight as it has requests at most
        flood.update(total=a.flood, in_flight=min(a.flood, flood["in_flight"]))
    kw = {"flood_start_s": a.after, "flood": flood}
    runs = [light_user_ttft(bench, **kw),  # the demo's defaults: fair + its row cap
            light_user_ttft(bench, max_rows_per_session=None, **kw),
            light_user_ttft(bench, policy="fcfs", **kw)]  # the demo's fcfs: no cap
    rows = [[f"{r['policy']}, " + (f"row cap {r['cap']} per session" if r["cap"] else "no row cap"),
             f"**{r['ttft_s']:.1f} s**"] for r in runs]
    default = flood == FLOOD_DEFAULTS and a.after == 3.0
    bench.publish("light-user-wait", [
        f"A light user's chat sent {a.after:g} s into the {'default ' if default else ''}flood "
        f"({flood['total']} requests, {flood['in_flight']} in flight, replies up to "
        f"{flood['max_tokens']} tokens), batch 8, the embedded SmolLM2 on this machine's CPU; "
        "`minserve bench demo-wait` (one run each):", "",
        *md_table(["engine", "light user's first token after"], rows)], doc=DOC.parent / "demo.md")
    if default:  # the figures docs/demo.md quotes are the default flood's
        bench.record({n: round(r["ttft_s"], 1) for n, r in zip(
            ("demo_wait.fair_cap_s", "demo_wait.fair_nocap_s", "demo_wait.fcfs_s"), runs)},
            "minserve bench demo-wait, one run each")

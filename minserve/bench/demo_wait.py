"""How long a light chat user waits for a first token while the demo's flood runs.

    python -m minserve.bench.demo_wait            # ~1.5 min on 2 cores; writes docs/demo.md

The chat demo's own logic (`minserve.chat.logic.ChatApp`, its `NoisyNeighbour` with
the page's default flood: 48 requests, 24 in flight, replies up to 128 tokens) on
the embedded SmolLM2, the demo's engine defaults (batch 8, fair). A light user sends
one chat message 3 s into the flood, as the docs tell a visitor to do; we time its
first token. Three engines: fair with the demo's per-session row cap (the default),
fair without the cap, and FCFS, which the demo runs without it (`app_defaults`).
The three times go into docs/figures.json (`demo_wait.*`), which docs/demo.md quotes.

Why the cap matters under fair: VTC puts the light user first in line at once, but
a line only moves when a row frees, and with every row held by a flood reply of up
to 128 tokens that takes seconds. With `max_rows_per_session=6`, the flood can hold
6 of the 8 rows, so a row is free when the light user arrives.
"""

from __future__ import annotations

import argparse
import time

from .docs_report import DOC, machine_line, publish

PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def light_user_ttft(model, tokenizer, *, flood_start_s: float = 3.0, **engine_cfg) -> dict:
    from .. import Engine, EngineConfig, SamplingParams
    from ..chat.logic import FLOOD_DEFAULTS, ChatApp, app_defaults

    policy = engine_cfg.pop("policy", "fair")
    cfg = EngineConfig(**{**app_defaults(policy), "policy": policy, "device": "cpu",
                          **engine_cfg})
    engine = Engine(cfg, model=model, tokenizer=tokenizer)
    app = ChatApp(engine)  # starts the worker, as the demo does
    try:
        app.noisy.start(**FLOOD_DEFAULTS)
        time.sleep(flood_start_s)
        t0 = time.perf_counter()
        h = engine.submit(PROMPT, SamplingParams(max_tokens=16, temperature=0.0),
                          session_id="user-light")
        first = next(iter(h))
        ttft = time.perf_counter() - t0
        h.cancel()
        stats = engine.stats()
        return {"policy": cfg.policy, "max_rows_per_session": cfg.max_rows_per_session,
                "ttft_s": ttft, "first_index": first.index,
                "flood_done_at_first_token": app.noisy.counts["done"],
                "active": stats["queues"]["active"]}
    finally:
        app.noisy.stop()
        app.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-docs", action="store_true", help="print only; leave docs/demo.md")
    args = p.parse_args(argv)
    import torch

    from ..models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(None, "float32", "cpu")
    runs = [light_user_ttft(model, tokenizer),  # the demo's defaults: fair + row cap 6
            light_user_ttft(model, tokenizer, max_rows_per_session=None),
            light_user_ttft(model, tokenizer, policy="fcfs")]  # the demo's fcfs: no cap
    rows = ["| engine | light user's first token after |", "|---|---|"]
    for r in runs:
        cap = (f"row cap {r['max_rows_per_session']} per session"
               if r["max_rows_per_session"] else "no row cap")
        rows.append(f"| {r['policy']}, {cap} | **{r['ttft_s']:.1f} s** |")
    md = "\n".join([
        "A light user's chat sent 3 s into the default flood (48 requests, 24 in flight, "
        "replies up to 128 tokens), batch 8, the embedded SmolLM2 on this machine's CPU; "
        "`python -m minserve.bench.demo_wait` (one run each):", "", *rows, "",
        machine_line()])
    publish("light-user-wait", md, write=not args.no_docs, doc=DOC.parent / "demo.md")
    if not args.no_docs:
        from . import figures

        names = ("demo_wait.fair_cap_s", "demo_wait.fair_nocap_s", "demo_wait.fcfs_s")
        figures.record({n: round(r["ttft_s"], 1) for n, r in zip(names, runs)},
                       source=f"python -m minserve.bench.demo_wait ({machine_line().strip('_')}, "
                              "one run each)")


if __name__ == "__main__":
    main()

"""Command line: `minserve demo`, `minserve serve`, `minserve keys` (or `python -m minserve ...`).

`demo` runs the embedded model on a handful of chat prompts with a decode
batch smaller than the number of requests, and prints every tick: who was
admitted, whose prompt was prefilled, who left, and the token each row got.
You watch rows join and leave one continuous batch.
"""

from __future__ import annotations

import argparse
import sys

DEMO_PROMPTS = [
    ("alice", "Name three primary colours.", 24),
    ("bob", "Write one sentence about the sea.", 32),
    ("carol", "What is 12 times 12?", 12),
    ("dave", "Give me a synonym for 'happy'.", 10),
    ("erin", "Translate 'good morning' into French.", 16),
    ("frank", "List two planets in our solar system.", 20),
]


DEMO_DESCRIPTION = "Six chat prompts on the embedded model, every tick printed."


def demo(args: argparse.Namespace) -> int:
    from . import Engine, EngineConfig, SamplingParams

    print("loading the embedded SmolLM2-135M-Instruct (the first run converts it once, into "
          "~/.cache/minserve) ...")
    engine = Engine(EngineConfig(max_batch_size=args.max_batch_size, policy=args.policy,
                                 backend=args.backend, prefill_chunk_size=args.prefill_chunk_size))
    handles = {}
    for session, text, n in DEMO_PROMPTS:
        h = engine.submit([{"role": "user", "content": text}], SamplingParams(max_tokens=n),
                          session_id=session)
        handles[h.request_id] = (session, text, h)
    names = {rid: s for rid, (s, _, _) in handles.items()}
    print(f"{len(handles)} requests, max_batch_size={args.max_batch_size}\n")
    while engine.scheduler.has_work():
        rec = engine.step()
        parts = []
        if rec.admit.admitted:
            parts.append("admit " + ",".join(names[a["request_id"]] for a in rec.admit.admitted))
        if rec.prefill.promoted:
            parts.append("prefilled " + ",".join(names[r] for r in rec.prefill.promoted))
        if rec.evict.evicted:
            parts.append("evict " + ",".join(f"{names[e['request_id']]}({e['finish_reason']})"
                                            for e in rec.evict.evicted))
        if rec.decode.rows:
            parts.append(f"decode B={len(rec.decode.rows)} [" + " ".join(
                names[r] for r in rec.decode.rows) + "]")
        waiting = len(rec.queues["pending"])
        print(f"tick {rec.tick:3d}  pending={waiting}  " + " | ".join(parts))
    print()
    for _rid, (session, text, h) in handles.items():
        out = h.result()
        print(f"[{session}] {text}\n    -> {out.text.strip()!r} ({len(out.token_ids)} tokens, "
              f"{out.finish_reason})")
    s = engine.stats()
    print(f"\nticks={s['ticks']} tokens={s['tokens_generated']} reserved after drain="
          f"{s['active_kv_reserved']}")
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line: the parser, and each subcommand's own (tests read their help)."""
    parser = argparse.ArgumentParser(prog="minserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="watch a continuous batch on the embedded model",
                       description=DEMO_DESCRIPTION)
    d.add_argument("--max-batch-size", type=int, default=3,
                   help="rows in the decode batch, fewer than the 6 prompts (default: 3)")
    d.add_argument("--policy", default="fcfs", choices=["fcfs", "fair"],
                   help="who runs next (default: fcfs)")
    d.add_argument("--backend", default="padded", choices=["padded", "paged"],
                   help="where the KV lives (default: padded)")
    d.add_argument("--prefill-chunk-size", type=int, default=0,
                   help="prompt tokens per tick (default: 0, each prompt whole)")
    d.set_defaults(fn=demo)
    from .server.cli import add_serve_arguments, serve  # no web imports until `serve` runs

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'server' extra)",
                       description="Serve the engine over HTTP (OpenAI API). Every engine "
                                   "flag can also be set by its upper-case environment "
                                   "variable; flags win.")
    add_serve_arguments(s)
    s.set_defaults(fn=serve)
    from .bench.cli import DefaultsHelp, add_bench_arguments, bench  # torch loads when it runs

    b = sub.add_parser("bench", help="benchmark minserve against its peers (JSON + HTML report)",
                       formatter_class=DefaultsHelp,
                       description="Replay a seeded workload against minserve (in process or "
                                   "over HTTP) and Hugging Face baselines; see docs/benchmarks.md.")
    add_bench_arguments(b)
    b.set_defaults(fn=bench)
    from .server.keys import add_keys_arguments, keys_command

    k = sub.add_parser("keys", help="make or check an --api-keys-file (docs/security.md)")
    add_keys_arguments(k)
    k.set_defaults(fn=keys_command)
    return parser, {"demo": d, "serve": s, "bench": b, "keys": k}


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's own usage, and the flag it probably meant
        sub = commands[args.cmd]
        sub.error(f"unrecognized arguments: {' '.join(unknown)}{suggest(unknown, sub)}")
    return args.fn(args)


def suggest(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """'; did you mean --max-batch-size?' for `--batch-size` (contained in, or close to, a
    real flag of this subcommand)."""
    import difflib

    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for u in (x.split("=")[0] for x in unknown if x.startswith("--")):
        near = [f for f in flags if u[2:] and u[2:] in f] or \
            difflib.get_close_matches(u, flags, n=1, cutoff=0.6)
        if near:
            hints.append(f"{u} -> {min(near, key=len)}")
    return f" (did you mean: {', '.join(hints)}?)" if hints else ""


if __name__ == "__main__":
    sys.exit(main())

"""`minserve bench [EXPERIMENT] [options]`: one command for every experiment.

    minserve bench --list                      # the experiments, one line each
    minserve bench                             # the default: `serving` (minserve vs its peers)
    minserve bench kv-cache --batch 8          # one experiment, its own options
    minserve bench linear --threads 1 --no-docs

Every experiment also takes `--threads` (torch's intra-op threads), `--no-docs`
(print the section, leave the docs as they are) and `--tiny` (a tiny random model: a
smoke run in seconds, never written to the docs). Each option's help ends with its
default, in words where a bare value would mislead (`DefaultsHelp`). `python -m minserve.bench ...` is the
same command without the rest of `minserve`'s imports (scripts/gpu_check.sh uses it).
"""

from __future__ import annotations

import argparse
import sys

# `serving` puts minserve beside its peers (HF in process, any server over HTTP), and
# `served-token` times `minserve serve` with the peers' client, so both are declared in
# peers/; this command, which lists every experiment, is the one module of bench/ that
# imports peers/ (tests/test_layout.py allows it those two modules there, nothing else).
from ..peers import served, serving
from . import admission, attention, floor, forward, gpu, kv, scheduling, shares, throughput
from .registry import Bench, DefaultsHelp, Experiment, at_least

DEFAULT = "serving"
# in the order of docs/benchmarks.md
EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    serving.serving, throughput.decode_throughput, kv.kv_cache, scheduling.scheduling,
    scheduling.long_prompt, scheduling.disaggregated, throughput.busy, admission.admission,
    shares.shares, forward.tick_profile,
    forward.compact, forward.linear, attention.attention, floor.floor, served.served_token,
    scheduling.demo_wait, gpu.gpu)}


def _add(p: argparse.ArgumentParser, e: Experiment) -> None:
    for flags, kwargs in e.options:
        p.add_argument(*flags, **kwargs)
    p.add_argument("--threads", type=at_least(1), default=e.threads,
                   help="torch intra-op threads (default: "
                        + (f"{e.threads})" if e.threads else "torch's own, one per core)"))
    p.add_argument("--no-docs", action="store_true",
                   help="print only, leave the docs alone (default: write the section into "
                        "the docs)")
    if not any("--tiny" in flags for flags, _ in e.options):
        p.add_argument("--tiny", action="store_true",
                       help="a tiny random Llama over SmolLM2's tokenizer instead of the model: "
                            "a smoke run in seconds, its figures meaningless, never written to "
                            "the docs (default: the embedded SmolLM2)")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The default experiment's options on `p` itself, and one subcommand per experiment."""
    # No abbreviations on `p`: it sees every word of the command line, an experiment's
    # options too, and would read `gpu --out DIR` as an ambiguous short form of the
    # default experiment's `--output-len` / `--out-dir` and refuse the whole command.
    p.allow_abbrev = False
    p.add_argument("--list", action="store_true",
                   help="list the experiments and exit (default: run one)")
    _add(p, EXPERIMENTS[DEFAULT])
    sub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT",
                           help=f"one of: {', '.join(EXPERIMENTS)} (default: {DEFAULT})")
    for e in EXPERIMENTS.values():
        _add(sub.add_parser(e.name, help=e.help, description=(e.run.__doc__ or "").strip(),
                            formatter_class=DefaultsHelp), e)


def listing() -> str:
    width = max(map(len, EXPERIMENTS))
    return "\n".join(f"{name:<{width}}  {e.help}" + ("  (the default)" if name == DEFAULT else "")
                     for name, e in EXPERIMENTS.items())


def bench(args: argparse.Namespace) -> int:
    if args.list:
        print(listing())
        return 0
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    name = args.experiment or DEFAULT
    try:
        return EXPERIMENTS[name].run(Bench(args)) or 0
    except ValueError as e:  # options no engine can take (EngineConfig says what to change)
        print(f"minserve bench {name}: error: {e}", file=sys.stderr)
        return 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minserve.bench", description=__doc__.splitlines()[0],
                                formatter_class=DefaultsHelp)
    add_bench_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return bench(parser().parse_args(argv))

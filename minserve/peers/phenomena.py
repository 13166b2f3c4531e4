"""Two of the lessons' phenomena, measured on minserve and on vLLM over HTTP (docs/benchmarks.md).

Lesson 03 (prefix caching): the second request that shares a long prefix with the
first starts sooner, because the prefix's KV is reused, not recomputed.

    closed loop, one at a time: P + a, then P + b    (P: 1,500 tokens, a/b: 20 tokens)
    figure: TTFT of the first (cold) and the second (warm), cache on and off

Lesson 06 (chunked prefill): a long prompt arriving while another user streams
stalls that stream for its whole prefill, unless the prefill is cut into chunks.

    a short chat streams 64 tokens; 1.5 s in, a 3,500-token prompt arrives
    figure: the stream's worst gap between two tokens, chunked prefill on and off

Each server is started once per setting (`servers.py`): minserve with
`--enable-prefix-caching` / `--no-enable-prefix-caching`, `--prefill-chunk-size 256`,
`--prefill-mode monolithic` and `--prefill-mode disaggregated` (minserve only); vLLM with `--enable-prefix-caching` / `--no-enable-prefix-caching` and
`--enable-chunked-prefill` / `--no-enable-chunked-prefill`. Prompts go as token ids
to /v1/completions (both servers take them), so both do exactly the same work.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..bench.workload import BenchRequest, Workload, prompt_ids_text
from .openai_target import OpenAITarget
from .servers import ServerCommand, running

PREFIX_TOKENS, SUFFIX_TOKENS = 1500, 20
LONG_PROMPT_TOKENS, STREAM_TOKENS, LONG_AFTER_S = 3500, 64, 1.5

# setting name -> (minserve flags, vLLM flags)
SETTINGS = {
    "prefix cache on": (["--enable-prefix-caching"], ["--enable-prefix-caching"]),
    "prefix cache off": (["--no-enable-prefix-caching"], ["--no-enable-prefix-caching"]),
    "chunked prefill": (["--prefill-chunk-size", "256"], ["--enable-chunked-prefill"]),
    # by name: chunk size 0 alone is still a mixed_batch server whose per-tick prompt
    # budget (--max-prefill-tokens 512) cuts the prompt into pieces
    "monolithic prefill": (["--prefill-mode", "monolithic", "--prefill-chunk-size", "0"],
                           ["--no-enable-chunked-prefill"]),
    # minserve only: vLLM's disaggregation is two servers and a proxy (docs/outgrowing.md)
    "disaggregated prefill": (["--prefill-mode", "disaggregated"], None),
}


def _text(n: int, seed: int, tokenizer) -> tuple[int, ...]:
    return tuple(prompt_ids_text(n, np.random.default_rng([seed, 99]), tokenizer))


def prefix_workload(tokenizer, seed: int = 0) -> Workload:
    """P + a, then P + b, one at a time (closed loop of one)."""
    p = _text(PREFIX_TOKENS, 1 + 100 * seed, tokenizer)
    reqs = [BenchRequest(i, "s", None, p + _text(SUFFIX_TOKENS, 10 + i + 100 * seed, tokenizer),
                         8)
            for i in range(2)]
    return Workload(reqs, concurrency=1, settings={"what": "prefix"})


def stall_workload(tokenizer, seed: int = 0) -> Workload:
    """A short stream at t=0; a long prompt LONG_AFTER_S later."""
    stream = BenchRequest(0, "chat", 0.0, _text(24, 2 + 100 * seed, tokenizer), STREAM_TOKENS)
    long = BenchRequest(1, "doc", LONG_AFTER_S,
                        _text(LONG_PROMPT_TOKENS, 3 + 100 * seed, tokenizer), 4)
    return Workload([stream, long], settings={"what": "stall", "rate": 1.0})


def measure(url: str, tokenizer, setting: str, seed: int = 0) -> dict[str, float | None]:
    """The figure of `setting` on the server at `url`. Each seed has its own prompts, so
    a warm-up run (another seed) leaves nothing in the prefix cache for this one."""
    target = OpenAITarget(url, api="completions", ignore_eos=True, name=setting)
    if setting.startswith("prefix"):
        res = target.run(prefix_workload(tokenizer, seed), progress=False).results
        return {"cold_ttft_s": res[0].ttft, "warm_ttft_s": res[1].ttft}
    res = target.run(stall_workload(tokenizer, seed), progress=False).results
    gaps = res[0].itls
    return {"stall_s": max(gaps) if gaps else None, "long_ttft_s": res[1].ttft}


def run_all(commands: dict[str, Callable[[list[str]], ServerCommand]], tokenizer,
            out_dir: str | Path) -> dict[str, dict[str, dict]]:
    """`commands`: server name -> a function of extra flags giving its ServerCommand.
    Returns {server: {setting: figures}}."""
    figures: dict[str, dict[str, dict]] = {}
    for name, make in commands.items():
        for setting, (ours, vllm) in SETTINGS.items():
            flags = ours if name == "minserve" else vllm
            if flags is None:
                continue
            cmd = make(flags)
            slug = f"{name.split()[0].lower()}-{setting.replace(' ', '-')}"
            with running(cmd, Path(out_dir) / f"{slug}.log") as url:
                measure(url, tokenizer, setting, seed=1)  # warm-up: first forwards allocate
                figures.setdefault(name, {})[setting] = measure(url, tokenizer, setting)
            print(f"   {name}, {setting}: {figures[name][setting]}", flush=True)
    return figures


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def table(figures: dict[str, dict[str, dict]]) -> str:
    rows = ["| server | prefix cache on: TTFT cold → warm | prefix cache off: cold → warm | "
            "stream's worst gap, chunked prefill | the same, monolithic | the same, "
            "disaggregated (its TTFT) |",
            "|---|---|---|---|---|---|"]
    for name, f in figures.items():
        on, off = f.get("prefix cache on", {}), f.get("prefix cache off", {})
        ch, mono = f.get("chunked prefill", {}), f.get("monolithic prefill", {})
        dis = f.get("disaggregated prefill", {})
        rows.append(f"| {name} | {_s(on.get('cold_ttft_s'))} → {_s(on.get('warm_ttft_s'))} | "
                    f"{_s(off.get('cold_ttft_s'))} → {_s(off.get('warm_ttft_s'))} | "
                    f"{_s(ch.get('stall_s'))} | {_s(mono.get('stall_s'))} | "
                    + (f"{_s(dis['stall_s'])} ({_s(dis.get('long_ttft_s'))})" if dis else "—")
                    + " |")
    return "\n".join(rows)

"""The peers: plain Hugging Face serving the same workload, same model, same process
(docs/benchmarks.md). Each is what you would write with `transformers` alone.

* `HFStaticTarget` -- static batching with `model.generate`. A batch starts when
  the previous one has finished, taking whatever has arrived by then (up to the
  same `max_batch_size` as minserve), left-padded to its longest prompt, and
  runs until its longest output is done: a short request waits for the long
  ones beside it, and a request that arrives mid-batch waits for the whole
  batch. (Orca's motivating picture, measured.) Tokens are stamped by a
  streamer as each step produces them; a row's result counts as finished at
  its own last token, the most generous reading for this peer.

* `HFContinuousTarget` -- Hugging Face's own continuous batching, the
  `ContinuousBatchingManager` that `model.generate_batch(...)` wraps
  (transformers >= 5): paged KV cache, prefill chunks packed with decode rows
  in one forward. We drive the manager directly rather than `generate_batch`
  so that requests can arrive at their scheduled times (generate_batch takes
  them all at t=0, which is the same thing for an offline workload) and so
  that setting up its cache happens before the clock starts. Its knobs are
  set to match minserve: at most `max_batch_size` requests per forward, a KV
  pool sized from the workload (its default sizes the pool from free device
  memory, which on a CPU means most of the RAM and half a minute of `fill_`).

Both run greedy, and by default ignore EOS (run to max_tokens) like the other
targets, so every target does the same number of tokens of work.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from ..bench.metrics import RequestResult
from ..bench.targets import Progress, RunResult, new_result
from ..bench.workload import BenchRequest, Workload


@contextlib.contextmanager
def _quiet_transformers():
    """eos_token_id=-1 (never stop) makes generate warn once per call; say it once here."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def _plain_attention(model):
    """Run a peer with Hugging Face's own attention. minserve's paged backend registers
    its attention function on the model it serves ("minserve_paged"); HF continuous
    batching refuses unknown implementations, and a peer should not run ours anyway."""
    current = model.config._attn_implementation
    plain = current in ("sdpa", "eager") or "flash" in str(current)
    if not plain:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if not plain:
            model.set_attn_implementation(current)


def _eos_ids(model) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def _pad_id(model) -> int:
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad is None:
        eos = _eos_ids(model)
        pad = eos[0] if eos else 0
    return int(pad[0] if isinstance(pad, (list, tuple)) else pad)


def _not_run(req: BenchRequest) -> RequestResult:
    res = new_result(req, math.nan)
    res.error = "not run (the target stopped early)"
    return res


class _StepStamper:
    """A `generate` streamer that only notes when each decoding step's tokens appear."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first hands over the prompt itself
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFStaticTarget:
    name = "hf-static"

    def __init__(self, model, max_batch_size: int, ignore_eos: bool = True) -> None:
        self.model, self.max_batch_size, self.ignore_eos = model, max_batch_size, ignore_eos
        self.eos, self.pad = _eos_ids(model), _pad_id(model)
        self.device = next(model.parameters()).device

    def run(self, workload: Workload, progress: bool = True) -> RunResult:
        with _plain_attention(self.model):
            return self._run(workload, progress)

    def _run(self, workload: Workload, progress: bool) -> RunResult:
        bar = Progress(len(workload.requests), self.name, progress)
        waiting = list(workload.requests)
        if workload.open_loop:
            waiting.sort(key=lambda r: (r.arrival_s, r.index))
        results: dict[int, RequestResult] = {}
        size = self.max_batch_size if workload.open_loop else min(self.max_batch_size,
                                                                   workload.concurrency)
        t0 = time.perf_counter()
        try:
            while waiting:
                now = time.perf_counter()
                if workload.open_loop:
                    arrived = [r for r in waiting if t0 + r.arrival_s <= now]
                    if not arrived:  # idle until the next arrival
                        time.sleep(max(0.0, t0 + waiting[0].arrival_s - now))
                        continue
                    batch = arrived[:size]
                    for r in batch:
                        results[r.index] = new_result(r, t0 + r.arrival_s)
                else:  # closed loop: the next requests are sent when the batch before ends
                    batch = waiting[:size]
                    for r in batch:
                        results[r.index] = new_result(r, now)
                self._run_batch(batch, [results[r.index] for r in batch])
                taken = {r.index for r in batch}
                waiting = [r for r in waiting if r.index not in taken]
                bar.update(len(batch))
        finally:
            bar.close()
        ordered = [results.get(r.index) or _not_run(r) for r in workload.requests]
        t1 = max((r.finished for r in ordered if r.finished), default=time.perf_counter())
        return RunResult(self.name, ordered, t0, t1, {"max_batch_size": self.max_batch_size,
                                                      "method": "model.generate, static batches"})

    @torch.inference_mode()
    def _run_batch(self, batch: list[BenchRequest], res: list[RequestResult]) -> None:
        from transformers import GenerationConfig

        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)  # (B, L), left-padded
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_ids)
            mask[i, width - r.prompt_len:] = 1
        n_new = max(r.max_tokens for r in batch)
        cfg = GenerationConfig(max_new_tokens=n_new, do_sample=False, pad_token_id=self.pad,
                               eos_token_id=-1 if self.ignore_eos or not self.eos else self.eos)
        stamps = _StepStamper()
        sent = time.perf_counter()
        with _quiet_transformers():
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=cfg, streamer=stamps)
        gen = out[:, width:].tolist()  # (B, <= n_new)
        for i, (r, row) in enumerate(zip(batch, res)):
            n = min(r.max_tokens, len(gen[i]))
            if not self.ignore_eos:  # up to and including the first EOS
                n = next((j + 1 for j, t in enumerate(gen[i][:n]) if t in self.eos), n)
            row.sent, row.output_len = sent, n
            row.token_times = stamps.times[:n]
            row.finished = row.token_times[-1] if row.token_times else time.perf_counter()
            row.finish_reason = "length" if n == r.max_tokens else "stop"


class HFContinuousTarget:
    name = "hf-continuous"

    def __init__(self, model, max_batch_size: int, ignore_eos: bool = True, page_size: int = 32,
                 max_batch_tokens: int | None = None, num_blocks: int | None = None) -> None:
        self.model, self.max_batch_size, self.ignore_eos = model, max_batch_size, ignore_eos
        self.page_size, self.max_batch_tokens, self.num_blocks = page_size, max_batch_tokens, num_blocks
        self.eos, self.pad = _eos_ids(model), _pad_id(model)

    def _manager(self, workload: Workload):
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        reqs = workload.requests
        longest = max(r.prompt_len + r.max_tokens for r in reqs)
        # Room for max_batch_size of the longest request, twice over (finished requests'
        # blocks stay cached for prefix sharing until evicted).
        num_blocks = self.num_blocks or 2 * self.max_batch_size * math.ceil(longest / self.page_size)
        # Token budget per forward: a whole prompt plus every decode row, like one
        # minserve tick with a monolithic prefill.
        mbt = self.max_batch_tokens or max(256, max(r.prompt_len for r in reqs) + self.max_batch_size)
        cb = ContinuousBatchingConfig(page_size=self.page_size, num_blocks=num_blocks,
                                      max_batch_tokens=mbt,
                                      max_requests_per_batch=self.max_batch_size, seed=0)
        gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs),
                               eos_token_id=self.eos or -1, pad_token_id=self.pad)
        manager = self.model.init_continuous_batching(generation_config=gen,
                                                      continuous_batching_config=cb)
        manager.warmup()  # builds the paged cache and static buffers: off the clock
        info = {"max_requests_per_batch": self.max_batch_size, "max_batch_tokens": mbt,
                "num_blocks": num_blocks, "page_size": self.page_size,
                "method": "transformers ContinuousBatchingManager (what generate_batch wraps)"}
        return manager, info

    def run(self, workload: Workload, progress: bool = True) -> RunResult:
        with _plain_attention(self.model):
            return self._run(workload, progress)

    def _run(self, workload: Workload, progress: bool) -> RunResult:
        manager, info = self._manager(workload)
        reqs = list(workload.requests)
        if workload.open_loop:
            reqs.sort(key=lambda r: (r.arrival_s, r.index))
        results: dict[str, RequestResult] = {}
        bar = Progress(len(reqs), self.name, progress)
        eos = -1 if self.ignore_eos or not self.eos else self.eos
        manager.start()
        t0 = time.perf_counter()
        nxt = in_flight = done = 0
        try:
            while done < len(reqs):
                now = time.perf_counter()
                while nxt < len(reqs) and (
                        (workload.open_loop and t0 + reqs[nxt].arrival_s <= now)
                        or (not workload.open_loop and in_flight < workload.concurrency)):
                    r = reqs[nxt]
                    rid = f"bench-{r.index}"
                    res = results[rid] = new_result(
                        r, t0 + r.arrival_s if workload.open_loop else now)
                    res.sent = time.perf_counter()
                    accepted = manager.add_request(list(r.prompt_ids), request_id=rid,
                                                   max_new_tokens=r.max_tokens, streaming=True,
                                                   eos_token_id=eos)
                    nxt, in_flight = nxt + 1, in_flight + 1
                    if accepted is None:  # the manager refused it (stopping / queue full)
                        res.error, res.finished = "not accepted", time.perf_counter()
                        in_flight, done = in_flight - 1, done + 1
                        bar.update()
                wait = 0.5
                if workload.open_loop and nxt < len(reqs):
                    wait = min(wait, max(0.0005, t0 + reqs[nxt].arrival_s - now))
                out = manager.get_result(timeout=wait)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread died")
                    continue
                stamp = time.perf_counter()
                res = results[out.request_id]
                n = len(out.generated_tokens)  # cumulative when streaming
                res.token_times += [stamp] * max(0, n - res.output_len)
                res.output_len = max(res.output_len, n)
                if out.is_finished():
                    res.finished, in_flight, done = stamp, in_flight - 1, done + 1
                    res.finish_reason = "length" if n >= res.max_tokens else "stop"
                    res.error = out.error
                    bar.update()
        finally:
            bar.close()
            manager.stop(block=True, timeout=30)
            manager.destroy()
        ordered = [results.get(f"bench-{r.index}") or _not_run(r) for r in workload.requests]
        t1 = max((r.finished for r in ordered if r.finished), default=time.perf_counter())
        return RunResult(self.name, ordered, t0, t1, info)

"""What a workload is replayed against (docs/benchmarks.md): minserve in process, and the
driver that every target over a stream shares.

Every target has `run(workload, progress=True) -> RunResult`. `EngineTarget` here and
`OpenAITarget` (any OpenAI-compatible server over streaming HTTP, in
minserve/peers/openai_target.py) use one asyncio driver, `drive`: a coroutine per
request sleeps until its scheduled arrival (open loop) or until a slot frees (closed
loop), submits, and stamps each token the moment it reaches the client. The Hugging
Face peers, which run in this process without a server, are in minserve/peers/hf.py.

In process, the engine runs in serving mode (`engine.start()`): its worker
thread ticks while this thread's event loop submits and awaits handles
(`async for ev in handle`), exactly as the HTTP server does, minus HTTP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .metrics import RequestResult, summarize
from .workload import BenchRequest, Workload


@dataclass
class RunResult:
    """One target's run of one workload."""

    target: str
    results: list[RequestResult]
    t_start: float
    t_end: float
    info: dict[str, Any] = field(default_factory=dict)  # target settings, engine stats, ...

    def summary(self, session_weights: dict[str, float] | None = None) -> dict[str, Any]:
        return summarize(self.results, self.t_start, self.t_end, session_weights)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "info": self.info, "summary": self.summary(),
                "requests": [r.to_dict(self.t_start) for r in self.results]}


class Progress:
    """A tqdm bar when tqdm is installed and wanted; otherwise nothing."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="req", leave=True)
            except ImportError:  # the `bench` extra is not installed: run quietly
                pass

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_sync(coro):
    """`asyncio.run(coro)`, also when this thread already runs an event loop (a Jupyter
    kernel does, and so does `otter run`'s): asyncio.run refuses to nest, so the coroutine
    then gets a fresh loop in a helper thread, and this call waits for it. Handles wake
    their readers on the reader's own loop (streaming.py), so either way works."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-loop") as pool:
        return pool.submit(asyncio.run, coro).result()


def new_result(req: BenchRequest, arrival: float) -> RequestResult:
    return RequestResult(req.index, req.session, req.prompt_len, req.max_tokens, arrival)


async def drive(workload: Workload, send: Callable[[BenchRequest, RequestResult], Awaitable[None]],
                desc: str, progress: bool) -> tuple[list[RequestResult], float, float]:
    """Replay `workload` through `send(req, result)` (which fills `result`); return
    (results in workload order, t_start, t_end)."""
    bar = Progress(len(workload.requests), desc, progress)
    results: list[RequestResult | None] = [None] * len(workload.requests)
    slots = asyncio.Semaphore(workload.concurrency) if not workload.open_loop else None
    t0 = time.perf_counter()

    async def one(i: int, req: BenchRequest) -> None:
        if slots is not None:
            await slots.acquire()
            arrival = time.perf_counter()
        else:
            arrival = t0 + req.arrival_s
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        res = results[i] = new_result(req, arrival)
        res.sent = time.perf_counter()
        try:
            await send(req, res)
        except Exception as e:  # a target failure is a result, not a crash of the bench
            res.error = res.error or f"{type(e).__name__}: {e}"
            res.finished = res.finished or time.perf_counter()
        finally:
            if slots is not None:
                slots.release()
            bar.update()

    try:
        await asyncio.gather(*(one(i, r) for i, r in enumerate(workload.requests)))
    finally:
        bar.close()
    ends = [r.finished for r in results if r is not None and r.finished is not None]
    return list(results), t0, max(ends) if ends else time.perf_counter()


class EngineTarget:
    """The in-process engine, in serving mode. Starts the worker if it is not running
    (and stops it again afterwards); does not touch the engine's configuration."""

    name = "minserve"

    def __init__(self, engine, ignore_eos: bool = True, temperature: float = 0.0) -> None:
        self.engine, self.ignore_eos, self.temperature = engine, ignore_eos, temperature

    def run(self, workload: Workload, progress: bool = True) -> RunResult:
        from ..sampling import SamplingParams

        engine = self.engine
        started_here = not engine.running
        engine.start()

        async def send(req: BenchRequest, res: RequestResult) -> None:
            params = SamplingParams(max_tokens=req.max_tokens, temperature=self.temperature,
                                    ignore_eos=self.ignore_eos, seed=req.index)
            handle = engine.submit(list(req.prompt_ids), params, session_id=req.session)
            async for ev in handle:
                now = time.perf_counter()
                if ev.token_id is not None:
                    res.token_times.append(now)
                    res.output_len += 1
                if ev.finish_reason is not None:
                    res.finished, res.finish_reason = now, ev.finish_reason
                    res.rejection, res.error = ev.rejection, ev.error

        try:
            results, t0, t1 = run_sync(drive(workload, send, self.name, progress))
        finally:
            if started_here:
                engine.stop()
        cfg = engine.config
        stats = engine.stats()
        info = {"max_batch_size": cfg.max_batch_size, "backend": cfg.backend,
                "policy": cfg.policy, "prefill_mode": cfg.prefill_mode,
                "prefix_caching": cfg.enable_prefix_caching,
                "engine_stats": {k: stats.get(k) for k in
                                 ("ticks", "tokens_generated", "prompt_tokens_computed",
                                  "kv_admit_blocked", "rejected", "last_error")}}
        return RunResult(self.name, results, t0, t1, info)

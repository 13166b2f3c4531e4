"""What a workload is replayed against (docs/benchmarks.md): minserve in process, or any
OpenAI-compatible server over streaming HTTP.

Every target has `run(workload, progress=True) -> RunResult`. Both targets here
use one asyncio driver: a coroutine per request sleeps until its scheduled
arrival (open loop) or until a slot frees (closed loop), submits, and stamps
each token the moment it reaches the client. The Hugging Face peers are in
hf.py.

In process, the engine runs in serving mode (`engine.start()`): its worker
thread ticks while this thread's event loop submits and awaits handles
(`async for ev in handle`), exactly as the HTTP server does, minus HTTP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
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


# ====================================================================== minserve in process
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


# ====================================================================== OpenAI-compatible HTTP
def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """One line of a server-sent-event stream -> the JSON of a `data:` line, "[DONE]",
    or None (blank lines, comments, other fields)."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    return json.loads(data) if data else None


def rejection_from_error(body: Any, status: int) -> dict[str, Any]:
    """An OpenAI-shaped error body -> a rejection dict naming the gate when the server
    says which (minserve does: error.gate, SPEC G6); otherwise 'HTTP <status>'."""
    err = body.get("error", body) if isinstance(body, dict) else {}
    err = err if isinstance(err, dict) else {"message": str(err)}
    return {"gate": err.get("gate") or f"HTTP {status}", "reason": err.get("code"),
            "message": err.get("message"), "numbers": err.get("numbers", {})}


class OpenAITarget:
    """Any OpenAI-compatible server (a running `minserve serve`, vLLM, ...), streaming.

    `api="completions"` sends the prompt as token ids (vLLM and minserve accept
    them), so the server does exactly the workload's work; `api="chat"` sends
    the prompt decoded to text as one user message (needs `tokenizer`; the
    server's chat template adds tokens). Each SSE chunk with text is one
    stamp; the token count comes from the final `usage` when the server sends
    it, else from the number of chunks. Each request's session goes in the body's
    `user`; `send_user=False` sends none, as most OpenAI clients do.
    """

    def __init__(self, base_url: str, model: str | None = None, api: str = "completions",
                 ignore_eos: bool = True, tokenizer=None, api_key: str | None = None,
                 timeout_s: float = 600.0, name: str | None = None,
                 send_user: bool = True) -> None:
        if api not in ("completions", "chat"):
            raise ValueError("api must be 'completions' or 'chat'")
        if api == "chat" and tokenizer is None:
            raise ValueError("api='chat' needs a tokenizer to turn the prompt ids into text")
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.model, self.api, self.ignore_eos = model, api, ignore_eos
        self.tokenizer, self.api_key, self.timeout_s = tokenizer, api_key, timeout_s
        self.name, self.send_user = name or base_url, send_user

    def payload(self, req: BenchRequest, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.send_user:
            body["user"] = req.session
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM / minserve extension: run to max_tokens
        if self.api == "completions":
            body["prompt"] = list(req.prompt_ids)
        else:
            text = self.tokenizer.decode(list(req.prompt_ids))
            body["messages"] = [{"role": "user", "content": text}]
        return body

    def run(self, workload: Workload, progress: bool = True) -> RunResult:
        return run_sync(self._run(workload, progress))

    async def _run(self, workload: Workload, progress: bool) -> RunResult:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), limits=limits,
                                     headers=headers) as client:
            model = self.model
            if model is None:  # the server's first model
                r = await client.get(f"{self.base_url}/models")
                r.raise_for_status()
                model = r.json()["data"][0]["id"]
            path = "/completions" if self.api == "completions" else "/chat/completions"

            async def send(req: BenchRequest, res: RequestResult) -> None:
                chunks = 0
                async with client.stream("POST", self.base_url + path,
                                         json=self.payload(req, model)) as resp:
                    if resp.status_code != 200:
                        raw = await resp.aread()
                        try:
                            body = json.loads(raw)
                        except ValueError:
                            body = {"error": {"message": raw.decode(errors="replace")}}
                        res.finished = time.perf_counter()
                        if resp.status_code == 429:
                            res.rejection = rejection_from_error(body, 429)
                        else:
                            res.error = f"HTTP {resp.status_code}: {body}"
                        return
                    async for line in resp.aiter_lines():
                        ev = parse_sse_line(line)
                        now = time.perf_counter()
                        if ev is None:
                            continue
                        if ev == "[DONE]":
                            break
                        if "error" in ev:  # an error after the stream started
                            res.error = str(ev["error"])
                            break
                        for ch in ev.get("choices") or []:
                            text = ch.get("text") if "text" in ch else \
                                (ch.get("delta") or {}).get("content")
                            if text:
                                res.token_times.append(now)
                                chunks += 1
                            if ch.get("finish_reason"):
                                res.finish_reason = ch["finish_reason"]
                        if ev.get("usage"):
                            res.output_len = int(ev["usage"].get("completion_tokens") or 0)
                res.finished = time.perf_counter()
                res.output_len = res.output_len or chunks

            results, t0, t1 = await drive(workload, send, self.name, progress)
        return RunResult(self.name, results, t0, t1, {"url": self.base_url, "model": model,
                                                      "api": self.api})

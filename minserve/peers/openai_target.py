"""Any OpenAI-compatible server as a target, over streaming HTTP (docs/outgrowing.md).

A running `minserve serve`, vLLM, `transformers serve`: the same seeded workload the
in-process engine gets (`minserve bench --url URL`, `make peers-bench`), replayed by the
bench's own driver (`bench.targets.drive`: a coroutine per request, each token stamped
the moment it reaches the client), so a figure taken over HTTP is taken as every other.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..bench.metrics import RequestResult
from ..bench.targets import RunResult, drive, run_sync
from ..bench.workload import BenchRequest, Workload


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

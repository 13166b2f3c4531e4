"""What the server sends back: OpenAI's response and stream-chunk shapes, plus timing.

One `ResponseShaper` per request knows its id, kind (chat or text completion)
and model name, and turns engine output into JSON dicts:

    non-stream   {"id", "object": "chat.completion" | "text_completion", "created", "model",
                  "choices": [{"index": 0, "message" | "text", "finish_reason"}],
                  "usage": {...}, "minserve": {...}}

    stream (SSE) data: {"object": "chat.completion.chunk", "choices": [{"delta": {"role": ..}}]}
                 data: {... "choices": [{"delta": {"content": "Hel"}}]}       one per text delta
                 data: {... "choices": [{"delta": {}, "finish_reason": "length"}], "minserve"}
                 data: {... "choices": [], "usage": {...}}      only with include_usage
                 data: [DONE]

The `minserve` extension object shows where one request's time went (seconds,
measured by the engine from the moment the request entered `pending`):

    queue_time            arrival -> admitted (time spent held by the gates or a full batch)
    ttft                  arrival -> first token streamed (queue + prefill)
    e2e                   arrival -> finished (evicted in T3)
    prefill_chunks        forward passes its prompt took (1 = monolithic, >1 = chunked, C1)
    cached_prompt_tokens  prompt tokens whose KV came from the prefix cache (K2)
    session, priority     what the fair policy saw (H2)
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..request import RequestOutput


def sse(data: dict[str, Any] | str) -> str:
    """One Server-Sent Event: a `data:` line and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


SSE_DONE = sse("[DONE]")


class ResponseShaper:
    """Builds the OpenAI-shaped dicts for one request (`kind` is "chat" or "completion")."""

    def __init__(self, kind: str, request_id: str, model: str, prompt_tokens: int,
                 session: str, priority: int) -> None:
        assert kind in ("chat", "completion"), kind
        self.kind, self.id, self.model = kind, request_id, model
        self.created = int(time.time())
        self.prompt_tokens, self.session, self.priority = prompt_tokens, session, priority

    # ---------------------------------------------------------------- pieces
    def usage(self, out: RequestOutput) -> dict[str, Any]:
        n = len(out.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def extension(self, out: RequestOutput) -> dict[str, Any]:
        t = out.timing
        return {"request_id": out.request_id, "session": self.session, "priority": self.priority,
                "queue_time": t.get("queue_time"), "ttft": t.get("ttft"), "e2e": t.get("e2e"),
                "prefill_chunks": t.get("prefill_chunks"),
                "cached_prompt_tokens": out.num_cached_tokens}

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---------------------------------------------------------------- non-stream
    def final_body(self, out: RequestOutput) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": None, "finish_reason": out.finish_reason}
            body = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None,
                      "finish_reason": out.finish_reason}
            body = self._envelope("text_completion")
        body.update(choices=[choice], usage=self.usage(out), minserve=self.extension(out))
        return body

    # ---------------------------------------------------------------- stream
    def chunk(self, text: str | None = None, finish_reason: str | None = None,
              role: bool = False, out: RequestOutput | None = None) -> dict[str, Any]:
        """One stream chunk: a text delta, the opening role (chat), or the finish."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None,
                      "finish_reason": finish_reason}
            body = self._envelope("text_completion")
        body["choices"] = [choice]
        if out is not None:
            body["minserve"] = self.extension(out)
        return body

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage`: no choices, just usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj)
        body.update(choices=[], usage=self.usage(out), minserve=self.extension(out))
        return body

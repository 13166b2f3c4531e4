"""The usage ledger books what the engine did for each tenant (SPEC H7, minserve/server/usage.py):
the tokens in each response, and the work done twice when a row was preempted."""

from __future__ import annotations

import json
import random
import socket
import threading

import httpx

from minserve import SamplingParams
from minserve.server.usage import refusal_reason

from .test_security import KEYS, key, shared
from .test_server import tiny_chat, wait_until

random.seed(0)
PROMPTS = [[random.randrange(1, 256) for _ in range(n)] for n in (9, 14, 5, 11, 7, 13)]


def test_each_tenants_tokens_preemptions_and_recomputed_tokens_add_up_to_the_engines():
    # six rows cannot all grow to the end within 90 tokens of KV: preemption must happen
    teacher = {**KEYS, "key-teacher-01": {"tenant": "teacher", "may_read_all_stats": True}}
    with shared(slow_decode_s=0.02, admission="preempt", backend="padded", kv_budget_tokens=90,
                max_batch_size=6, app_kw={"api_keys": teacher}) as (url, engine):
        answers = {}

        def send(i, who):
            answers[i] = (who, httpx.post(url + "/v1/completions", headers=key(who), timeout=60,
                                          json={"prompt": PROMPTS[i], "max_tokens": 14,
                                                "ignore_eos": True}).json())

        threads = [threading.Thread(target=send, args=(i, ("alice", "mallory")[i % 2]))
                   for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        def usage():
            return httpx.get(url + "/scheduler/stats", headers=key("teacher")).json()

        wait_until(lambda: sum(u["requests_finished"] for u in usage()["usage"]["tenants"]
                               .values()) == 6, what="the ledger to book all six")
        stats = usage()
    rows = stats["usage"]["tenants"]
    for who in ("alice", "mallory"):
        mine = [a["usage"] for w, a in answers.values() if w == who]
        assert rows[who]["prompt_tokens"] == sum(u["prompt_tokens"] for u in mine)
        assert rows[who]["output_tokens"] == sum(u["completion_tokens"] for u in mine) == 3 * 14
    assert stats["preemptions"] >= 1  # it really happened
    assert sum(r["preemptions"] for r in rows.values()) == stats["preemptions"]
    assert sum(r["recomputed_tokens"] for r in rows.values()) == stats["recomputed_tokens"] > 0


def test_each_refusal_has_one_reason():
    assert [refusal_reason(s, c) for s, c in (
        (429, "queue_full"), (429, "tokenizer_budget"), (400, "request_too_large"),
        (413, "body_too_large"), (403, "priority_not_granted"), (401, "invalid_api_key"),
        (400, "invalid_value"), (200, None), (503, "worker_dead"), (499, None))] == [
        "gate", "rate", "size", "size", "auth", "auth", "invalid", None, None, None]


# ============================================================ the ledger against the clients
TENANTS = {f"key-usage-t{i}-0001": {"tenant": f"t{i}"} for i in range(4)}


class StreamClient:
    """A raw HTTP/1.1 client that reads an SSE stream chunk by chunk and can hang up after
    any of them (it half-closes, as a killed client does, and reads what the server had
    sent until the server closes): it knows exactly what it received."""

    def __init__(self, url: str, key: str, body: dict) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        payload = json.dumps(body).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\n"
                          + f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}"
                            "\r\n\r\n".encode() + payload)
        self.buf, self.events, self.status = b"", [], None

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def _chunk(self) -> bytes | None:
        """The next piece of the chunked body, or None at its end (or the socket's)."""
        while b"\r\n" not in self.buf:
            if not self._fill():
                return None
        size, _, rest = self.buf.partition(b"\r\n")
        n = int(size, 16)
        while len(rest) < n + 2:
            if not self._fill():
                return None
            size, _, rest = self.buf.partition(b"\r\n")
        self.buf = rest[n + 2:]
        return rest[:n] if n else None

    def read(self, events: int | None = None) -> None:
        """Read the status, then SSE events: `events` more of them, or all."""
        if self.status is None:
            while b"\r\n\r\n" not in self.buf:
                assert self._fill()
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            self.status = int(head.split()[1])
        while events is None or events > 0:
            chunk = self._chunk()
            if chunk is None:
                return
            for line in chunk.decode().split("\n"):
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.events.append(json.loads(line[6:]))
                    events = None if events is None else events - 1

    def hang_up(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)
        self.read()  # what the server had sent before it noticed
        self.sock.close()

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if e.get("choices"))


def tokens_received(tokenizer, all_tokens: list[int], text: str) -> int:
    """How many of `all_tokens` a client holding `text` received: the fewest whose
    streamed text (character by character as the server releases it) is `text`."""
    from minserve.streaming import IncrementalDetokenizer

    detok, streamed = IncrementalDetokenizer(tokenizer), ""
    for n, t in enumerate([None, *all_tokens]):
        streamed += detok.add(t) if t is not None else ""
        if streamed == text:
            return n
    if streamed + detok.flush() == text:  # the stream's end releases what was held back
        return len(all_tokens)
    raise AssertionError(f"{text!r} is no streamed prefix of the output {streamed!r}")


def test_the_ledger_bills_what_each_client_received_under_cancels():
    """One tenant per request, so the ledger's rows are per request: a stream read to its
    end; streams whose client hangs up after 1 and after 5 chunks; a request whose client
    gives up before its first token. The ledger bills each the prompt it computed and the
    tokens its client received (to the token), books each cancel once and no refusal, and
    shows the tokens generated after a hang-up apart. Before: the early quitter billed its
    prompt and counted twice (cancelled + refused from the 499), the cut streams billed
    the tokens generated after the hang-up."""
    prompts = {f"t{i}": [7, 8, 9, 10 + i] for i in range(4)}
    teacher = {**TENANTS, "key-teacher-01": {"tenant": "teacher", "may_read_all_stats": True}}
    with shared(slow_decode_s=0.03, max_batch_size=2, app_kw={"api_keys": teacher}) as (
            url, engine):
        def body(t, stream=True):
            return {"prompt": prompts[t], "max_tokens": 40, "ignore_eos": True, "stream": stream,
                    "temperature": 0}

        keys = {v["tenant"]: k for k, v in TENANTS.items()}
        whole, cut = (StreamClient(url, keys[t], body(t)) for t in ("t0", "t1"))
        whole.read(1)
        cut.read(1)
        cut.hang_up()  # after one chunk
        late = StreamClient(url, keys["t2"], body("t2"))
        late.read(5)
        quitter = StreamClient(url, keys["t3"], body("t3", stream=False))
        wait_until(lambda: len(engine.scheduler.pending) == 1, what="t3 to wait")
        quitter.sock.close()  # gives up before its first token: nothing computed for it
        late.hang_up()  # after five chunks
        whole.read()

        def usage():
            return httpx.get(url + "/scheduler/stats",
                             headers={"Authorization": "Bearer key-teacher-01"}).json()["usage"]

        wait_until(lambda: sum(usage()["tenants"][t]["requests_finished"] for t in prompts) == 4,
                   what="the ledger to book all four")
        rows = usage()["tenants"]
        full = {t: engine.generate([p], SamplingParams(max_tokens=40, ignore_eos=True))[0]
                .token_ids for t, p in prompts.items()}  # greedy: what each would have got
    tok = tiny_chat()[1]
    for t, client in (("t0", whole), ("t1", cut), ("t2", late)):
        got = tokens_received(tok, full[t], client.text)
        assert (rows[t]["output_tokens"], rows[t]["prompt_tokens"]) == (got, 4), (t, rows[t])
    assert rows["t0"]["output_tokens"] == 40 and rows["t0"]["finish_reasons"] == {"length": 1}
    assert 1 <= rows["t1"]["output_tokens"] < rows["t2"]["output_tokens"] < 40
    assert rows["t3"]["prompt_tokens"] == rows["t3"]["output_tokens"] == 0
    for t in ("t1", "t2", "t3"):
        assert rows[t]["finish_reasons"] == {"cancelled": 1}, (t, rows[t])
    assert all(sum(rows[t]["refused"].values()) == 0 for t in prompts)
    assert rows["t0"]["output_tokens_not_delivered"] == 0
    assert rows["t1"]["output_tokens_not_delivered"] + rows["t1"]["output_tokens"] <= 40

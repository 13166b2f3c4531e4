"""The usage ledger books what the engine did for each tenant (SPEC H7, minserve/server/usage.py):
the tokens in each response, and the work done twice when a row was preempted."""

from __future__ import annotations

import random
import threading

import httpx

from minserve.server.usage import refusal_reason

from .test_security import KEYS, key, shared
from .test_server import wait_until

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
        (400, "invalid_value"), (200, None), (503, "worker_dead"))] == [
        "gate", "rate", "size", "size", "auth", "auth", "invalid", None, None]

"""Tokenizing is work charged to the tenant that asked (SPEC H7, minserve/server/tokenizing.py):
a prompt the text alone proves too long is refused before the tokenizer runs, the bound that
proves it is sound for the real tokenizer, the 400 says what to lower, and tokenizer time is
each tenant's budget."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve import Engine, EngineConfig
from minserve.server.api import create_app
from minserve.server.cli import BackgroundServer
from minserve.server.limits import ServerLimits
from minserve.server.tokenizing import PromptBound, TokenizerBudget

from .test_server import SMALL, tiny_chat

KEYS = {"key-alice-000001": {"tenant": "alice"}, "key-mallory-0001": {"tenant": "mallory"},
        "key-teacher-0001": {"tenant": "teacher", "may_read_all_stats": True}}


def auth(who):
    return {"Authorization": f"Bearer {next(k for k, v in KEYS.items() if v['tenant'] == who)}"}


@functools.lru_cache(maxsize=1)
def tokenizer():
    return tiny_chat()[1]


@functools.lru_cache(maxsize=1)
def embedded_bound() -> PromptBound:
    return PromptBound.for_tokenizer(tokenizer())  # reads the whole tokenizer.json: once


# ------------------------------------------------------------------ the bound is sound
PIECES = ["a", "word", " the", "Hello", "ünï", "日本語", "🙂", "1234567", "#" * 80, "=" * 33,
          " ", "  ", "\t", "\n", "\n" + " " * 80, "\r\n", "\xa0", "\u2028", "\u3000", "\x1c",
          "\x1f", ".", "...", "'s", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "-->"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), max_size=60))
def test_the_bound_never_exceeds_what_the_tokenizer_makes(parts):
    tok, text, bound = tokenizer(), "".join(parts), embedded_bound()
    assert bound.at_least(text)[0] <= len(tok(text)["input_ids"])
    chat = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert bound.at_least(rendered)[0] <= len(ids)


def test_every_whitespace_python_splits_at_the_pretokenizer_splits_at_too():
    """The word bound counts words with str.split; it is sound only if the pre-tokenizer
    never puts two of them in one piece. U+001C..U+001F are the exception (read as letters)."""
    pre = tokenizer().backend_tokenizer.pre_tokenizer
    spaces = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]
    for c in spaces:
        pieces = [p for p, _ in pre.pre_tokenize_str(f"a{c}b")]
        joined = [p for p in pieces if "a" in p and "b" in p]
        if c in "\x1c\x1d\x1e\x1f":
            assert len(pre.pre_tokenize_str(f".{c}.")) == 1  # one piece: why they are letters
        else:
            assert not joined, repr(c)


def test_the_bound_is_claimed_only_where_its_proof_holds():
    spec = json.loads(tokenizer().backend_tokenizer.to_str())
    spec["model"]["merges"] = []  # what the proofs read: the vocabulary, not the merges
    bound = embedded_bound()
    assert (bound.max_token_bytes, bound.words) == (81, True)  # "#" * 80 and "\n" + 80 spaces

    class Fake:
        def __init__(self, s):
            self.backend_tokenizer = type("B", (), {"to_str": lambda _: json.dumps(s)})()

    def variant(change):
        s = {**spec, "model": dict(spec["model"]),
             "added_tokens": [dict(a) for a in spec["added_tokens"]]}
        change(s)
        return PromptBound.for_tokenizer(Fake(s))

    assert variant(lambda s: s.update(normalizer={"type": "NFKC"})) is None  # may shrink text
    assert variant(lambda s: s.update(pre_tokenizer={"type": "Metaspace"})) is None
    assert variant(lambda s: s["model"].update(type="Unigram")) is None
    spaced = variant(lambda s: s["added_tokens"].append({**s["added_tokens"][0],
                                                         "content": "a b"}))
    assert spaced.words is False and spaced.max_token_bytes == 81
    strip = variant(lambda s: s["added_tokens"][0].update(lstrip=True))
    assert strip.words is True and strip.max_token_bytes is None
    assert variant(lambda s: (s["added_tokens"][0].update(rstrip=True), s["added_tokens"]
                              .append({**s["added_tokens"][1], "content": "x y"}))) is None


# ------------------------------------------------------------------ on the server
@pytest.fixture(scope="module")
def srv():
    model, tok = tiny_chat()
    engine = Engine(EngineConfig(**{**SMALL, "max_request_kv_share": 0.5}), model=model,
                    tokenizer=tok)  # one request: prompt + max_tokens <= 100 of 200
    limits = ServerLimits(tokenizer_burst_s=0.5, tokenizer_s_per_s=0.5)
    with BackgroundServer(create_app(engine, api_keys=KEYS, limits=limits)) as s:
        yield s.url, engine


def chat(url, who, content, **body):
    return httpx.post(url + "/v1/chat/completions", headers=auth(who), timeout=60,
                      json={"messages": [{"role": "user", "content": content}], **body})


def test_a_chat_its_text_proves_too_long_is_refused_before_tokenizing(srv, monkeypatch):
    url, engine = srv
    calls = []
    real = engine.encode
    monkeypatch.setattr(engine, "encode", lambda p: calls.append(p) or real(p))
    r = chat(url, "mallory", "The quick brown fox jumps over the lazy dog. " * 4400)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "request_too_large"
    assert err["param"] == "messages" and calls == []  # before: tokenized, then refused
    assert "at least 39,6" in err["message"] and "shorten the prompt" in err["message"]
    assert "max_tokens" not in err["message"].split("However")[1]  # nothing to lower there
    usage = httpx.get(url + "/scheduler/stats", headers=auth("teacher")).json()["usage"]
    assert usage["tenants"]["mallory"]["tokenizer_s"] > 0  # the render and the count: charged
    assert usage["tenants"]["mallory"]["refused"]["size"] >= 1


def test_the_400_says_what_to_lower_and_by_how_much(srv):
    url, engine = srv
    bound = PromptBound.for_tokenizer(engine.tokenizer)
    words = "word " * 60
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": words}],
                                                    tokenize=False, add_generation_prompt=True)
    n = bound.at_least(rendered)[0]
    r = chat(url, "alice", words, max_tokens=90)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert f"lower max_tokens to {100 - n} or less" in r.json()["error"]["message"]
    for prompt, asked, says, param in (
            ([1] * 120, 5, "shorten it to fewer than 100 tokens", "prompt"),  # before: "to 0"
            ([1] * 60, 50, "lower max_tokens to 40 or less", "max_tokens")):
        r = httpx.post(url + "/v1/completions", headers=auth("alice"), timeout=30,
                       json={"prompt": prompt, "max_tokens": asked})
        err = r.json()["error"]
        assert r.status_code == 400 and says in err["message"] and err["param"] == param


def test_tokenizer_time_is_each_tenants_own_budget():
    model, tok = tiny_chat()
    engine = Engine(EngineConfig(**SMALL), model=model, tokenizer=tok)
    limits = ServerLimits(tokenizer_burst_s=1e-6, tokenizer_s_per_s=1e-6)  # one prompt's worth
    with BackgroundServer(create_app(engine, api_keys=KEYS, limits=limits)) as s:
        assert chat(s.url, "mallory", "Hi there", max_tokens=1).status_code == 200
        r = chat(s.url, "mallory", "Hi again", max_tokens=1)
        assert r.status_code == 429 and r.json()["error"]["code"] == "tokenizer_budget"
        assert int(r.headers["retry-after"]) >= 1
        assert chat(s.url, "alice", "Hi there", max_tokens=1).status_code == 200  # hers is hers
        usage = httpx.get(s.url + "/scheduler/stats", headers=auth("teacher")).json()["usage"]
    assert usage["tenants"]["mallory"]["refused"]["rate"] == 1


def test_one_tenant_tokenizes_one_prompt_at_a_time_and_others_run_beside_it():
    async def main():
        budget, active, most = TokenizerBudget(10.0, 1e-9), {"m": 0, "a": 0}, {"m": 0, "all": 0}

        def work(tenant):
            active[tenant] += 1
            most["m"] = max(most["m"], active["m"])
            most["all"] = max(most["all"], sum(active.values()))
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.02:  # CPU time: what the budget is charged
                pass
            time.sleep(0.02)  # and room for the others to start meanwhile, if they may
            active[tenant] -= 1

        await asyncio.gather(*(budget.run(t, functools.partial(work, t))
                               for t in ("m", "m", "m", "a")))
        return most, budget.left("m")

    most, left = asyncio.run(main())
    assert most == {"m": 1, "all": 2}  # m's three one after another; a's beside them
    assert left <= 10.0 - 3 * 0.02  # and m was charged the CPU time of its three

"""Tokenizing a prompt is work, and it is charged to the tenant that asked for it (SPEC H7).

A chat of 199,000 characters was tokenized (about 0.2 s of CPU) and only then
refused as too long, charged to no one: twelve loops of it moved another student's
first token from 0.015 s to 1.3 s. Two things now stop that:

**Refused before tokenizing, when the text alone proves it.** `PromptBound` gives a
lower bound on a text's token count without running the tokenizer. A bound in
characters per token would be wrong: one token can stand for many characters (this
tokenizer has one for 80 `#`s, one for a newline and 80 spaces), so a text can hold
far fewer tokens than characters. What *is* sound, for a byte-level BPE tokenizer
(GPT-2's family: SmolLM2, Llama 3, Qwen) with no normalizer:

    words   GPT-2's pre-tokenizer splits text into pieces (` ?letters`, ` ?digits`,
            ` ?other`, whitespace); BPE merges never cross a piece, and a piece never
            holds two whitespace-separated words. So every word (a maximal run of
            non-whitespace) has at least one token of its own:  tokens >= words.
            Needs: no added token whose text holds whitespace.
    bytes   every token stands for at most L bytes (the longest entry of the vocabulary
            or of the added tokens; 81 here), and the tokens together spell the whole
            text:  tokens >= ceil(utf8_bytes / L).
            Needs: no added token that swallows the whitespace beside it (lstrip/rstrip).

Whitespace is Unicode's (what the pre-tokenizer's `\\s` matches); Python's `str.split`
also splits at U+001C..U+001F, which the pre-tokenizer does not, so those four are
read as letters before counting. A chat is rendered through its template first (a
template may drop or trim text, so the messages alone prove nothing) and bounded as
the text the tokenizer will see. For any other tokenizer (SentencePiece's Metaspace,
WordPiece, a normalizer that may shrink text) no bound is claimed and every prompt
is tokenized, then charged. tests/test_tokenizer_charge.py checks the bound against
the real tokenizer, and that each condition is what the proof needs.

**Tokenizer time is each tenant's budget.** `TokenizerBudget` gives each tenant a
bucket of CPU seconds (`tokenizer_burst_s`, refilled at `tokenizer_s_per_s`); a
tokenization is charged the CPU time its thread spent (the render, the bound and
the tokenizer), after it ran, refused or not. A tenant in debt gets 429 `rate`
(`tokenizer_budget`, with Retry-After) before its next prompt is touched, and one
tenant runs one tokenization at a time, so a dozen loops of one key use at most one
core, a quarter of the time. A budget rather than a charge to the fair counter:
the counter is the fair policy's alone (the default policy has none), it is in
virtual time that the other tenants' shares are computed from, and a charge there
delays only the tenant's *next admitted* request, while the CPU is spent at once,
on the event loop's side of the machine. The one tenant of a server without keys
is not throttled: there is nobody to be fair to.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

NOT_WHITESPACE_HERE = {c: "x" for c in (0x1C, 0x1D, 0x1E, 0x1F)}  # str.split splits, \s does not


class PromptBound:
    """A sound lower bound on how many tokens a text becomes (see the module docstring)."""

    def __init__(self, max_token_bytes: int | None, words: bool) -> None:
        assert max_token_bytes or words
        self.max_token_bytes, self.words = max_token_bytes, words

    @classmethod
    def for_tokenizer(cls, tokenizer) -> PromptBound | None:
        """The bound this tokenizer allows, or None when neither proof holds for it."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        spec = json.loads(backend.to_str())
        model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        byte_level = any(p.get("type") == "ByteLevel" for p in parts)
        if spec.get("normalizer") is not None or model.get("type") != "BPE" or not byte_level:
            return None
        added = spec.get("added_tokens") or []
        words = (pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
                 and not any(_has_space(a["content"]) for a in added))
        longest = None
        if not any(a.get("lstrip") or a.get("rstrip") for a in added):
            # a byte-level vocabulary spells each byte as one character
            longest = max([len(t) for t in model.get("vocab") or {}]
                          + [len(a["content"].encode("utf-8")) for a in added])
        return cls(longest, words) if longest or words else None

    def at_least(self, text: str) -> tuple[int, str]:
        """(n, why): the text is at least n tokens, because `why`."""
        best = (0, "")
        if self.max_token_bytes:
            size = len(text.encode("utf-8", "surrogatepass"))
            best = max(best, (-(-size // self.max_token_bytes),
                              f"{size:,} bytes, and no token of this model is longer than "
                              f"{self.max_token_bytes} bytes"))
        if self.words:
            if any(chr(c) in text for c in NOT_WHITESPACE_HERE):
                text = text.translate(NOT_WHITESPACE_HERE)
            n = len(text.split())
            best = max(best, (n, f"{n:,} words, and a token never spans two"))
        return best


def _has_space(text: str) -> bool:
    return any(c.isspace() for c in text.translate(NOT_WHITESPACE_HERE))


class TokenizerBudget:
    """Tokenizer CPU seconds per tenant: a bucket of `burst_s`, refilled at `per_s`."""

    def __init__(self, burst_s: float, per_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst_s, self.per_s, self.clock = burst_s, per_s, clock
        self._left: dict[str, tuple[float, float]] = {}  # tenant -> (seconds left, at)
        self._locks: dict[str, asyncio.Lock] = {}

    def left(self, tenant: str) -> float:
        seconds, at = self._left.get(tenant, (self.burst_s, self.clock()))
        now = self.clock()
        return min(self.burst_s, seconds + (now - at) * self.per_s)

    def retry_after(self, tenant: str) -> float | None:
        """Seconds until `tenant` may tokenize again; None: now."""
        left = self.left(tenant)
        return None if left > 0 else (-left) / self.per_s + 1e-3

    def charge(self, tenant: str, seconds: float) -> None:
        self._left[tenant] = (self.left(tenant) - seconds, self.clock())

    async def run(self, tenant: str | None, fn: Callable[[], Any],
                  on_charge: Callable[[float], None] | None = None) -> Any:
        """`fn()` in a worker thread (never on the event loop), one at a time per tenant,
        its thread's CPU time charged to the tenant even when it raises. `tenant` None:
        not metered (the one tenant of a server without keys)."""
        spent = [0.0]

        def timed():
            t0 = time.thread_time()
            try:
                return fn()
            finally:
                spent[0] = time.thread_time() - t0

        lock = self._locks.setdefault(tenant, asyncio.Lock()) if tenant else nullcontext()
        async with lock:
            try:
                return await asyncio.to_thread(timed)
            finally:
                if tenant:
                    self.charge(tenant, spent[0])
                if on_charge:
                    on_charge(spent[0])


def retry_seconds(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))

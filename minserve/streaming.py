"""Streaming: getting each token to its client the moment it is sampled.

The scheduler's tick thread *pushes* events into a `RequestHandle`; a client
*pulls* them, either blocking (`for ev in handle`) or from asyncio
(`async for ev in handle`), so the HTTP server's event loop never blocks on
the engine.

Text is detokenised incrementally. Byte-level BPE can split one character
over several tokens (an emoji is often 2–4 tokens); decoding token by token
would emit "\ufffd" garbage. So we decode a small window of recent tokens and
only release text once it no longer ends in an incomplete character (the
"prefix/read offset" method used by TGI and vLLM):

    ids:   ... [ prefix_offset ............ read_offset ... new ]
                 └── decoded before ──────┘ └─ only the new suffix is emitted ─┘

Stop strings (SamplingParams.stop) are matched on this text; while a request
runs, the last `len(longest stop) - 1` characters are held back, so a stop
string split over two tokens never leaks to the client.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class StreamEvent:
    """One push to a client: a new token (with the text it completed) or the end."""

    index: int  # position of token_id in the output; -1 for an event without a token
    token_id: int | None
    text: str  # text released by this event ("" while a character is incomplete)
    finish_reason: str | None = None  # set on the final event
    rejection: dict[str, Any] | None = None  # set when a gate refused the request (G6)
    error: str | None = None
    time: float = 0.0  # time.perf_counter() when the engine pushed it (for latency figures)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a character."""

    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all text decoded so far (up to any stop string)
        self.emitted = 0  # characters of self.text already released
        self.stop = list(stop or [])
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def add(self, token_id: int) -> str:
        """Feed one token; return the text that can be released now."""
        self.ids.append(token_id)
        if self.tokenizer is None or self.stopped:
            return ""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        for s in self.stop:  # a stop string ends the text right before it
            at = self.text.find(s)
            if at != -1:
                self.text, self.stopped = self.text[:at], True
        return self._release(final=self.stopped)

    def flush(self) -> str:
        """The request ended: release everything still held back."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        upto = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out


class Waker:
    """Wakes the event loops of async readers, at once or, from the thread that `hold`s
    it, batched: one call per loop when that thread calls `flush`.

    Why batch. Waking a loop from another thread (`call_soon_threadsafe`) writes to a
    socket, and that system call lets the loop's thread take the GIL: it then runs the
    token's way to its client (the SSE chunk, the write) while the engine's worker
    waits for the GIL back, a fraction of a millisecond per token, token after token
    (spans.py measured 1-2 % of a served token's time there). The serving worker holds
    its waker and flushes it between ticks, just before the next tick's forward: the
    loop's work then runs while the forward's C and PyTorch calls have released the
    GIL, in parallel, and a tick's several tokens for one loop cost one wake. A token
    reaches its reader no later than the end of the tick that produced it.
    """

    def __init__(self) -> None:
        self._holder: int | None = None  # the thread whose wakes wait for `flush`
        self._held: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}

    def hold(self) -> None:
        """From now on, this thread's wakes wait for its `flush` (other threads' do not)."""
        self._holder = threading.get_ident()

    def release(self) -> None:
        """Stop holding; send what was held."""
        self.flush()
        self._holder = None

    def wake(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        if self._holder == threading.get_ident():
            self._held.setdefault(loop, []).append(event)
        else:
            _call_in(loop, event.set)

    def flush(self) -> None:
        """Wake every loop that has held events: one call each."""
        held, self._held = self._held, {}
        for loop, events in held.items():
            _call_in(loop, lambda events=events: [e.set() for e in events])


def _call_in(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # that loop is closed; its reader is gone
        pass


class RequestHandle:
    """A client's end of one request: iterate it (sync or async) for StreamEvents.

    Thread-safety: `_push` is called from the engine's tick; readers may be any
    number of threads or event loops. Events are kept, so a late reader still
    sees everything from the first token.

    Step mode (no worker thread): a reader that runs out of events calls `drive`,
    which runs one engine tick, so `for ev in handle:` and `result()` finish on
    their own instead of waiting for ticks nobody will run.
    """

    def __init__(self, request_id: str, cancel_fn: Callable[[str], None] | None = None,
                 tokenizer=None, stop: list[str] | None = None,
                 drive: Callable[[], bool] | None = None, spans=None,
                 waker: Waker | None = None) -> None:
        self.request_id = request_id
        self.waker = waker or Waker()  # the engine's: its worker batches the wakes
        self.spans = spans  # a spans.Spans: each token's detokenise and push timed; None: off
        self._cancel_fn = cancel_fn
        self._drive = drive  # runs one tick in step mode; False when a worker ticks
        self.detok = IncrementalDetokenizer(tokenizer, stop)
        self._events: list[StreamEvent] = []
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.finished = False
        self.output = None  # RequestOutput, set with the final event

    # --- producer side (the engine) --------------------------------------------------
    def _push(self, ev: StreamEvent, output=None) -> None:
        ev.time = time.perf_counter()
        with self._cond:
            self._events.append(ev)
            if ev.finish_reason is not None:
                self.finished, self.output = True, output
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:  # wake async readers on their own loops
            self.waker.wake(loop, event)

    def _on_token(self, index: int, token_id: int) -> bool:
        """Stream one sampled token now; True when it completed a stop string."""
        start = time.perf_counter() if self.spans is not None else 0.0
        ev = StreamEvent(index, token_id, self.detok.add(token_id))
        self._push(ev)
        if self.spans is not None:  # where a served token's time goes (spans.py)
            self.spans.token_pushed(self.request_id, index, start, ev.time, time.perf_counter())
        return self.detok.stopped

    def _finish(self, output, finish_reason: str, rejection=None, error=None) -> None:
        """The final event: remaining held-back text and why the request ended."""
        self._push(StreamEvent(-1, None, self.detok.flush(), finish_reason, rejection, error),
                   output)

    @property
    def text(self) -> str:
        return self.detok.text

    # --- consumer side ----------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the engine to stop this request (evicted on the next tick; H3)."""
        if self._cancel_fn is not None and not self.finished:
            self._cancel_fn(self.request_id)

    def __iter__(self) -> Iterator[StreamEvent]:
        i = 0
        while True:
            with self._cond:
                ev = self._events[i] if i < len(self._events) else None
            if ev is None:
                if not (self._drive is not None and self._drive()):  # step mode: tick
                    with self._cond:  # serving mode: the worker's tick will notify
                        if i >= len(self._events):
                            self._cond.wait(timeout=0.5)
                continue
            i += 1
            yield ev
            if ev.finish_reason is not None:
                return

    def wait_for_worker(self) -> None:
        """Never tick from this handle's reader: a server's event loop must not run a
        forward (and must not spin on a dead worker's queue); it waits for the worker's
        ticks, and reports a dead worker itself."""
        self._drive = None

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, wake))
        try:
            i = 0
            while True:
                with self._cond:
                    ready = self._events[i:]
                    if not ready:
                        wake.clear()
                if not ready:
                    if self._drive is not None and self._drive():  # step mode: tick
                        continue
                    await wake.wait()
                    continue
                for ev in ready:
                    i += 1
                    yield ev
                    if ev.finish_reason is not None:
                        return
        finally:
            with self._cond:
                self._waiters.remove((loop, wake))

    def result(self, timeout: float | None = None):
        """Block until the request finishes; return its RequestOutput. In step mode this
        runs the ticks itself."""
        while not self.finished and self._drive is not None and self._drive():
            pass
        with self._cond:
            if not self._cond.wait_for(lambda: self.finished, timeout=timeout):
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
            return self.output

    @property
    def events(self) -> list[StreamEvent]:
        with self._cond:
            return list(self._events)

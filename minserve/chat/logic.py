"""The multi-user chat demo's logic (SPEC H4): everything `app.py` wires into Gradio.

`app.py` holds the page layout and the command line; this module holds what
the page *does*, with no Gradio import at the top, so it reads (and tests)
like the rest of the package:

* `ChatApp.chat`: one browser message -> `engine.submit(messages, ...)`
  under the browser's session id, streamed back token by token. The fair
  policy (P2) sees each browser session as one tenant.
* `friendly_refusal`: a gate's refusal (G1/G2/G3, on the handle's final
  event) -> a sentence a person can act on, naming the gate and its numbers (G6).
* `NoisyNeighbour`: a simulated heavy user who floods the engine from session
  "noisy-neighbour", bounded in count and time, stoppable.
* `TickWindow` + `LivePanel`: what the live scheduler panel draws, read from
  the tick records the worker already produces (SPEC T6), never from a lock
  held over the running engine.

    browser A ─┐                      ┌─ TickWindow (last tick + recent history)
    browser B ─┼─ ChatApp.chat ─ Engine (worker thread) ─┤
    flood     ─┘    (session ids)      └─ LivePanel ─ plotly figures, every ~1 s
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from typing import Any

from ..sampling import SamplingParams

# The demo's engine, over EngineConfig's defaults: fair sessions, a bounded queue, and
# a per-session row cap, so one heavy user (the flood) leaves 2 of the 8 batch rows to
# everybody else: a light user's message gets a row at the next tick instead of
# waiting for a flood reply to finish (docs/demo.md measures both).
# Chunked prefill as in `minserve serve` (SERVING_DEFAULTS): a long pasted prompt costs
# the other users one chunk per tick, not its whole prefill.
APP_DEFAULTS = {"policy": "fair", "max_queue_size": 64, "num_blocks": 256,
                "max_rows_per_session": 6, "prefill_chunk_size": 256}
# Under FCFS the demo shows what FCFS does (P1): whoever came first takes every row, so
# the flood holds the whole batch and a chat waits behind its backlog (docs/demo.md,
# step 4). The row cap is a fairness measure of the demo's fair engine; under FCFS it
# would leave rows free and hide the wait. A flag or variable still sets one.
FCFS_DEFAULTS = {"max_rows_per_session": None}


def app_defaults(policy: str) -> dict[str, Any]:
    """The demo's engine defaults under `policy`: APP_DEFAULTS, without the row cap
    under FCFS."""
    return {**APP_DEFAULTS, **(FCFS_DEFAULTS if policy == "fcfs" else {})}


FLOOD_DEFAULTS = {"total": 48, "in_flight": 24, "max_tokens": 128, "duration_s": 120.0}
NOISY_SESSION = "noisy-neighbour"
# The page's own marks are characters every common font has (DejaVu, Liberation, the
# Mac's and Windows' own): Debian's chromium has no emoji font, and drew ⚠️, ⏳ and ✋
# as empty boxes (tests/test_demo_steps_browser.py draws each against a missing glyph).
NOTICE = "‼ "  # starts every message the app (not the model) writes into the chat
WAITING = "○ "  # starts the bubble that says why a request waits (no token yet)
WAIT_POLL_S = 0.5  # how often a waiting chat re-reads why it waits (engine.explain)
STOPPED = "■ *stopped*"  # appended to a reply the user stopped
NOISY_PROMPTS = (
    "Write a very long, detailed essay about the history of the printing press.",
    "List one hundred facts about the ocean, one per line, with explanations.",
    "Tell me a long story about a lighthouse keeper, with many chapters.",
    "Explain, step by step and at length, how a compiler turns code into a program.",
)


# ------------------------------------------------------------------ refusals (G6)
def friendly_refusal(rejection: dict[str, Any]) -> str:
    """A gate's `Rejection.to_dict()` -> what the person in the chat reads.

    Whether to suggest a retry comes from the HTTP server's own rule
    (`minserve.server.errors.rejection_response`: only G1 is transient), so both front
    ends say the same thing; without the server extra we apply that rule here.
    """
    gate, n = rejection.get("gate"), rejection.get("numbers") or {}
    try:
        from ..server.errors import rejection_response

        retryable = bool(rejection_response(rejection)[1]["error"].get("retryable"))
    except ImportError:  # fastapi not installed: same rule, stated locally
        retryable = gate == "G1"
    if gate == "G1":
        text = (f"The server is busy: the waiting queue is full ({gate}: "
                f"{n.get('pending')}/{n.get('max_queue_size')} pending).")
    elif gate == "G2":
        text = (f"This message can never fit: prompt + max tokens need {n.get('need')} tokens "
                f"of KV cache, more than the whole budget of {n.get('kv_budget_tokens')} "
                f"({gate}). Lower 'max tokens' or clear the chat.")
    elif gate == "G3":
        text = (f"This conversation is too long for the KV cache: it needs "
                f"{n.get('prompt_blocks')} blocks and the pool has {n.get('num_blocks')} in all "
                f"({gate}). Clear the chat and send a shorter message.")
    else:
        text = f"The request was refused ({gate}: {rejection.get('message')})."
    return NOTICE + text + (" Try again in a moment." if retryable else "")


# ------------------------------------------------------------------ why a chat waits
# The holds that are a resource running out (a gate, or every batch row taken), by
# `Rejection.reason` (gates.py). Any other reason is a *share* rule (the session cap,
# a tenant's KV share, ...): one session or tenant holds its share while others
# wait. A share hold is the cause only while the batch has a free row; with every row
# taken the batch is full whatever the shares say (explain names the head's share
# hold first; this page names what the waiting user waits for).
RESOURCE_REASONS = {"batch_full", "kv_budget", "kv_budget_exceeded", "block_pool",
                    "prompt_exceeds_block_pool", "queue_full"}


def waiting_words(why: dict[str, Any], rows: dict[str, int] | None = None) -> str:
    """`engine.explain(rid)` of a pending or prefilling request -> why it has no token yet.

    Names the real cause: the batch is full (and whose rows fill it, from `rows`:
    session -> batch rows, the newest tick record), a gate's hold (G2, G3: its
    numbers), or a share rule (the session cap; a reason this page does not know is
    said with its own message), and how many requests are ahead under the policy."""
    if why.get("state") == "prefilling":
        return why["sentence"]
    if why.get("state") != "pending":
        return why.get("sentence", "")
    held = why.get("held_by")
    busy, size = why.get("rows", 0), why.get("max_batch_size", 0)
    full = bool(size) and busy >= size
    reason = held.get("reason") if held else None
    if held is None:
        cause = "nothing holds it: it is admitted at the next tick"
    elif reason == "batch_full" or (full and reason not in RESOURCE_REASONS):
        cause = f"the batch is full: {busy}/{size} rows are running"
        owners = sorted((rows or {}).items(), key=lambda kv: (-kv[1], kv[0]))
        if owners and len(owners) == 1:
            cause += f", all of them {owners[0][0]}'s"
        elif owners:
            cause += " (" + ", ".join(f"{s} {n}" for s, n in owners) + ")"
    elif reason == "session_cap":
        n = held.get("numbers") or {}
        cause = (f"the session cap: the head's session holds {n.get('session_rows')} rows, "
                 f"its cap (max_rows_per_session={n.get('max_rows_per_session')}); other "
                 "sessions go first")
    elif held.get("gate") in ("G2", "G3") and reason in RESOURCE_REASONS:
        n = held.get("numbers") or {}
        if held["gate"] == "G2":
            cause = (f"G2: {n.get('active_kv_reserved')} of {n.get('kv_budget_tokens')} KV "
                     f"tokens are reserved, the head needs {n.get('need')}")
        else:
            cause = (f"G3: {n.get('free_blocks')} free KV blocks, the head needs "
                     f"{n.get('blocks_needed')}")
    else:  # a rule this page does not know by name: its own words
        gate = held.get("gate")
        cause = f"{gate}: {held.get('message')}" if gate not in (None, "batch") \
            else str(held.get("message"))
    ahead = why.get("ahead", 0)
    where = ("you are next" if not ahead else
             f"{ahead} request{'s' if ahead != 1 else ''} ahead of you")
    return f"waiting, {where}; {cause}"


# ------------------------------------------------------------------ chat history
def text_of(content: Any) -> str:
    """A Gradio message's content (a string, or a list of parts) -> its text."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, (list, tuple)):
        return "".join(text_of(part) for part in content)
    return ""


def chat_messages(history: list[dict[str, Any]], keep: int) -> list[dict[str, str]]:
    """The chat as the model should see it: the last `keep` messages, starting with a user's.

    The app's own notices (refusals) are not model output: each is dropped with
    the user message it answered. A stopped reply stays, without its marker.
    """
    msgs: list[dict[str, str]] = []
    for m in history:
        text = text_of(m.get("content"))
        if m.get("role") == "assistant":
            if text.startswith(NOTICE):
                if msgs and msgs[-1]["role"] == "user":
                    msgs.pop()
                continue
            text = text.removesuffix(STOPPED).rstrip()
        msgs.append({"role": m.get("role", "user"), "content": text})
    msgs = msgs[-keep:]
    while msgs and msgs[0]["role"] != "user":
        msgs.pop(0)
    return msgs


# ------------------------------------------------------------------ per-session counters
@dataclasses.dataclass
class SessionCounters:
    """What one session got from the engine, as its users saw it (any policy)."""

    sent: int = 0
    finished: int = 0  # ended normally (stop / length)
    refused: int = 0  # a gate said no (G1/G2/G3): the sum of refused_by
    refused_by: dict[str, int] = dataclasses.field(default_factory=dict)  # gate -> refusals
    cancelled: int = 0
    tokens: int = 0  # output tokens received
    last_ttft: float | None = None  # seconds from submit to the first token


class SessionBook:
    """Per-session counters, written by chats and the flood, read by the panel.

    The panel's refusal counts all come from one `snapshot()`: the sessions table, the
    summary's "refused" (their sum, by gate) and the flood's line (its session's row), so
    that at any moment they read the same numbers (the engine's own `stats()["rejected"]`
    counts at submit, a moment before a chat or the flood hears of it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sessions: dict[str, SessionCounters] = {}
        self.closed: set[str] = set()  # tabs that went away: no row for them any more

    def sent(self, session: str) -> None:
        with self._lock:
            if session not in self.closed:
                self.sessions.setdefault(session, SessionCounters()).sent += 1

    def restart(self, session: str) -> None:
        """A new flood: its session's row starts again (the flood's line counts this flood)."""
        with self._lock:
            self.closed.discard(session)
            self.sessions[session] = SessionCounters()

    def close(self, session: str) -> None:
        """The session's tab closed: its row leaves the table (its requests were cancelled)."""
        with self._lock:
            self.closed.add(session)
            self.sessions.pop(session, None)

    def finished(self, session: str, output) -> None:
        """Account for a finished request from its `RequestOutput`."""
        with self._lock:
            if session in self.closed:
                return
            c = self.sessions.setdefault(session, SessionCounters())
            c.tokens += len(output.token_ids)
            if output.rejection is not None:
                c.refused += 1
                gate = output.rejection.get("gate", "?")
                c.refused_by[gate] = c.refused_by.get(gate, 0) + 1
            elif output.finish_reason == "cancelled":
                c.cancelled += 1
            else:
                c.finished += 1
            if output.timing.get("ttft") is not None:
                c.last_ttft = output.timing["ttft"]

    def snapshot(self) -> dict[str, SessionCounters]:
        with self._lock:
            return {s: dataclasses.replace(c, refused_by=dict(c.refused_by))
                    for s, c in self.sessions.items()}


# ------------------------------------------------------------------ the noisy neighbour
class NoisyNeighbour:
    """A simulated heavy user: keeps up to `in_flight` requests queued from one session.

    Bounded: it stops after `total` submissions or `duration_s` seconds, whichever
    comes first, or when `stop()` is called; then it cancels what it still has in
    flight, so the engine drains (R2). Under FCFS (P1) its backlog sits ahead of
    everyone who arrives later; under Fair/VTC (P2) its counter grows with every
    token it gets, and a light session goes first.
    """

    def __init__(self, engine, book: SessionBook, session: str = NOISY_SESSION) -> None:
        self.engine, self.book, self.session = engine, book, session
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.outstanding: list = []  # handles not finished yet
        self.counts = {"sent": 0, "done": 0, "refused": 0, "cancelled": 0}
        self.state, self.deadline, self.total = "idle", 0.0, 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, total: int = 48, in_flight: int = 16, max_tokens: int = 128,
              duration_s: float = 120.0) -> str:
        if self.running:
            return "the noisy neighbour is already flooding; stop it first"
        self._stop.clear()
        self.counts = dict.fromkeys(self.counts, 0)
        self.book.restart(self.session)
        self.total, self.deadline, self.state = int(total), time.monotonic() + duration_s, "flooding"
        self._thread = threading.Thread(target=self._run, args=(int(in_flight), int(max_tokens)),
                                        name="noisy-neighbour", daemon=True)
        self._thread.start()
        return self.describe()

    def stop(self, wait: float = 10.0) -> str:
        """Stop submitting, cancel what is in flight, wait (up to `wait` s) for it to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait)
        return self.describe()

    def _run(self, in_flight: int, max_tokens: int) -> None:
        while not self._stop.is_set() and time.monotonic() < self.deadline:
            self._collect()
            if self.counts["sent"] >= self.total and not self.outstanding:
                break
            if self.counts["sent"] < self.total and len(self.outstanding) < in_flight:
                i = self.counts["sent"]
                prompt = [{"role": "user", "content": NOISY_PROMPTS[i % len(NOISY_PROMPTS)]}]
                # Lengths 1/4, 2/4, 3/4, 4/4 of max_tokens: rows free up at staggered ticks,
                # as with real traffic, instead of the whole batch finishing at once.
                params = SamplingParams(max_tokens=max(1, max_tokens * (1 + i % 4) // 4),
                                        temperature=1.0, ignore_eos=True)
                handle = self.engine.submit(prompt, params, session_id=self.session)
                self.book.sent(self.session)
                with self._lock:
                    self.counts["sent"] += 1
                    self.outstanding.append(handle)
                if handle.finished:  # refused at once (G1): back off a little
                    self._stop.wait(0.25)
                continue
            self._stop.wait(0.02)
        for h in list(self.outstanding):
            h.cancel()
        end = time.monotonic() + 10
        while self.outstanding and time.monotonic() < end:
            self._collect()
            time.sleep(0.01)
        self.state = "stopped" if self._stop.is_set() else "done"

    def _collect(self) -> None:
        with self._lock:
            for h in [h for h in self.outstanding if h.finished]:
                self.outstanding.remove(h)
                out = h.output
                key = ("refused" if out.rejection else
                       "cancelled" if out.finish_reason == "cancelled" else "done")
                self.counts[key] += 1
                self.book.finished(self.session, out)

    def describe(self, row: SessionCounters | None = None) -> str:
        """The flood's line. Its counts are its session's row of the book (`row`, from the
        panel's snapshot, so the line and the table agree; else read now)."""
        if row is None:
            row = self.book.snapshot().get(self.session, SessionCounters())
        with self._lock:
            in_flight = len(self.outstanding)
        line = (f"**{self.state}** · sent {row.sent}/{self.total} · done {row.finished} · "
                f"in flight {in_flight} · refused {row.refused} · stopped {row.cancelled}")
        if self.running:
            line += f" · {max(0.0, self.deadline - time.monotonic()):.0f} s left"
        return line


# ------------------------------------------------------------------ what the panel reads
class TickWindow:
    """Set as `engine.trace`: the worker appends every TickRecord here (engine.step).

    Keeps the last record whole (queues, block map) and a short history without
    the per-tick block and backend snapshots (one dict per KV block each: too
    big to keep hundreds of), enough for the fairness figure.
    """

    def __init__(self, maxlen: int = 400) -> None:
        self.last = None
        self.history: deque = deque(maxlen=maxlen)

    def append(self, rec) -> None:  # called from the worker thread
        self.last = rec
        self.history.append(dataclasses.replace(rec, blocks=None, backend={}))

    def ticks(self) -> list:
        for _ in range(3):  # a copy while the worker appends; retried if it raced
            try:
                return list(self.history)
            except RuntimeError:
                continue
        return []

    def __len__(self) -> int:
        return len(self.history)

    def __getitem__(self, i):
        return self.history[i]


@dataclasses.dataclass
class Turn:
    """One message of one session, from Enter (`ChatApp.take`) to the end of its reply.

    It exists *before* the request is submitted, so a Stop pressed in between is not
    lost: before this, Stop looked only for submitted handles, and one pressed while the
    message was on its way (the page busy under the flood) answered "nothing to stop"
    while the reply then streamed to its end."""

    message: str
    started: bool = False  # its reply is being produced (`ChatApp.reply` took it)
    stop_requested: bool = False
    handle: Any = None  # the engine's handle, once submitted
    refused_enter: bool = False  # Enter was pressed again while this reply streamed
    since: float = dataclasses.field(default_factory=time.monotonic)


STALE_TURN_S = 30.0  # a taken turn whose reply never started (the tab went away) expires
BUSY = ("one reply at a time: a reply is still streaming, so your new message stays in "
        "the box; press Enter again when this reply ends, or Stop it first")


class ChatApp:
    """The engine, the per-session bookkeeping and the flood: one per app (not global).

    A message goes through two steps, so that the page can clear the box only for a
    message it accepted: `take` (Enter: accept it as the session's turn, or refuse it
    visibly while a reply streams: one reply at a time per session) and `reply` (stream
    the turn's reply). `chat` does both in one call: the `/chat` API."""

    def __init__(self, engine, history_messages: int = 12) -> None:
        self.engine = engine
        self.history_messages = history_messages
        self.book = SessionBook()
        self.noisy = NoisyNeighbour(engine, self.book)
        self.handles: dict[str, set] = {}  # session -> its handles still streaming
        self.turns: dict[str, Turn] = {}  # session -> its message taken and not yet answered
        self._lock = threading.Lock()
        if engine.trace is None:
            engine.trace = TickWindow()
        engine.start()  # serving mode: the worker thread ticks while there is work

    @staticmethod
    def session_of(request) -> str:
        """A browser session's fair-policy tenant id (P2): its Gradio session hash."""
        sh = getattr(request, "session_hash", None) if request is not None else None
        return f"user-{sh[:6]}" if sh else "user-anonymous"

    def take(self, message: str, request=None) -> tuple[bool, str]:
        """Enter: accept `message` as this session's turn -> (True, status), or refuse
        it -> (False, why): empty, or a reply of this session is still streaming."""
        session = self.session_of(request)
        message = (message or "").strip()
        if not message:
            return False, "Type a message first."
        with self._lock:
            turn = self.turns.get(session)
            if turn is not None and (turn.started or time.monotonic() - turn.since < STALE_TURN_S):
                turn.refused_enter = True
                return False, f"`{session}` · {BUSY}"
            self.turns[session] = Turn(message)
        return True, f"`{session}` · sending"

    async def chat(self, message: str, history: list, temperature: float, max_tokens: int,
                   request=None):
        """`take` and `reply` in one call (the `/chat` API). Yields (chat history, textbox
        value, status line); a refused message stays in the textbox value."""
        ok, status = self.take(message, request)
        if not ok:
            yield plain_history(history), message if (message or "").strip() else "", status
            return
        async for hist, status in self.reply(history, temperature, max_tokens, request):
            yield hist, "", status

    async def reply(self, history: list, temperature: float, max_tokens: int, request=None):
        """Stream the reply to the turn `take` accepted. Yields (chat history, status line);
        nothing when there is no turn waiting (the chain of a refused Enter)."""
        session = self.session_of(request)
        with self._lock:
            turn = self.turns.get(session)
            if turn is None or turn.started:
                return
            turn.started = True
        try:
            async for out in self._stream(turn, session, plain_history(history), temperature,
                                          max_tokens):
                yield out
        finally:
            with self._lock:
                if self.turns.get(session) is turn:
                    del self.turns[session]

    async def _stream(self, turn: Turn, session: str, history: list, temperature: float,
                      max_tokens: int):
        def status(text: str) -> str:
            note = f" · {BUSY}" if turn.refused_enter and not turn.stop_requested else ""
            return f"`{session}` · {text}{note}"

        history.append({"role": "user", "content": turn.message})
        if turn.stop_requested:  # Stop came before the message was sent: send nothing
            history.append({"role": "assistant", "content": STOPPED})
            yield history, status("stopped before it was sent")
            return
        prompt = chat_messages(history, self.history_messages)
        params = SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature))
        try:
            handle = self.engine.submit(prompt, params, session_id=session)
        except ValueError as e:  # too long for the model's context, bad settings
            history.append({"role": "assistant", "content": f"{NOTICE}I can't send that: {e}."})
            yield history, status("not sent")
            return
        handle.wait_for_worker()  # the page's event loop never runs a forward itself
        self.book.sent(session)
        with self._lock:
            self.handles.setdefault(session, set()).add(handle)
            turn.handle = handle
        if turn.stop_requested:  # Stop pressed while it was being submitted
            handle.cancel()
        history.append({"role": "assistant", "content": "…"})
        yield history, status(f"{handle.request_id} queued")
        reply = ""
        events = handle.__aiter__()
        nxt = None
        try:
            while True:
                nxt = nxt or asyncio.ensure_future(anext(events))
                # Until the first token, say every WAIT_POLL_S why it waits (the queue, the
                # gate and its numbers: engine.explain) instead of a spinner.
                done, _ = await asyncio.wait({nxt}, timeout=None if reply else WAIT_POLL_S)
                if not done:
                    why = await asyncio.to_thread(self.engine.explain, handle.request_id)
                    if why["state"] in ("pending", "prefilling") and not reply:
                        words = waiting_words(why, self.rows_by_session())
                        history[-1]["content"] = f"{WAITING}*{words}*"
                        yield history, status(f"{handle.request_id} {why['state']}")
                    continue
                try:
                    ev = nxt.result()
                except StopAsyncIteration:
                    break
                nxt = None
                reply += ev.text
                if ev.finish_reason is None:
                    if ev.text:
                        history[-1]["content"] = reply
                        yield history, status(f"{handle.request_id} streaming")
                    continue
                out = handle.output
                self.book.finished(session, out)
                if ev.rejection is not None:
                    history[-1]["content"] = friendly_refusal(ev.rejection)
                elif ev.error is not None:
                    history[-1]["content"] = f"{NOTICE}The engine failed: {ev.error}"
                elif ev.finish_reason == "cancelled":
                    history[-1]["content"] = (reply + "\n\n" + STOPPED).lstrip()
                else:
                    history[-1]["content"] = reply
                yield history, f"`{session}` · " + describe_output(out)
                break
        finally:  # also when the browser went away mid-stream: free the row (H3)
            handle.cancel()
            if nxt is not None:
                nxt.cancel()
                await asyncio.wait({nxt})  # let it unwind before closing what it iterates
            await events.aclose()
            with self._lock:
                self.handles.get(session, set()).discard(handle)

    def rows_by_session(self) -> dict[str, int]:
        """session -> batch rows (prefilling or active) in the newest tick record."""
        rec = getattr(self.engine.trace, "last", None)
        rows: dict[str, int] = {}
        if rec is not None:
            for rid in rec.queues.get("prefilling", []) + rec.queues.get("active", []):
                sess = rec.requests.get(rid, {}).get("session", "?")
                rows[sess] = rows.get(sess, 0) + 1
        return rows

    def cancel_session(self, session: str) -> list:
        """Cancel this session's requests: a queued one ends now, a running one is
        evicted at the next tick (T3); a turn not yet submitted will not be. Returns the
        handles it cancelled."""
        with self._lock:
            handles = list(self.handles.get(session, ()))
            turn = self.turns.get(session)
            if turn is not None:
                turn.stop_requested = True
        for h in handles:
            h.cancel()
        return handles

    async def stop(self, request=None, wait_s: float = 5.0) -> str:
        """The user's Stop button. Answers with the final state, not "stopping": the
        status line shows whichever of this answer and the chat's own last line comes
        last, and for a queued request the chat's comes first (its cancel is immediate)."""
        session = self.session_of(request)
        with self._lock:
            turn = self.turns.get(session)
        handles = self.cancel_session(session)
        if not handles and turn is None:
            return f"`{session}` · nothing to stop"
        end = time.monotonic() + wait_s

        def settled() -> bool:
            with self._lock:
                gone = turn is None or self.turns.get(session) is not turn
            return gone and all(h.finished for h in handles)

        while not settled() and time.monotonic() < end:
            await asyncio.sleep(0.02)  # a running row leaves at the next tick
        if turn is not None and turn.handle is not None and turn.handle not in handles:
            handles.append(turn.handle)
        if not handles:
            return f"`{session}` · stopped before it was sent"
        return f"`{session}` · " + " · ".join(
            describe_output(h.output) if h.finished else f"{h.request_id} stopping"
            for h in handles)

    def forget(self, request=None) -> None:
        """The tab closed: cancel what it left running, and drop its row from the
        sessions table once its requests have ended (closed tabs do not pile up)."""
        session = self.session_of(request)
        self.cancel_session(session)
        with self._lock:
            self.handles.pop(session, None)
            self.turns.pop(session, None)
        self.book.close(session)

    def close(self) -> None:
        self.noisy.stop()
        self.engine.stop()


def plain_history(history: list | None) -> list[dict[str, str]]:
    """Gradio's chat history (content as text or as a list of parts) -> plain messages."""
    return [{"role": m["role"], "content": text_of(m.get("content"))} for m in (history or [])]


def describe_output(out) -> str:
    """'req-7 · first token after 0.31 s · 64 tokens in 2.4 s · length' for the status
    line (or '... · stopped', 'req-7 · refused by G1')."""
    t = out.timing
    parts = [out.request_id]
    if out.rejection is not None:
        parts.append(f"refused by {out.rejection['gate']}")
    else:
        if t.get("ttft") is not None:
            parts.append(f"first token after {t['ttft']:.2f} s")
        if t.get("e2e") is not None:
            parts.append(f"{len(out.token_ids)} tokens in {t['e2e']:.1f} s")
        # the engine says "cancelled"; the person pressed Stop, and the bubble says "stopped"
        parts.append("stopped" if out.finish_reason == "cancelled" else out.finish_reason or "")
    return " · ".join(p for p in parts if p)

"""A stepper widget: drive one engine a phase or a tick at a time and watch it (ipywidgets).

    from minserve.inspection.stepper import Stepper
    s = Stepper(engine)              # the engine must be in step mode (no worker running)
    s.add_request("Hi!", session="alice")   # or the "add request" button
    s                                # shows buttons, the requests' text, figures (Jupyter)
    s.next_phase()                   # T1 admit_pending, then T2, T3, T4: figures redraw
    s.next_tick()                    # the rest of this tick (or a whole one)
    s.run(5)                         # five ticks
    s.reset()                        # a fresh engine (same config and model), the
                                     # opening requests queued again

Every button is also a method, so a notebook (and a test) can press it from
code. The figures are plotly `FigureWidget`s redrawn in place from records
(`trace.snapshot_record` while a tick is half done, the tick's `TickRecord`
after), never from private state. Beside them, a table shows every request's
text as it grows (`RequestHandle.text`).

Phases one at a time are exactly `Scheduler.step` cut in four: the same
public phase methods in the same order (T5); after the fourth the tick counter
moves on and the tick's record joins the trace.

What a notebook shows is panel.py's (`StepperPanel`, built when the stepper is first
displayed); this file is what the buttons do and what there is to show.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any

import plotly.graph_objects as go

from ..records import TickRecord
from ..sampling import SamplingParams
from . import viz
from .trace import TraceRecorder, describe_phase, describe_tick, snapshot_record, worker_words

PHASES = ("admit_pending", "advance_prefill_chunk", "evict_finished", "decode_step")
PHASE_LABELS = ("T1 admit", "T2 prefill", "T3 evict", "T4 decode")
FIGURES = {"queues": viz.queues, "batch": viz.batch, "kv_blocks": viz.kv_blocks,
           "timeline": viz.timeline, "fairness": viz.fairness}
WHOLE_TRACE = ("timeline", "fairness")  # drawn from the trace, not one record

# What "add request" sends when the engine has a tokenizer: real questions of very
# different lengths (so the padded batch shows padding), cycled in this order.
EXAMPLE_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about a queue of people waiting patiently for a bus on a rainy Monday "
    "morning, and explain in one sentence why the last line works.",
    "Say hi.",
    "List three things a server does when more requests arrive than it can handle.",
    "Translate 'good night' into Spanish.",
    "Explain to a ten-year-old, in two short sentences, why the sky looks blue during the "
    "day but red and orange when the sun sets in the evening.",
)


class Stepper:
    """Buttons (next phase, next tick, run N ticks, add a request, reset) over one engine.

    `figures`: which of "queues", "batch", "kv_blocks", "timeline", "fairness" to
    show, in this order. Requests added without a prompt get the next of
    `EXAMPLE_PROMPTS` when the engine has a tokenizer (sent through the chat
    template when `chat`), else random token ids of a varied length around
    `prompt_len` (seeded: the same clicks give the same run).
    """

    examples = EXAMPLE_PROMPTS

    def __init__(self, engine, figures=("timeline", "queues", "batch", "kv_blocks"), *,
                 prompt_len: int = 12, max_tokens: int = 8, seed: int = 0) -> None:
        unknown = set(figures) - set(FIGURES)
        if unknown:
            raise ValueError(f"unknown figures {sorted(unknown)}; choose from {sorted(FIGURES)}")
        self.figure_names = tuple(figures)
        self._default_prompt_len, self._default_max_tokens = prompt_len, max_tokens
        self._seed = seed
        self._opening: list[dict[str, Any]] = []  # requests added before the first tick
        self._panel = None  # the ipywidgets panel, once shown (panel.py)
        self._attach(engine)

    def _attach(self, engine) -> None:
        """Start watching `engine` from scratch (the constructor, and reset)."""
        self.engine = engine
        self.recorder = TraceRecorder(engine)
        self.phase = 0  # index of the next phase to run (0 = a tick starts)
        self._done: dict[str, Any] = {}  # phase records of the tick in progress
        self.last_phase: str | None = None  # label of the phase (or tick) just run
        self._rng = random.Random(self._seed)
        self._examples = 0  # next EXAMPLE_PROMPTS index
        self._arrived: list[str] = []  # submitted since the last T1 admit ran

    @property
    def tokenizer(self):
        return getattr(self.engine, "tokenizer", None)

    # --- the buttons, as methods -----------------------------------------------------------
    def next_phase(self):
        """Run the next phase of the current tick; return its record."""
        s = self.engine.scheduler
        name = PHASES[self.phase]
        rec = getattr(s, name)()
        self._done[name] = rec
        if self.phase == 0:
            self._arrived = []  # T1 has seen every request submitted so far
        self.last_phase = f"{PHASE_LABELS[self.phase]} ({name})"
        self.phase += 1
        if self.phase == len(PHASES):  # the tick is complete: count it, record it
            tick = s.end_tick(*(self._done[p] for p in PHASES))
            if self.engine.trace is not None:
                self.engine.trace.append(tick)
            self.phase, self._done = 0, {}
        self.refresh()
        return rec

    def next_tick(self) -> TickRecord:
        """Finish the tick in progress, or run one whole tick (`engine.step`)."""
        if self.phase == 0:
            rec = self.engine.step()
            self._arrived = []
        else:
            with self._quiet():  # no redraw for every phase
                while self.phase:
                    self.next_phase()
            rec = self.engine.trace[-1]
        self.last_phase = f"tick {rec.tick}"
        self.refresh()
        return rec

    @contextmanager
    def _quiet(self):
        """Inside it, `refresh` draws nothing: several steps, one redraw after."""
        panel, self._panel = self._panel, None
        try:
            yield
        finally:
            self._panel = panel

    def run(self, n: int = 5) -> list[TickRecord]:
        """Up to `n` ticks (stops early when the engine is idle); one redraw at the end."""
        recs = []
        with self._quiet():
            for _ in range(n):
                if self.phase == 0 and not self.engine.scheduler.has_work():
                    break
                recs.append(self.next_tick())
        self.refresh()
        return recs

    def next_prompt(self, chat: bool = False, prompt_len: int | None = None):
        """What "add request" sends when no prompt is given (see the class docstring)."""
        if self.tokenizer is not None:
            text = self.examples[self._examples % len(self.examples)]
            self._examples += 1
            return [{"role": "user", "content": text}] if chat else text
        n = prompt_len or self._default_prompt_len
        n = self._rng.randint(max(1, n // 3), 2 * n)  # varied lengths: the batch shows padding
        vocab = int(self.engine.model.config.vocab_size)
        return [self._rng.randrange(1, vocab) for _ in range(n)]

    def add_request(self, prompt=None, max_tokens: int | None = None, session: str = "default",
                    priority: int = 0, prompt_len: int | None = None, chat: bool = False):
        """Submit a request (`next_prompt()` when `prompt` is None); returns its handle."""
        if prompt is None:
            prompt = self.next_prompt(chat=chat, prompt_len=prompt_len)
        max_tokens = max_tokens or self._default_max_tokens
        if not self.engine.trace and self.phase == 0:  # the opening scenario: reset replays it
            self._opening.append({"prompt": prompt, "max_tokens": max_tokens,
                                  "session": session, "priority": priority})
        h = self.recorder.submit(prompt, SamplingParams(max_tokens=max_tokens),
                                 session_id=session, priority=priority)
        self.last_phase = f"submitted {h.request_id}"
        self._arrived.append(h.request_id)
        self.refresh()
        return h

    def reset(self, requeue: bool = True):
        """A fresh engine (same config, model and tokenizer), tick 0; with `requeue`, the
        requests added before the first tick are queued again. Returns the new engine."""
        old = self.engine
        engine = type(old)(old.config, model=old.model, tokenizer=old.tokenizer)
        opening, self._opening = self._opening, []
        with self._quiet():
            self._attach(engine)
            for r in opening if requeue else ():
                self.add_request(**r)
        self.last_phase = "reset: a fresh engine" + (
            f", {len(opening)} requests queued" if requeue and opening else "")
        self.refresh()
        return engine

    # --- what the figures show ---------------------------------------------------------------
    def view(self) -> TickRecord:
        """The record on screen: the tick so far when half-way, else the last tick."""
        if self.phase or self._arrived or not self.engine.trace:
            s = self.engine.scheduler
            return snapshot_record(self.engine, *(self._done.get(p) for p in PHASES),
                                   tick=s.tick_count + 1)
        return self.engine.trace[-1]

    def figures(self) -> dict[str, go.Figure]:
        """The figures for the current view (plain plotly Figures)."""
        rec, trace = self.view(), self.recorder.trace()
        if self.phase:
            trace.ticks.append(rec)  # the tick in progress shows on the timeline too
            where = f"after {PHASE_LABELS[self.phase - 1]}"
        else:
            where = "before the tick" if self._arrived or not trace.ticks else "after the tick"
        out = {}
        for name in self.figure_names:
            if name in WHOLE_TRACE:
                if not trace.ticks:
                    out[name] = viz.style.empty(f"{name}: no tick has run yet (press next phase)")
                else:
                    out[name] = FIGURES[name](trace)
            elif name == "kv_blocks" and rec.blocks is None:
                continue
            elif name == "queues":
                out[name] = viz.queues(rec, trace, title=f"tick {rec.tick}, {where}: the queues")
            else:
                out[name] = FIGURES[name](rec, trace)
        for fig in out.values():  # a FigureWidget does not autosize: a width that fits
            fig.update_layout(width=fig.layout.width or viz.style.MAX_WIDTH)
        return out

    def status(self) -> str:
        """Plain text: what just ran, and the tick so far (or the last tick). Under
        disaggregated prefill, T2's line names each transfer (blocks, bytes, ms, the
        worker's compute ms) and the promotion, and a last line says what is on the
        prefill worker now (`trace.worker_words`)."""
        head = f"last: {self.last_phase or '-'} · next: {PHASE_LABELS[self.phase]}"
        lines = [head]
        if self.phase:
            lines.append(f"tick {self.engine.scheduler.tick_count + 1} so far:")
            lines += ["  " + describe_phase(self._done[p]) for p in PHASES[:self.phase]]
        elif self.engine.trace:
            lines.append(describe_tick(self.engine.trace[-1]).replace(
                "tick ", "previous tick " if self._arrived else "tick ", 1))
        if self._arrived:  # never leave a new request beside "nothing waiting" unexplained
            lines.append(("waiting in pending for the next tick's T1 admit (they arrived after "
                          "this tick's T1 ran): " if self.phase else
                          "waiting in pending for T1 admit: ") + ", ".join(self._arrived))
        if self.engine.scheduler.remote is not None:  # disaggregated: the other process
            lines.append(worker_words(self.view().backend["prefill_worker"]))
        if self.phase == 0 and not self.engine.scheduler.has_work():
            lines.append("the engine is idle: add a request, or reset")
        share = self.shares()
        if share:
            lines.append(share)
        return "\n".join(lines)

    def shares(self) -> str:
        """One line per tenant (session) that wants rows, with shares on (SPEC H6): what it
        holds, its share now, how many rows it borrows (taken back, newest first, when one
        under its share waits) or whether its share holds it back. '' when
        shares are off or nobody wants anything."""
        table = self.engine.stats().get("shares") or {}
        if not table:
            return ""
        lines = [f"shares now ({len(table)} want rows and KV):"]
        for who, t in table.items():
            state = (f"borrowing {t.get('borrowed_rows', '')} rows: taken back when one under "
                     "its share waits" if t["borrowing"] else "within its share")
            if t["held_back"]:
                state += "; held back while one under its share waits"
            lines.append(f"  {who}: {t['rows']} rows of a {t['share_rows']:g}-row share, "
                         f"{t['kv']} of {t['share_kv']:g} KV tokens ({state})")
        return "\n".join(lines)

    def requests(self) -> list[dict[str, Any]]:
        """One row per request: id, session, state, prompt tokens, the output so far."""
        rows = []
        where = {rid: q for q, ids in self.view().queues.items() for rid in ids}
        for rid, h in self.recorder.handles.items():
            card = self.recorder.cards[rid]
            if h.finished:
                state = f"done ({h.output.finish_reason})"
            else:
                state = where.get(rid, "?")
            out = h.text if self.tokenizer is not None else " ".join(
                str(ev.token_id) for ev in h.events if ev.token_id is not None)
            rows.append({"id": rid, "session": card["session"], "state": state,
                         "prompt_tokens": card["prompt_len"], "max_tokens": card["max_tokens"],
                         "output_tokens": sum(1 for ev in h.events if ev.token_id is not None),
                         "text": out})
        return rows

    # --- the widget (panel.py draws it) -------------------------------------------------------
    @property
    def widget(self):
        """The ipywidgets box (built on first use: `panel.StepperPanel`)."""
        if self._panel is None:
            from .panel import StepperPanel

            self._panel = StepperPanel(self)
            self.refresh()
        return self._panel.box

    @property
    def _figs(self) -> dict[str, go.FigureWidget]:
        """The panel's figures, redrawn in place (none before it is shown)."""
        return self._panel.figs if self._panel is not None else {}

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def refresh(self) -> None:
        """Redraw the panel in place (a no-op before the widget is shown)."""
        if self._panel is not None:
            self._panel.refresh()

"""A stepper widget: drive one engine a phase or a tick at a time and watch it (ipywidgets).

    from minserve.inspection.stepper import Stepper
    s = Stepper(engine)              # the engine must be in step mode (no worker running)
    s.add_request(max_tokens=6)      # or the "add request" button
    s                                # shows buttons + figures (in Jupyter)
    s.next_phase()                   # T1 admit_pending, then T2, T3, T4: figures redraw
    s.next_tick()                    # the rest of this tick (or a whole one)
    s.run(5)                         # five ticks

Every button is also a method, so a notebook (and a test) can press it from
code. The figures are plotly `FigureWidget`s redrawn in place from records
(`trace.snapshot_record` while a tick is half done, the tick's `TickRecord`
after), never from private state.

Phases one at a time are exactly `Scheduler.step` cut in four: the same
public phase methods in the same order (T5); after the fourth the tick counter
moves on and the tick's record joins the trace.
"""

from __future__ import annotations

import random
from typing import Any

import plotly.graph_objects as go

from ..records import TickRecord
from ..sampling import SamplingParams
from . import viz
from .trace import TraceRecorder, describe_phase, describe_tick, snapshot_record

PHASES = ("admit_pending", "advance_prefill_chunk", "evict_finished", "decode_step")
PHASE_LABELS = ("T1 admit", "T2 prefill", "T3 evict", "T4 decode")
FIGURES = {"queues": viz.queues, "batch": viz.batch, "kv_blocks": viz.kv_blocks,
           "timeline": viz.timeline, "fairness": viz.fairness}
WHOLE_TRACE = ("timeline", "fairness")  # drawn from the trace, not one record


class Stepper:
    """Buttons (next phase, next tick, run N ticks, add a request) over one engine.

    `figures`: which of "queues", "batch", "kv_blocks", "timeline", "fairness"
    to show. Requests added without a prompt get `prompt_len` random token ids
    (seeded: the same clicks give the same run).
    """

    def __init__(self, engine, figures=("queues", "batch", "kv_blocks", "timeline"), *,
                 prompt_len: int = 12, max_tokens: int = 8, seed: int = 0) -> None:
        unknown = set(figures) - set(FIGURES)
        if unknown:
            raise ValueError(f"unknown figures {sorted(unknown)}; choose from {sorted(FIGURES)}")
        self.engine = engine
        self.recorder = TraceRecorder(engine)
        self.figure_names = tuple(figures)
        self.phase = 0  # index of the next phase to run (0 = a tick starts)
        self._done: dict[str, Any] = {}  # phase records of the tick in progress
        self.last_phase: str | None = None  # label of the phase (or tick) just run
        self._rng = random.Random(seed)
        self._default_prompt_len, self._default_max_tokens = prompt_len, max_tokens
        self._submitted = False  # a request arrived since the last tick: show "now"
        self._widget = None
        self._figs: dict[str, go.FigureWidget] = {}

    # --- the buttons, as methods -----------------------------------------------------------
    def next_phase(self):
        """Run the next phase of the current tick; return its record."""
        s = self.engine.scheduler
        name = PHASES[self.phase]
        rec = getattr(s, name)()
        self._done[name] = rec
        self.last_phase = f"{PHASE_LABELS[self.phase]} ({name})"
        self.phase += 1
        if self.phase == len(PHASES):  # the tick is complete: count it, record it
            tick = s.end_tick(*(self._done[p] for p in PHASES))
            if self.engine.trace is not None:
                self.engine.trace.append(tick)
            self.phase, self._done, self._submitted = 0, {}, False
        self.refresh()
        return rec

    def next_tick(self) -> TickRecord:
        """Finish the tick in progress, or run one whole tick (`engine.step`)."""
        if self.phase == 0:
            rec = self.engine.step()
            self._submitted = False
        else:
            while self.phase:
                self._next_phase_quiet()
            rec = self.engine.trace[-1]
        self.last_phase = f"tick {rec.tick}"
        self.refresh()
        return rec

    def _next_phase_quiet(self) -> None:
        widget, self._widget = self._widget, None  # no redraw for every phase
        try:
            self.next_phase()
        finally:
            self._widget = widget

    def run(self, n: int = 5) -> list[TickRecord]:
        """Up to `n` ticks (stops early when the engine is idle); one redraw at the end."""
        recs = []
        widget, self._widget = self._widget, None
        try:
            for _ in range(n):
                if self.phase == 0 and not self.engine.scheduler.has_work():
                    break
                recs.append(self.next_tick())
        finally:
            self._widget = widget
        self.refresh()
        return recs

    def add_request(self, prompt=None, max_tokens: int | None = None, session: str = "default",
                    priority: int = 0, prompt_len: int | None = None):
        """Submit a request (random token ids when `prompt` is None); returns its handle."""
        if prompt is None:
            n = prompt_len or self._default_prompt_len
            vocab = int(self.engine.model.config.vocab_size)
            prompt = [self._rng.randrange(1, vocab) for _ in range(n)]
        h = self.recorder.submit(prompt, SamplingParams(
            max_tokens=max_tokens or self._default_max_tokens), session_id=session,
            priority=priority)
        self.last_phase = f"submitted {h.request_id}"
        self._submitted = True
        self.refresh()
        return h

    # --- what the figures show ---------------------------------------------------------------
    def view(self) -> TickRecord:
        """The record on screen: the tick so far when half-way, else the last tick."""
        if self.phase or self._submitted or not self.engine.trace:
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
            where = "before the tick" if self._submitted or not trace.ticks else "after the tick"
        out = {}
        for name in self.figure_names:
            if name in WHOLE_TRACE:
                out[name] = FIGURES[name](trace)
            elif name == "kv_blocks" and rec.blocks is None:
                continue
            elif name == "queues":
                out[name] = viz.queues(rec, trace, title=f"tick {rec.tick}, {where}: the queues")
            else:
                out[name] = FIGURES[name](rec, trace)
        return out

    def status(self) -> str:
        """Plain text: what just ran, and the tick so far (or the last tick)."""
        head = f"last: {self.last_phase or '-'} · next: {PHASE_LABELS[self.phase]}"
        if self.phase:
            lines = [describe_phase(self._done[p]) for p in PHASES[:self.phase]]
            return head + "\n" + "\n".join(lines)
        if self.engine.trace:
            return head + "\n" + describe_tick(self.engine.trace[-1])
        return head

    # --- the widget ----------------------------------------------------------------------------
    @property
    def widget(self):
        """The ipywidgets box (built on first use)."""
        if self._widget is None:
            self._widget = self._build()
            self.refresh()
        return self._widget

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def refresh(self) -> None:
        """Redraw every figure in place (a no-op before the widget is shown)."""
        if self._widget is None:
            return
        self._status.value = f"<pre style='font-size:12px'>{_escape(self.status())}</pre>"
        for name, fig in self.figures().items():
            fw = self._figs.get(name)
            if fw is None:
                continue
            with fw.batch_update():
                fw.data = ()
                fw.add_traces(list(fig.data))
                fw.layout = fig.layout

    def _build(self):
        import ipywidgets as w

        b_phase = w.Button(description="next phase", icon="step-forward")
        b_tick = w.Button(description="next tick", icon="fast-forward")
        n_ticks = w.BoundedIntText(value=5, min=1, max=1000, description="N", layout={"width": "120px"})
        b_run = w.Button(description="run N ticks", icon="play")
        session = w.Text(value="alice", description="session", layout={"width": "180px"})
        plen = w.BoundedIntText(value=self._default_prompt_len, min=1, max=4096,
                                description="prompt len", layout={"width": "170px"})
        mtok = w.BoundedIntText(value=self._default_max_tokens, min=1, max=4096,
                                description="max_tokens", layout={"width": "170px"})
        b_add = w.Button(description="add request", icon="plus")
        b_phase.on_click(lambda _: self.next_phase())
        b_tick.on_click(lambda _: self.next_tick())
        b_run.on_click(lambda _: self.run(n_ticks.value))
        b_add.on_click(lambda _: self.add_request(max_tokens=mtok.value, session=session.value,
                                                  prompt_len=plen.value))
        self._status = w.HTML()
        self._figs = {name: go.FigureWidget(fig) for name, fig in self.figures().items()}
        return w.VBox([w.HBox([b_phase, b_tick, n_ticks, b_run]),
                       w.HBox([session, plen, mtok, b_add]), self._status,
                       *self._figs.values()])


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

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

The layout is compact on purpose: buttons, then what happened and the requests'
text side by side, then the figures with the timeline first, so a click and its
effect are on one screen.
"""

from __future__ import annotations

import html
import random
import re
from contextlib import contextmanager
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

    def __init__(self, engine, figures=("timeline", "queues", "batch", "kv_blocks"), *,
                 prompt_len: int = 12, max_tokens: int = 8, seed: int = 0) -> None:
        unknown = set(figures) - set(FIGURES)
        if unknown:
            raise ValueError(f"unknown figures {sorted(unknown)}; choose from {sorted(FIGURES)}")
        self.figure_names = tuple(figures)
        self._default_prompt_len, self._default_max_tokens = prompt_len, max_tokens
        self._seed = seed
        self._opening: list[dict[str, Any]] = []  # requests added before the first tick
        self._widget = None
        self._figs: dict[str, go.FigureWidget] = {}
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
        widget, self._widget = self._widget, None
        try:
            yield
        finally:
            self._widget = widget

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
            text = EXAMPLE_PROMPTS[self._examples % len(EXAMPLE_PROMPTS)]
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
        """Plain text: what just ran, and the tick so far (or the last tick)."""
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
        if self.phase == 0 and not self.engine.scheduler.has_work():
            lines.append("the engine is idle: add a request, or reset")
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
        self._status.value = ("<pre style='font-size:11px;line-height:1.35;margin:0;"
                              "white-space:pre-wrap;word-break:normal;overflow-wrap:break-word'>"
                              f"{html.escape(self.status())}</pre>")
        self._table.value = _requests_html(self.requests(), self.tokenizer is not None)
        if self.tokenizer is not None:
            nxt = EXAMPLE_PROMPTS[self._examples % len(EXAMPLE_PROMPTS)]
            if self._prompt.value in EXAMPLE_PROMPTS or not self._prompt.value:
                self._prompt.value = nxt
        for name, fig in self.figures().items():
            fw = self._figs.get(name)
            if fw is None:
                continue
            redraw(fw, fig)

    def _build(self):
        import ipywidgets as w

        small = {"width": "auto"}
        b_phase = w.Button(description="next phase", icon="step-forward", layout=small)
        b_tick = w.Button(description="next tick", icon="fast-forward", layout=small)
        n_ticks = w.BoundedIntText(value=5, min=1, max=1000, description="N",
                                   layout={"width": "110px"}, style={"description_width": "20px"})
        b_run = w.Button(description="run N ticks", icon="play", layout=small)
        b_reset = w.Button(description="reset (fresh engine)", icon="refresh", layout=small,
                           tooltip="a new engine with the same model; the opening requests again")
        session = w.Text(value="alice", description="session", layout={"width": "170px"},
                         style={"description_width": "55px"})
        mtok = w.BoundedIntText(value=self._default_max_tokens, min=1, max=4096,
                                description="max_tokens", layout={"width": "170px"},
                                style={"description_width": "initial"})
        b_add = w.Button(description="add request", icon="plus", layout=small,
                         button_style="info")
        has_tok = self.tokenizer is not None
        self._prompt = w.Text(value="", description="prompt", layout={"width": "360px"},
                              style={"description_width": "50px"},
                              placeholder="a question (the next example when empty)")
        chat = w.Checkbox(value=True, description="chat template", indent=False,
                          layout={"width": "120px"})
        plen = w.BoundedIntText(value=self._default_prompt_len, min=1, max=4096,
                                description="~prompt len", layout={"width": "170px"},
                                style={"description_width": "80px"})

        def add(_):
            text = self._prompt.value.strip() if has_tok else ""
            prompt = None
            if text:
                prompt = [{"role": "user", "content": text}] if chat.value else text
                if text in EXAMPLE_PROMPTS:
                    self._examples += 1
            self.add_request(prompt, max_tokens=mtok.value, session=session.value or "default",
                             prompt_len=plen.value, chat=chat.value)

        b_phase.on_click(lambda _: self.next_phase())
        b_tick.on_click(lambda _: self.next_tick())
        b_run.on_click(lambda _: self.run(n_ticks.value))
        b_reset.on_click(lambda _: self.reset())
        b_add.on_click(add)
        self._status = w.HTML(layout={"width": "50%"})
        self._table = w.HTML(layout={"width": "50%"})
        self._figs = {name: go.FigureWidget(fig) for name, fig in self.figures().items()}
        add_row = [self._prompt, chat] if has_tok else [plen]
        return w.VBox([
            w.HBox([b_phase, b_tick, n_ticks, b_run, b_reset]),
            w.HBox([*add_row, session, mtok, b_add]),
            w.HBox([self._status, self._table]),
            *self._figs.values()], layout={"max_width": "100%"})


def _requests_html(rows: list[dict[str, Any]], text: bool) -> str:
    """The requests as a small table; the session cell in the session's colour."""
    if not rows:
        return "<i>no requests yet: add one</i>"
    head = ("<tr><th>request</th><th>session</th><th>state</th><th>prompt</th>"
            f"<th>{'output so far' if text else 'output token ids'}</th></tr>")
    body = []
    for r in rows:
        color = viz.session_color(r["session"])
        out = html.escape(r["text"]) or "<i>-</i>"
        body.append(
            f"<tr><td>{r['id']}</td><td><span style='background:{color};color:white;"
            f"padding:0 4px;border-radius:3px'>{html.escape(r['session'])}</span></td>"
            f"<td>{html.escape(r['state'])}</td><td>{r['prompt_tokens']} tok</td>"
            f"<td style='max-width:330px'>{out} <span style='color:#888'>"
            f"({r['output_tokens']}/{r['max_tokens']})</span></td></tr>")
    return ("<div style='max-height:170px;overflow-y:auto;font-size:12px'>"
            "<table style='border-collapse:collapse' cellpadding='2'>"
            + head + "".join(body) + "</table></div>")


def redraw(fw: go.FigureWidget, fig: go.Figure) -> None:
    """Show `fig` in the widget `fw`, in place. A new layout reaches the browser as a
    relayout, which *merges*: what the old layout had and the new one lacks (the two
    subplot titles and second axes of a padded batch, when the batch empties) stayed,
    drawn over the empty figure's title. So those are emptied first, explicitly."""
    gone = set(fw.layout.to_plotly_json()) - set(fig.layout.to_plotly_json())
    resets = {key: [] for key in gone & {"annotations", "shapes", "images"}}
    resets |= {f"{key}.visible": False for key in gone if re.fullmatch(r"[xy]axis\d+", key)}
    if resets:
        fw.plotly_relayout(resets)
    with fw.batch_update():
        fw.data = ()
        fw.add_traces(list(fig.data))
        fw.layout = fig.layout

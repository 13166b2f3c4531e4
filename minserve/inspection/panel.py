"""The stepper's face in Jupyter: ipywidgets over a `Stepper` (stepper.py).

    Stepper(engine)          # in a notebook cell: shows StepperPanel(stepper).box

    [next phase] [next tick] [N] [run N ticks] [reset]        every button is a Stepper method
    [prompt ...] [chat template] [session] [max_tokens] [add request]
    status: what just ran, the tick so far   |  the requests, their text as it grows
    figures (timeline first), FigureWidgets redrawn in place

The stepper knows what happened (records, status, requests, figures); this file only
shows it. `refresh` re-reads all of it after every button, so the panel never holds
state of its own beyond the widgets.
"""

from __future__ import annotations

import html
import re
from typing import Any

import plotly.graph_objects as go

from . import viz


class StepperPanel:
    """The widgets of one `Stepper`: `box` (what a notebook shows) and `figs` (name ->
    FigureWidget, redrawn in place by `refresh`)."""

    def __init__(self, stepper) -> None:
        import ipywidgets as w

        self.stepper = st = stepper
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
        mtok = w.BoundedIntText(value=st._default_max_tokens, min=1, max=4096,
                                description="max_tokens", layout={"width": "170px"},
                                style={"description_width": "initial"})
        b_add = w.Button(description="add request", icon="plus", layout=small,
                         button_style="info")
        has_tok = st.tokenizer is not None
        self.prompt = w.Text(value="", description="prompt", layout={"width": "360px"},
                             style={"description_width": "50px"},
                             placeholder="a question (the next example when empty)")
        chat = w.Checkbox(value=True, description="chat template", indent=False,
                          layout={"width": "120px"})
        plen = w.BoundedIntText(value=st._default_prompt_len, min=1, max=4096,
                                description="~prompt len", layout={"width": "170px"},
                                style={"description_width": "80px"})

        def add(_):
            text = self.prompt.value.strip() if has_tok else ""
            prompt = None
            if text:
                prompt = [{"role": "user", "content": text}] if chat.value else text
                if text in st.examples:
                    st._examples += 1
            st.add_request(prompt, max_tokens=mtok.value, session=session.value or "default",
                           prompt_len=plen.value, chat=chat.value)

        b_phase.on_click(lambda _: st.next_phase())
        b_tick.on_click(lambda _: st.next_tick())
        b_run.on_click(lambda _: st.run(n_ticks.value))
        b_reset.on_click(lambda _: st.reset())
        b_add.on_click(add)
        self.status = w.HTML(layout={"width": "50%"})
        self.table = w.HTML(layout={"width": "50%"})
        self.figs = {name: go.FigureWidget(fig) for name, fig in st.figures().items()}
        add_row = [self.prompt, chat] if has_tok else [plen]
        self.box = w.VBox([
            w.HBox([b_phase, b_tick, n_ticks, b_run, b_reset]),
            w.HBox([*add_row, session, mtok, b_add]),
            w.HBox([self.status, self.table]),
            *self.figs.values()], layout={"max_width": "100%"})

    def refresh(self) -> None:
        """Show the stepper as it is now: status, requests, the next example prompt, and
        every figure redrawn in place."""
        st = self.stepper
        self.status.value = ("<pre style='font-size:11px;line-height:1.35;margin:0;"
                             "white-space:pre-wrap;word-break:normal;overflow-wrap:break-word'>"
                             f"{html.escape(st.status())}</pre>")
        self.table.value = requests_html(st.requests(), st.tokenizer is not None)
        if st.tokenizer is not None:
            nxt = st.examples[st._examples % len(st.examples)]
            if self.prompt.value in st.examples or not self.prompt.value:
                self.prompt.value = nxt
        for name, fig in st.figures().items():
            fw = self.figs.get(name)
            if fw is not None:
                redraw(fw, fig)


def requests_html(rows: list[dict[str, Any]], text: bool) -> str:
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

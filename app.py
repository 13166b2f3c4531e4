"""minserve's multi-user chat demo (SPEC H4): one Engine, many browsers, a live scheduler panel.

    python app.py                         # embedded SmolLM2, fair policy, http://127.0.0.1:7860
    python app.py --policy fcfs           # the same, first come first served: try the flood
    python app.py --max-queue-size 8 --port 7861 --backend paged

Every browser tab is one fair-policy session (its Gradio session hash). The
right-hand panel redraws about once a second from the tick records the worker
already produces: the queues, the KV block map, per-session service. The
"noisy neighbour" floods the engine from a simulated heavy session, so you can
watch the fair policy keep your own chat responsive (and FCFS not).

Flags, each also read from the environment (flag > environment > default):
the engine's knobs are `EngineConfig`'s fields (`--max-batch-size` /
`MINSERVE_MAX_BATCH_SIZE`, `--policy` / `MINSERVE_POLICY`, ...; see `python app.py --help`), as
in `minserve serve`; the app's own are `--host` / `MINSERVE_APP_HOST` (default
127.0.0.1: loopback only) and `--port` / `MINSERVE_APP_PORT` (default 7860).

The chat logic lives in `minserve/chat/logic.py`; this file is the page and the
command line. `build_app(engine)` returns the Gradio Blocks (tests use it with a
tiny model).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
from pathlib import Path

import gradio as gr

from minserve.chat.logic import APP_DEFAULTS, FLOOD_DEFAULTS, NOISY_SESSION, ChatApp, app_defaults
from minserve.config import EngineConfig
from minserve.inspection import viz
from minserve.inspection.trace import Trace, engine_config
from minserve.inspection.viz.queues import COLUMNS
from minserve.server.cli import (
    add_engine_arguments,
    add_threads_argument,
    apply_threads,
    engine_config_from_args,
    port_problem,
)

POLICY_LINES = {
    "fair": "**Fair (VTC)**: each browser session is a tenant; the session served least goes "
            "next (P2). A flood from one session cannot push you back.",
    "fcfs": "**FCFS**: first come, first served (P1). A flood queued before you runs before you; "
            "restart with `--policy fair` to compare.",
}
# Requirement ids the page shows (policy line, queue cards, summary, refusals, fairness
# titles). Their legend is read from the repository's own design account, docs/spec.md.
PAGE_IDS = ("Q1", "Q2", "Q3", "P1", "P2", "P4", "G1", "G2", "G3", "G4", "R1")
SPEC_DOC = Path(__file__).resolve().parent / "docs" / "spec.md"
TABLE_NOTE = (
    "**wait**: requests queued · **run**: batch rows (prefilling or decoding) · **tokens**: "
    "replies still streaming included · **stopped**: ended by Stop or a closed tab · "
    "**VTC**: the fair policy's counter of weighted tokens served (P2): the least-served "
    "waiting session goes next. A counter **jumps** when its session sends after having "
    "nothing waiting (a new tab's first message): the *arrival lift* (P4) raises it to the "
    "least-served waiting session's counter (or the last-served one's), so idle time is "
    "not banked as credit.")


def spec_legend(ids=PAGE_IDS, doc: Path = SPEC_DOC) -> str:
    """'**G1** Queue capacity, checked at submit: ...' for each id: the first sentence of
    its entry in docs/spec.md (one source of truth for what an id means)."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else ""
    lines = []
    for rid in ids:
        entry = text.partition(f"\n**{rid}** ")[2].split("\n- ")[0].split("\n\n")[0]
        entry = " ".join(entry.split())
        first = entry.split(". ")[0].rstrip(".") + "." if entry else "see docs/spec.md."
        lines.append(f"- **{rid}** {first}")
    return ("Ids such as R1 name a rule of the design; `docs/spec.md` in the repository "
            "says where each is built and tested.\n\n" + "\n".join(lines))


def waiting_figure(name: str):
    """What a panel tab shows before the engine's first tick: a sentence, not an empty box."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_annotation(text=f"{name}: no tick yet.<br>Send a message or start the flood; "
                            "the panel redraws about once a second.",
                       showarrow=False, font={"size": 14}, x=0.5, y=0.5, xref="paper",
                       yref="paper")
    fig.update_layout(height=260, xaxis={"visible": False}, yaxis={"visible": False},
                      plot_bgcolor="rgba(0,0,0,0)", paper_bgcolor="rgba(0,0,0,0)",
                      margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


THEME = gr.themes.Soft(font=["ui-sans-serif", "system-ui", "sans-serif"],  # no web fonts:
                       font_mono=["ui-monospace", "monospace"])  # the demo works offline


# ------------------------------------------------------------------ the live panel
SHORT_LABELS = {"pending": "Q1 pending", "prefilling": "Q2 prefill", "active": "Q3 active"}
# Read on a projector at 1280x720 (tests/test_demo_steps_browser.py measures it): three
# queue columns (the requests that left go into the title), cards' text at 13 px and at
# most CARD_CHARS characters a line, so that no line runs past its card.
CARD_FONT_PX, CARD_CHARS = 13, 22
SUBPLOT_TITLE_PX = 14  # the Fairness tab's subplot titles (they were 11 px)


def queues_figure(rec, trace, max_cards: int = 4):
    """`viz.queues`, with each queue cut to its first `max_cards` cards (a flood is long),
    narrow cards of large text, and headers that say the true lengths."""
    shown = dataclasses.replace(rec, queues={q: ids[:max_cards] for q, ids in rec.queues.items()})
    left = len(rec.evict.evicted) + len(rec.admit.rejected) + len(rec.admit.cancelled)
    fig = viz.queues(shown, title=f"tick {rec.tick}: the queues (first {max_cards} of each)"
                                  f" · {left} left this tick",
                     columns=tuple(SHORT_LABELS), font_size=CARD_FONT_PX, wrap=CARD_CHARS)
    counts = {q: len(ids) for q, ids in rec.queues.items()}
    for ann in fig.layout.annotations:
        for q, label in COLUMNS:
            if q in SHORT_LABELS and ann.text.startswith(f"<b>{label}</b>"):
                ann.update(text=f"<b>{SHORT_LABELS[q]}</b> ({counts.get(q, 0)})")
    # Less room above the column headers, at the same scale: two rows of cards on the
    # first screen of a 1280x720 projector (tests/test_demo_steps_browser.py).
    (low, high), margin = fig.layout.yaxis.range, fig.layout.margin
    px_per_unit = (fig.layout.height - margin.t - margin.b) / (high - low)
    top, t = 0.45, 40
    fig.update_layout(margin={"l": 10, "r": 10, "t": t}, yaxis={"range": [low, top]},
                      height=int(t + margin.b + px_per_unit * (top - low)))
    return fig


def fairness_figure(rec, trace):
    """`viz.fairness` over the last few hundred ticks, its legend moved below (narrow column)."""
    fig = viz.fairness(trace, title=f"service per session, last {len(trace)} ticks · policy "
                                    f"{trace.config.get('policy')}")
    fig.update_layout(height=500, legend={"orientation": "h", "y": -0.18, "x": 0})
    # the subplot titles: 14 px, readable on a projector; each still on one line inside the
    # figure at 1280x720 (tests/test_demo_steps_browser.py measures both)
    fig.update_annotations(font_size=SUBPLOT_TITLE_PX)
    return fig


# The panel's figures, one tab each: (last TickRecord, recent Trace) -> plotly figure.
# Swapping in another figure is one line here.
PANEL_FIGURES = {
    "Queues": queues_figure,
    "KV blocks": lambda rec, trace: viz.kv_blocks(rec, trace, columns=32),
    "Fairness": fairness_figure,
}
TABLE_HEADERS = ["session", "wait", "run", "done", "tokens", "refused", "stopped", "TTFT s",
                 "VTC"]  # short: nine columns share half a 1440 px window (TABLE_NOTE says more)


class LivePanel:
    """The panel, shared by every open browser: rebuilt at most once per `ttl` seconds, and
    only when what it shows moved (the engine's stats, the sessions' book, the flood's
    state). A browser that already shows the newest figures gets `gr.skip()` for them: no
    redraw while idle, and hover boxes stay put.

    One snapshot makes one panel: the summary, the sessions table and the flood's line are
    built from the same book snapshot, so a refusal count reads the same in all three
    (the table's column, its sum by gate in the summary, the flood's row in its line)."""

    def __init__(self, app: ChatApp, ttl: float = 0.8) -> None:
        self.app, self.ttl = app, ttl
        self._lock = threading.Lock()  # Gradio calls render from several threads at once
        self._built_at, self._stats, self._parts, self.version = 0.0, None, None, 0
        self._seen: dict[str, int] = {}  # session -> version of the figures it shows

    def render(self, session: str) -> tuple:
        """(summary, session table, *figures, raw stats, flood status) for one browser."""
        with self._lock:
            if self._parts is None or time.monotonic() - self._built_at > self.ttl:
                engine = self.app.engine
                with engine.scheduler.lock:  # between two ticks: the stats and the record agree
                    s, rec = engine.stats(), last_record(engine.trace)
                book, noisy = self.app.book.snapshot(), self.app.noisy
                seen = (s, book, noisy.state, noisy.running)
                if seen != self._stats or self._parts is None:
                    self._stats, self._parts = seen, self._build(s, rec, book)
                    self.version += 1
                self._built_at = time.monotonic()
            summary, rows, figs, flood = self._parts
            stats, fresh = self._stats[0], self._seen.get(session) != self.version
            self._seen[session] = self.version
        rows = [[r[0] + (" (you)" if r[0] == session else ""), *r[1:]] for r in rows]
        figs = figs if fresh else [gr.skip()] * len(figs)
        return (summary, rows, *figs, stats, flood)

    def forget(self, session: str) -> None:
        with self._lock:
            self._seen.pop(session, None)

    def _build(self, s: dict, rec, book: dict) -> tuple:
        engine = self.app.engine
        window = engine.trace
        ticks = window.ticks() if hasattr(window, "ticks") else list(window)
        trace = Trace(config=engine_config(engine), ticks=ticks)
        figs = [f(rec, trace) if rec is not None else waiting_figure(name)
                for name, f in PANEL_FIGURES.items()]
        for fig in figs:
            if fig is not None:  # the viz figures are 1000 px wide: fit the column instead
                fig.update_layout(width=None, autosize=True)
        flood = self.app.noisy.describe(book.get(NOISY_SESSION))
        return summary_line(s, book), session_rows(s, rec, book), figs, flood


def last_record(window):
    """The newest TickRecord from a `TickWindow` (or a plain list, if someone set one)."""
    return getattr(window, "last", None) or (window[-1] if len(window) else None)


def summary_line(s: dict, book: dict | None = None) -> str:
    """The engine's stats in a line; its refusals are the sessions table's, summed by gate
    (`book`, the same snapshot as the table: one count on the page), else the engine's."""
    q, b = s["queues"], s.get("blocks", {})
    held = ", ".join(f"{g} {n}" for g, n in s["kv_admit_blocked"].items() if n) or "none"
    by_gate = dict(s["rejected"]) if book is None else {}
    for c in (book or {}).values():
        for gate, n in c.refused_by.items():
            by_gate[gate] = by_gate.get(gate, 0) + n
    refused = ", ".join(f"{g} {n}" for g, n in sorted(by_gate.items()) if n) or "none"
    return (f"**tick {s['ticks']}** · pending **{q['pending']}**/{s['max_queue_size']} · "
            f"prefilling **{q['prefilling']}** · active **{q['active']}**/{s['max_batch_size']}"
            f" · KV pressure **{s['kv_pressure']:.0%}** ({b.get('used', '?')}/"
            f"{b.get('num_blocks', '?')} blocks) · reserved **{s['active_kv_reserved']}**/"
            f"{s['kv_budget_tokens']} tokens (R1)  \ngate holds: {held} · refused: {refused} · "
            f"tokens generated {s['tokens_generated']}"
            + (f" · **worker error**: {s['last_error'].splitlines()[-1]}" if s["last_error"] else ""))


def session_rows(s: dict, rec, book: dict) -> list[list]:
    """One row per session: where its requests are now and what it has received."""
    where: dict[str, list[int]] = {}
    if rec is not None:
        for i, q in enumerate(("pending", "prefilling", "active")):
            for rid in rec.queues.get(q, []):
                sess = rec.requests.get(rid, {}).get("session", "?")
                where.setdefault(sess, [0, 0])[min(i, 1)] += 1
    counters = s["policy"].get("counters", {})
    streaming: dict[str, int] = {}  # tokens of replies still running: the book counts a
    if rec is not None:             # reply when it ends, the table shows it as it grows
        for rid in rec.queues.get("prefilling", []) + rec.queues.get("active", []):
            card = rec.requests.get(rid, {})
            sess = card.get("session", "?")
            streaming[sess] = streaming.get(sess, 0) + int(card.get("output_len", 0))
    rows = []
    for sess in sorted(set(book) | set(where), key=lambda x: (x == NOISY_SESSION, x)):
        c, (waiting, running) = book.get(sess), where.get(sess, [0, 0])
        ttft = c.last_ttft if c else None
        tokens = (c.tokens if c else 0) + streaming.get(sess, 0)
        rows.append([sess, waiting, running, c.finished if c else 0, tokens,
                     c.refused if c else 0, c.cancelled if c else 0,
                     "" if ttft is None else round(ttft, 2),
                     round(counters[sess]) if sess in counters else "—"])
    return rows or [["(no sessions yet)", 0, 0, 0, 0, 0, 0, "", "—"]]


# ------------------------------------------------------------------ the page
def build_app(engine, *, history_messages: int = 12, panel_interval: float = 1.0) -> gr.Blocks:
    """The Gradio page over `engine` (started here, in serving mode). `demo.chat_app.close()`
    stops the flood and the engine."""
    app = ChatApp(engine, history_messages)
    panel = LivePanel(app)
    policy = engine.config.policy

    async def chat(message, history, temperature, max_tokens, request: gr.Request):
        async for out in app.chat(message, history, temperature, max_tokens, request):
            yield out

    def take(message, request: gr.Request):
        """Enter / Send: clear the box only for a message accepted; a refused one stays
        in it, and the status line and a toast say why (never dropped silently)."""
        ok, status = app.take(message, request)
        if ok:
            return "", status
        if (message or "").strip():
            gr.Warning(status.split(" · ", 1)[-1])
        return gr.skip(), status

    async def reply(history, temperature, max_tokens, request: gr.Request):
        async for out in app.reply(history, temperature, max_tokens, request):
            yield out

    async def stop(request: gr.Request):
        return await app.stop(request)

    def refresh(request: gr.Request):
        return panel.render(app.session_of(request))

    def forget(request: gr.Request):
        app.forget(request)
        panel.forget(app.session_of(request))

    def flood(total, in_flight, max_tokens, duration):
        return app.noisy.start(int(total), int(in_flight), int(max_tokens), float(duration))

    with gr.Blocks(title="minserve chat", analytics_enabled=False) as demo:
        gr.Markdown(f"## minserve chat · {Path(str(engine.model_name)).name} · policy "
                    f"`{policy}`  \n"
                    f"{POLICY_LINES[policy]} Open a second tab to be a second user.")
        with gr.Row(equal_height=False):
            with gr.Column(scale=5, min_width=360):
                chatbot = gr.Chatbot(show_label=False, height=430, buttons=["copy"],
                                     feedback_options=None, elem_id="chat")
                with gr.Row():
                    msg = gr.Textbox(placeholder="Say something and press Enter", lines=1,
                                     show_label=False, scale=5, elem_id="msg", autofocus=True)
                    send = gr.Button("Send", variant="primary", scale=1, min_width=70)
                    stop_btn = gr.Button("Stop", variant="stop", scale=1, min_width=70)
                status = gr.Markdown(elem_id="status")
                with gr.Row():
                    temperature = gr.Slider(0.0, 1.5, value=0.3, step=0.05,
                                            label="temperature (0 = greedy)")
                    max_tokens = gr.Slider(8, 512, value=128, step=8, label="max tokens")
                clear = gr.Button("Clear chat", size="sm")
                with gr.Accordion("Noisy neighbour: flood the engine from another session",
                                  open=True):
                    with gr.Row():
                        n_total = gr.Slider(1, 256, value=FLOOD_DEFAULTS["total"], step=1, label="requests")
                        n_flight = gr.Slider(1, 64, value=FLOOD_DEFAULTS["in_flight"], step=1,
                                             label="in flight")
                    with gr.Row():
                        n_tokens = gr.Slider(8, 512, value=FLOOD_DEFAULTS["max_tokens"], step=8,
                                             label="longest reply (tokens)")
                        n_secs = gr.Slider(5, 600, value=FLOOD_DEFAULTS["duration_s"], step=5,
                                           label="at most (s)")
                    with gr.Row():
                        flood_btn = gr.Button("Start flood", variant="secondary")
                        unflood_btn = gr.Button("Stop flood")
                    flood_md = gr.Markdown(elem_id="flood")
            # The panel: the summary, then the figures (the queue cards on the first screen
            # of a 1280x720 projector, tests/test_demo_steps_browser.py), then the table.
            with gr.Column(scale=7, min_width=480):
                summary = gr.Markdown(elem_id="summary")
                plots = []
                with gr.Tabs():
                    for name in PANEL_FIGURES:
                        with gr.Tab(name):
                            plots.append(gr.Plot(show_label=False))
                table = gr.Dataframe(headers=TABLE_HEADERS, label="sessions", interactive=False,
                                     elem_id="sessions")
                gr.Markdown(TABLE_NOTE, elem_id="table-note")
                with gr.Accordion("engine.stats()", open=False):
                    raw = gr.JSON()
                with gr.Accordion("What the ids mean (Q1, P2, G1, R1, ...)", open=False):
                    gr.Markdown(spec_legend(), elem_id="legend")

        # Enter or Send: `take` (the box is cleared only if the message is accepted), then
        # `reply` streams into the chat and the status line, never into the box, so what
        # the user types meanwhile stays. trigger_mode="multiple": an Enter while a reply
        # streams reaches `take`, which refuses it visibly (Gradio's default, "once",
        # dropped it without a word).
        for trigger in (msg.submit, send.click):
            trigger(take, [msg], [msg, status], api_visibility="private", trigger_mode="multiple",
                    concurrency_limit=None, show_progress="hidden").then(
                reply, [chatbot, temperature, max_tokens], [chatbot, status],
                api_visibility="private", concurrency_limit=None, show_progress="hidden")
        # the API: one call, (message, history, temperature, max tokens) -> (history, box,
        # status) as it streams (tests/test_app.py uses it through gradio_client)
        api_btn = gr.Button(visible=False)
        api_btn.click(chat, [msg, chatbot, temperature, max_tokens], [chatbot, msg, status],
                      api_name="chat", concurrency_limit=None, show_progress="hidden")
        stop_btn.click(stop, None, status, api_name="stop", concurrency_limit=None,
                       trigger_mode="multiple")
        clear.click(lambda: ([], ""), None, [chatbot, status], api_visibility="private")
        flood_btn.click(flood, [n_total, n_flight, n_tokens, n_secs], flood_md,
                        api_name="flood_start", concurrency_limit=None)
        unflood_btn.click(lambda: app.noisy.stop(), None, flood_md, api_name="flood_stop",
                          concurrency_limit=None)
        panel_out = [summary, table, *plots, raw, flood_md]
        gr.Timer(panel_interval).tick(refresh, None, panel_out, show_progress="hidden",
                                      api_visibility="private", concurrency_limit=None)
        demo.load(refresh, None, panel_out, show_progress="hidden", api_visibility="private")
        demo.unload(forget)
    demo.chat_app = app
    return demo


def launch(demo: gr.Blocks, host: str = "127.0.0.1", port: int = 7860, **kw):
    """Start serving; with `prevent_thread_lock=True` (tests) it returns at once. Gradio
    itself stays quiet (its hint to `share=True` would offer a public tunnel to a demo
    that is loopback-only by design); the page's address is printed here."""
    demo.queue(default_concurrency_limit=None)
    quiet = kw.pop("quiet", False)
    if not quiet:
        print(f"minserve chat on http://{host}:{port}  (Ctrl+C stops it)", flush=True)
    return demo.launch(server_name=host, server_port=port, theme=THEME, show_error=True,
                       quiet=True, **kw)


# ------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    """The app's command line: its own flags, then every engine knob (each with its
    default, in words where the app's differs by policy)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=None,
                   help="bind address (env MINSERVE_APP_HOST; default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=None,
                   help="TCP port (env MINSERVE_APP_PORT; default 7860)")
    add_threads_argument(p)
    cap = f"{APP_DEFAULTS['max_rows_per_session']} under fair, none under fcfs"
    add_engine_arguments(p, {**APP_DEFAULTS, "max_rows_per_session": cap})
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def config_from_args(args: argparse.Namespace, env: dict | None = None) -> tuple[EngineConfig,
                                                                                  str, int]:
    """(engine config, host, port): flag > environment > the app's defaults (for the
    policy chosen: `app_defaults`) > EngineConfig's."""
    env = dict(os.environ if env is None else env)
    policy = args.policy or env.get("MINSERVE_POLICY") or APP_DEFAULTS["policy"]
    config = engine_config_from_args(args, env, defaults=app_defaults(policy))
    host = args.host or env.get("MINSERVE_APP_HOST") or "127.0.0.1"
    port = args.port if args.port is not None else int(env.get("MINSERVE_APP_PORT") or 7860)
    return config, host, port


FIGURES = Path(__file__).resolve().parent / "docs" / "figures.json"


def first_run_note(path: Path = FIGURES) -> str:
    """What the first run costs, in the figures the README quotes, read from
    docs/figures.json (one place for a measured figure; this file runs from a checkout,
    which has it). Without the file: the same words, no numbers."""
    try:
        from minserve import figures

        fig = figures.load(path)
        secs, mb = fig["model.first_conversion_s"]["value"], fig["model.converted_mb"]["value"]
    except (OSError, ValueError, KeyError):
        return " (the first run converts it once, into ~/.cache/minserve)"
    return f" (the first run converts it: about {secs:.0f} s, {mb:.0f} MB on disk)"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config, host, port = config_from_args(args)
        apply_threads(args)
    except ValueError as e:
        print(f"app.py: error: {e}", file=sys.stderr)
        return 2
    problem = port_problem(host, port, "--port", "MINSERVE_APP_PORT")
    if problem:  # before the model loads: the answer comes in a second
        print(f"app.py: error: {problem}", file=sys.stderr)
        return 2
    from minserve import Engine

    print(f"loading {config.model or 'the embedded SmolLM2-135M-Instruct'}"
          + ("" if config.model else first_run_note()) + " ...", file=sys.stderr)
    try:
        engine = Engine(config)
    except ValueError as e:
        print(f"app.py: error: {e}", file=sys.stderr)
        return 2
    demo = build_app(engine)
    try:
        launch(demo, host, port)
    finally:
        demo.chat_app.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

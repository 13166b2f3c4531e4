"""A served run's files: everything per request as JSON, a plotly HTML report with four
panels per run, and the per-session table (`minserve bench serving`, peers/serving.py).

Not an experiment's shared piece but the serving run's own output, so it lives beside
the one experiment that writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..bench.report import _fmt, markdown_table, md_table
from ..bench.targets import RunResult


def session_table(run: RunResult, weights: dict[str, float] | None = None) -> str:
    s = run.summary(weights)
    j = s["jain"]
    return "\n".join(md_table(
        ["session", "requests", "refused", "output tok/s", "TTFT p50 / p99 (s)", "e2e mean (s)"],
        [[name, v["requests"], v["refused"], _fmt(v["output_tokens_per_s"], digits=1),
          f"{_fmt(v['ttft_p50'])} / {_fmt(v['ttft_p99'])}", _fmt(v["e2e_mean"])]
         for name, v in s["sessions"].items()])) + \
        (f"\n\nJain's index: throughput {_fmt(j['throughput'], digits=3)}, "
         f"latency {_fmt(j['latency'], digits=3)}")


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def write_html(path: str | Path, runs: list[RunResult], title: str = "minserve bench",
               notes: str = "", include_plotlyjs: bool | str = "directory") -> Path:
    """A page with a summary table and four panels per run set.

    TTFT CDF | ITL CDF
    output tokens over time | e2e latency by arrival time (or by output length)

    plotly.js (4.6 MB) is written once, as `plotly.min.js` beside the reports, and
    each page loads it from there: pages stay small and still work offline.
    (include_plotlyjs=True embeds it in the page instead.)
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    # e2e against arrival time shows a queue building up; when everything arrives at
    # once, plot it against output length instead (head-of-line blocking shows there).
    spread = any(r.arrival - run.t_start > 1e-3 for run in runs for r in run.results)
    x_label = "arrival time (s)" if spread else "output tokens"
    fig = make_subplots(rows=2, cols=2, subplot_titles=(
        "TTFT (s), CDF", "inter-token latency (ms, log), CDF",
        "output tokens streamed over time (s)", f"e2e latency (s) by {x_label}"))
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    for k, run in enumerate(runs):
        color = palette[k % len(palette)]
        ok = [r for r in run.results if r.ok]

        def cdf(vals):
            v = sorted(vals)
            return v, [(i + 1) / len(v) for i in range(len(v))]

        x, y = cdf([r.ttft for r in ok])
        fig.add_trace(go.Scatter(x=x, y=y, name=run.target, legendgroup=run.target,
                                 line={"color": color}), 1, 1)
        x, y = cdf([g * 1e3 for r in ok for g in r.itls])
        fig.add_trace(go.Scatter(x=x, y=y, name=run.target, legendgroup=run.target,
                                 showlegend=False, line={"color": color}), 1, 2)
        times = sorted(t - run.t_start for r in ok for t in r.token_times)
        fig.add_trace(go.Scatter(x=times, y=list(range(1, len(times) + 1)), name=run.target,
                                 legendgroup=run.target, showlegend=False,
                                 line={"color": color}), 2, 1)
        fig.add_trace(go.Scatter(x=[r.arrival - run.t_start if spread else r.output_len
                                    for r in ok], y=[r.e2e for r in ok],
                                 mode="markers", name=run.target, legendgroup=run.target,
                                 showlegend=False, marker={"color": color, "size": 5},
                                 text=[f"#{r.index} {r.session} in={r.prompt_len} "
                                       f"out={r.output_len}" for r in ok]), 2, 2)
    fig.update_xaxes(type="log", row=1, col=2)
    fig.update_layout(height=800, title=title, template="plotly_white")
    table = markdown_table(runs).replace("**", "")
    rows = [ln.strip("|").split("|") for ln in table.splitlines() if not ln.startswith("|---")]
    html_table = "<table border=1 cellpadding=4 style='border-collapse:collapse'>" + "".join(
        "<tr>" + "".join(f"<{'th' if i == 0 else 'td'}>{c.strip()}</{'th' if i == 0 else 'td'}>"
                         for c in row) + "</tr>" for i, row in enumerate(rows)) + "</table>"
    body = fig.to_html(full_html=False, include_plotlyjs=include_plotlyjs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if include_plotlyjs == "directory" and not (path.parent / "plotly.min.js").exists():
        from plotly.offline import get_plotlyjs

        (path.parent / "plotly.min.js").write_text(get_plotlyjs())
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
                    f"</head><body style='font-family:sans-serif'><h2>{title}</h2>"
                    f"<p>{notes}</p>{html_table}{body}</body></html>")
    return path

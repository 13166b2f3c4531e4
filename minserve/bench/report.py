"""Results out: JSON (everything, per request), a plotly HTML report, markdown tables,
and each experiment's own section of docs/benchmarks.md.

Comparisons are ratios to minserve *from the same run* (same process, same
workload, same minute of a shared machine): absolute tokens/s drift with
whatever else the machine is doing; the ratio is what carries over.

Several experiments share docs/benchmarks.md; each owns the text between its markers
(`<!-- bench:NAME -->` ... `<!-- /bench:NAME -->`), so re-running one never clobbers
another's figures, and the prose around the markers stays as written.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from .targets import RunResult

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def update_section(name: str, markdown: str, doc: Path = DOC) -> Path:
    """Replace (or append) the section `name` of `doc` with `markdown`."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"<!-- bench:{name} -->\n{markdown.strip()}\n<!-- /bench:{name} -->"
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
    return doc


def md_table(header: list[str], rows: list[list[Any]], align: str = "---") -> list[str]:
    """A markdown table's lines: the header, the rule, one line per row. `align` ("---:"
    right) is every column's but a first column of labels, which stays left."""
    first = align if rows and isinstance(rows[0][0], (int, float)) else "---"
    return ["| " + " | ".join(header) + " |", f"|{first}|" + f"{align}|" * (len(header) - 1),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def _fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else \
        f"{x * scale:.{digits}f}"


def comparison(runs: list[RunResult], baseline: str | None = None) -> dict[str, dict[str, Any]]:
    """Per target: its key figures and ratios to the baseline's (default: the first run).

    `speedup` = baseline output tok/s / this target's (> 1: minserve is faster);
    `ttft_p50_ratio` etc. = this target's latency / the baseline's (> 1: slower than minserve).
    """
    sums = {r.target: r.summary() for r in runs}
    base = sums.get(baseline or runs[0].target) if runs else None
    out = {}
    for name, s in sums.items():
        row: dict[str, Any] = {
            "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
            "total_tokens_per_s": s["throughput"]["total_tokens_per_s"],
            "requests_per_s": s["throughput"]["requests_per_s"],
            "completed": s["requests"]["completed"], "refused": s["requests"]["refused"],
            "duration_s": s["duration_s"],
            "ttft_p50": s["ttft"]["p50"], "ttft_p99": s["ttft"]["p99"],
            "itl_p50": s["itl"]["p50"], "itl_p99": s["itl"]["p99"], "e2e_p50": s["e2e"]["p50"],
        }
        if base is not None and s["throughput"]["output_tokens_per_s"]:
            row["speedup"] = (base["throughput"]["output_tokens_per_s"]
                              / s["throughput"]["output_tokens_per_s"])
            for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50"):
                b = base[k.split("_")[0]][k.split("_")[1]]
                row[k + "_ratio"] = row[k] / b if row[k] is not None and b else None
        out[name] = row
    return out


def markdown_table(runs: list[RunResult], baseline: str | None = None) -> str:
    baseline = baseline or (runs[0].target if runs else "")
    rows = []
    for name, c in comparison(runs, baseline).items():
        # Say the direction in words: a bare "1.11x" under a peer's row read as the
        # peer being faster.
        x = c.get("speedup")
        speed = "(baseline)" if name == baseline else "–" if not x else \
            f"**{baseline} {x:.2f}x {'faster' if x >= 1 else 'as fast (slower)'}**"
        rows.append([name, c["completed"], _fmt(c["output_tokens_per_s"], digits=1),
                     _fmt(c["total_tokens_per_s"], digits=1), speed,
                     f"{_fmt(c['ttft_p50'])} / {_fmt(c['ttft_p99'])}",
                     f"{_fmt(c['itl_p50'], 1e3, 0)} / {_fmt(c['itl_p99'], 1e3, 0)}",
                     _fmt(c["e2e_p50"])])
    return "\n".join(md_table(["target", "done", "output tok/s", "total tok/s",
                               f"{baseline} vs this target (output tok/s)", "TTFT p50 / p99 (s)",
                               "ITL p50 / p99 (ms)", "e2e p50 (s)"], rows))


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

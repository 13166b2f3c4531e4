"""Results out: markdown tables and each experiment's own section of docs/benchmarks.md.
(A served run's JSON and HTML report are peers/run_report.py's: only `serving` writes them.)

Comparisons are ratios to minserve *from the same run* (same process, same
workload, same minute of a shared machine): absolute tokens/s drift with
whatever else the machine is doing; the ratio is what carries over.

Several experiments share docs/benchmarks.md; each owns the text between its markers
(`<!-- bench:NAME -->` ... `<!-- /bench:NAME -->`), so re-running one never clobbers
another's figures, and the prose around the markers stays as written.
"""

from __future__ import annotations

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

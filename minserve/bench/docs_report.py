"""Write one benchmark's results into its own section of docs/benchmarks.md.

Several benchmarks share that page; each owns the text between its markers

    <!-- bench:NAME -->
    ...
    <!-- /bench:NAME -->

so re-running one never clobbers another's figures.
"""

from __future__ import annotations

import platform
import re
import time
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Figures measured on the reference machine (2 CPU cores, fp32) by the commands
quoted in each section. Absolute times drift on shared machines; compare the
ratios, which each come from one run.
"""


def machine_line() -> str:
    return (f"_{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads_")


def update_section(name: str, markdown: str, doc: Path = DOC) -> Path:
    """Replace (or append) the section `name` of docs/benchmarks.md with `markdown`."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else HEADER
    block = f"<!-- bench:{name} -->\n{markdown.strip()}\n<!-- /bench:{name} -->"
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
    return doc


def publish(name: str, markdown: str, write: bool, doc: Path = DOC) -> None:
    """Print a benchmark's section; with `write`, also put it into `doc` under `name`."""
    print(markdown)
    if write:
        print("updated", update_section(name, markdown, doc))

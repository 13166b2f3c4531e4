"""The README's Python, run verbatim: what a newcomer pastes first must work.

Every ```python block of README.md runs in order in one namespace (the step-mode
block reuses the five-line block's `engine`), on the embedded SmolLM2, as the
README says. A block that hangs (the step-mode recipe once did: nothing ticked
the engine) fails on the timeout instead of blocking the suite.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_the_readme_has_the_snippets_a_newcomer_pastes():
    blocks = python_blocks()
    assert len(blocks) >= 2, "README should show the five lines and the step-mode recipe"
    assert any("engine.step()" in b and "for ev in h" in b for b in blocks)


@pytest.mark.real_model
@pytest.mark.timeout(180)
def test_every_python_block_of_the_readme_runs_as_written():
    ns: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in python_blocks():
            exec(compile(block, str(README), "exec"), ns)
    printed = out.getvalue()
    engine = ns["engine"]
    try:
        assert ns["outs"][1].finish_reason in ("stop", "length") and ns["outs"][1].text
        # the step-mode loop ran to the end: its last event says why the reply ended
        assert ns["ev"].finish_reason in ("stop", "length"), printed
        assert ns["h"].finished and engine.scheduler.is_drained()
    finally:
        engine.stop()

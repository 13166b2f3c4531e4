"""Re-execute the lessons and store them the way `make test` and the tests want them.

    .venv/bin/python scripts/refresh_notebooks.py          # every notebook under notebooks/
    .venv/bin/python scripts/refresh_notebooks.py 04 05    # those whose name starts so
    .venv/bin/python scripts/refresh_notebooks.py --time-only --record-times   # time them

Each notebook is executed with nbclient in a kernel of this Python, then written
back diff-friendly:

* no widget state: `store_widget_state=False`. (Saved state of the stepper's plotly
  FigureWidgets, each with the plotly.js bundle, once made notebook 01 weigh 20 MB;
  `tests/test_notebooks.py` fails on any `metadata.widgets`.)
* no output for a cell tagged `nbval-ignore-output` (a figure, the stepper) or `check`
  (a hidden cell that asserts a claim of the text): nbval does not compare them, and a
  figure's output embeds plotly.js.
* no stderr, no execution timing; printed output stays, because nbval compares it.

`--time-only` runs and times them, writing no notebook; `--record-times` records each
lesson's run time (top to bottom, in a fresh kernel) in docs/figures.json as
`notebooks.NN.run_s`, with the machine's load average at the start, and rewrites the
times notebooks/README.md quotes (minserve/figures/). On a busy machine the
times are not the ones a student meets: record them on a quiet one.

Run it after changing the engine or a lesson, look at the diff, commit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
UNSTORED = {"nbval-ignore-output", "check"}  # cell tags whose output is never stored


def refresh(path: Path, write: bool = True) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", store_widget_state=False,
                   record_timing=False, resources={"metadata": {"path": str(path.parent)}}
                   ).execute()
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        if UNSTORED & set(cell.metadata.get("tags", [])):
            cell.outputs, cell.execution_count = [], None
        errs = [o for o in cell.outputs if o.get("name") == "stderr"]
        if errs:
            raise RuntimeError(f"{path.name}: a cell wrote to stderr (silence it in the "
                               f"lesson):\n{''.join(cell.source)[:200]}\n{errs[0]['text'][:500]}")
    if write:
        nbformat.write(nb, path)


def main(argv: list[str]) -> int:
    import os

    write, times_wanted = "--time-only" not in argv, "--record-times" in argv
    argv = [a for a in argv if a not in ("--time-only", "--record-times")]
    paths = sorted(NOTEBOOKS.rglob("*.ipynb"))
    paths = [p for p in paths if ".ipynb_checkpoints" not in p.parts]
    if argv:
        paths = [p for p in paths if any(p.name.startswith(a) for a in argv)]
    times = {}
    for path in paths:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        refresh(path, write)
        seconds = time.perf_counter() - t0
        print(f"{path.relative_to(ROOT)}: {seconds:.1f} s, {path.stat().st_size / 1024:.0f} KB")
        if times_wanted and path.parent == NOTEBOOKS and path.name[:2].isdigit():
            times[f"notebooks.{path.name[:2]}.run_s"] = (round(seconds, 1), load,
                                                         os.getloadavg()[0])
    sys.path.insert(0, str(ROOT))
    from minserve.figures import conditions_of, record

    for name, (seconds, load, load_end) in times.items():
        # notebooks/README.md says beside each time what machine it was taken on
        record({name: seconds}, source=f"scripts/refresh_notebooks.py ({os.cpu_count()} CPUs, "
                                       f"load average {load:.1f} at the start)",
               conditions=conditions_of(load, load_end, os.cpu_count() or 1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Render the figures the notebooks draw into docs/img/*.png.

    .venv/bin/python scripts/screenshots.py          # every notebook
    .venv/bin/python scripts/screenshots.py 02 05    # notebooks whose name starts so

Each notebook under notebooks/ is executed in memory (the file is not touched) in a
kernel of this Python environment. Every code cell whose metadata holds
`{"minserve": {"screenshot": "NAME"}}` draws one plotly figure; its JSON, taken
from the cell's output, becomes docs/img/NAME.png. So the pictures in docs/ are
exactly the notebooks' pictures, with one source for both, and each notebook links
its own (a "static picture" under every figure: outputs are not stored, so a code
host's preview shows these). The stepper's picture (docs/img/stepper.png) is a
screenshot of real JupyterLab, taken by tests/test_jupyterlab.py (`make screenshots`).

Needs the `dev` extras (nbclient, kaleido) and a Chromium or Chrome for kaleido
to drive headless (Debian: `apt-get install -y chromium`; another binary: set
BROWSER_PATH). MathJax is switched off: nothing is fetched from a CDN.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
IMG = ROOT / "docs" / "img"
PLOTLY_MIME = "application/vnd.plotly.v1+json"


def notebook_figures(path: Path) -> dict[str, dict]:
    """Execute the notebook; return {screenshot name: plotly figure dict}."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    figures = {}
    for cell in nb.cells:
        name = cell.get("metadata", {}).get("minserve", {}).get("screenshot")
        if cell.cell_type != "code" or not name:
            continue
        data = [o["data"][PLOTLY_MIME] for o in cell.outputs if PLOTLY_MIME in o.get("data", {})]
        if len(data) != 1:
            raise RuntimeError(f"{path.name}: cell {name!r} drew {len(data)} figures, expected 1")
        figures[name] = data[0]
    return figures


def render(figures: dict[str, dict], out: Path) -> list[Path]:
    """Write each figure as PNG: at the width its layout asks for, or (the figures leave
    it unset, to fit any output area) at EXPORT_WIDTH, the width of a notebook's output."""
    import kaleido
    import plotly.io as pio

    from minserve.inspection.viz.style import EXPORT_WIDTH

    out.mkdir(parents=True, exist_ok=True)
    kaleido.start_sync_server(mathjax=False, silence_warnings=True)
    # plotly passes its (empty) kaleido options on every call; the server has ours
    warnings.filterwarnings("ignore", message="The kopts argument is ignored")
    written = []
    try:
        for name, fig in figures.items():
            path = out / f"{name}.png"
            fig = pio.from_json(json.dumps(fig))
            pio.write_image(fig, path, format="png", scale=1,
                            width=fig.layout.width or EXPORT_WIDTH)
            written.append(path)
    finally:
        kaleido.stop_sync_server(silence_warnings=True)
    return written


def main(argv: list[str]) -> int:
    paths = sorted(p for p in NOTEBOOKS.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    if argv:
        paths = [p for p in paths if any(p.name.startswith(a) for a in argv)]
    figures: dict[str, dict] = {}
    for path in paths:
        t0 = time.perf_counter()
        figs = notebook_figures(path)
        print(f"{path.name}: {len(figs)} figures ({time.perf_counter() - t0:.1f} s)")
        figures.update(figs)
    for path in render(figures, IMG):
        print(f"  wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A student's own copies of the lessons, so that running one never rewrites a tracked file.

    python scripts/work_copy.py           # make notebooks: copy what work/ lacks, keep the rest
    python scripts/work_copy.py --reset   # make notebooks-reset: a fresh copy; the old one is kept

JupyterLab saves a notebook as it runs (autosave, every two minutes): served from
`notebooks/`, the first lesson run rewrote a tracked file with megabytes of figures,
the test of that notebook failed and the next `git pull` conflicted. `make notebooks`
serves the repository but opens the copies in `work/` (git-ignored): run, edit and
break them freely. `work/` sits at the same depth as `notebooks/`, so every relative
link of a lesson still resolves: `../docs/img/...` (its static pictures), `../docs/...`,
`../minserve/...`.

Copying never overwrites: a lesson already in `work/` is the student's. `--reset`
moves `work/` aside to `work-old/<time>/` (git-ignored too) and copies afresh.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".ipynb_checkpoints", "__pycache__", "conftest.py"}  # conftest: nbval's, not a lesson


def copy_lessons(src: Path, dest: Path) -> list[Path]:
    """Copy every file under `src` that `dest` does not have yet; return those copied."""
    copied = []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if not path.is_file() or SKIP & set(rel.parts):
            continue
        target = dest / rel
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            copied.append(target)
    return copied


def reset(src: Path, dest: Path) -> Path | None:
    """Move `dest` aside (returned) and copy the lessons afresh."""
    old = None
    if dest.exists():
        old = dest.parent / f"{dest.name}-old" / time.strftime("%Y%m%d-%H%M%S")
        old.parent.mkdir(parents=True, exist_ok=True)
        dest.rename(old)
    copy_lessons(src, dest)
    return old


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reset", action="store_true", help="a fresh copy; the old one is moved aside")
    p.add_argument("--src", type=Path, default=ROOT / "notebooks")
    p.add_argument("--dest", type=Path, default=ROOT / "work")
    args = p.parse_args(argv)
    if args.reset:
        old = reset(args.src, args.dest)
        print(f"{args.dest}: a fresh copy of the lessons"
              + (f"; your old copy is in {old}" if old else ""))
    else:
        copied = copy_lessons(args.src, args.dest)
        print(f"{args.dest}: your copies of the lessons ({len(copied)} new file(s) copied; "
              "`make notebooks-reset` starts afresh)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

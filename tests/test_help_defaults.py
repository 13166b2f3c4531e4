"""Every option's `--help` says its default, in words that mean what they do.

The README promises that `--help` on `app.py` or `minserve serve` lists every flag with
its default; a teacher reads `minserve bench <experiment> --help` and `minserve keys
... --help` the same way. Read from the parsers themselves (each option's help as the
parser's own formatter expands it), not from the printed text, for every command:

* each option has help, and its expanded help names its default ("default");
* no default reads as a bare None (`default None` says nothing of what happens);
* a flag (an option that takes no value) never shows a bare True or False as its
  default, which reads as the opposite for `--no-X` (`--no-prefix-caching (default:
  True)`): an on/off pair is `argparse.BooleanOptionalAction` (`--x/--no-x`), a one-way
  flag says its default in words;
* a `--no-X` flag that merely stores False is the pair instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def minserve_parsers() -> dict[str, argparse.ArgumentParser]:
    from minserve.__main__ import build_parser

    return {"minserve": build_parser()[0]}


def app_parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT))
    try:
        import app
    finally:
        sys.path.remove(str(ROOT))
    return app.build_parser()


def walk(parser: argparse.ArgumentParser, prog: str):
    """(command, parser) for `parser` and every subcommand under it, recursively."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, f"{prog} {name}")


def problems(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    formatter = parser._get_formatter()
    found = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                               argparse._SubParsersAction)):
            continue
        name = f"{prog} {'/'.join(action.option_strings) or action.dest}"
        text = formatter._expand_help(action) if action.help else ""
        if not text.strip():
            found.append(f"{name}: no help")
            continue
        if not action.option_strings or action.required:
            continue  # a positional or required value: no default to state
        if not re.search(r"\bdefault", text, re.I):
            found.append(f"{name}: help names no default: {text!r}")
        if re.search(r"default:?\s+'?None\b", text):
            found.append(f"{name}: a bare None for a default: {text!r}")
        flag = action.nargs == 0
        pair = isinstance(action, argparse.BooleanOptionalAction)
        if flag and not pair and re.search(r"default:?\s+(True|False)\b", text):
            found.append(f"{name}: a flag's default as a bare True/False: {text!r}")
        if isinstance(action, argparse._StoreFalseAction) and any(
                o.startswith("--no-") for o in action.option_strings):
            found.append(f"{name}: --no-X storing False; make it --X/--no-X "
                         "(argparse.BooleanOptionalAction)")
    return found


def commands() -> list[tuple[str, argparse.ArgumentParser]]:
    found = list(walk(minserve_parsers()["minserve"], "minserve"))
    found += list(walk(app_parser(), "app.py"))
    return found


def test_every_command_is_covered_serve_app_keys_and_every_experiment():
    from minserve.bench.cli import EXPERIMENTS

    names = {prog for prog, _ in commands()}
    wanted = {"minserve serve", "app.py", "minserve keys new", "minserve keys check",
              "minserve demo", "minserve bench", *(f"minserve bench {e}" for e in EXPERIMENTS)}
    assert wanted <= names, wanted - names


@pytest.mark.parametrize("prog", [prog for prog, _ in commands()])
def test_every_option_says_its_default_in_words_that_mean_what_it_does(prog):
    [parser] = [p for name, p in commands() if name == prog]
    assert problems(parser, prog) == []


def test_the_check_catches_a_no_flag_with_a_bare_default_and_a_silent_option():
    """The rules can fail: the cases the issue found, rebuilt on a scratch parser."""
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="turn the prefix cache off")
    p.add_argument("--api-keys-file", default=None, help="a JSON file")
    p.add_argument("--log-level", default="info")
    found = "\n".join(problems(p, "x"))
    assert "--no-prefix-caching: a flag's default as a bare True/False" in found
    assert "--no-prefix-caching: --no-X storing False" in found
    assert "--api-keys-file: a bare None" in found
    assert "--log-level: no help" in found
    q = argparse.ArgumentParser()  # without the defaults formatter, a value says nothing
    q.add_argument("--retry-after", type=float, default=1.0, help="seconds")
    assert problems(q, "y") == ["y --retry-after: help names no default: 'seconds'"]
    from minserve.bench.cli import DefaultsHelp

    ok = argparse.ArgumentParser(formatter_class=DefaultsHelp)  # the pair names its default form
    ok.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="the prefix cache")
    assert problems(ok, "z") == []
    assert "(default: --prefix-caching)" in ok.format_help()

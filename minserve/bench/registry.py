"""What an experiment is, and the shared pieces it receives.

An experiment is a function of one `Bench`, declared with its options:

    @experiment("kv-cache", option("--batch", type=int, nargs="+", default=[8, 32]))
    def kv_cache(bench):
        \"\"\"Prefix caching's TTFT; paged vs padded decode ticks; KV bytes per token.\"\"\"
        padded = bench.engine(backend="padded", max_batch_size=8)
        ...
        bench.publish("kv-cache", [heading, table])

Its docstring's first line is what `minserve bench --list` prints. `cli.py` lists the
experiments and gives each its `minserve bench NAME` command; every experiment also
takes `--threads`, `--no-docs` and `--tiny` (a tiny random Llama over SmolLM2's
tokenizer: a smoke run in seconds whose figures mean nothing, so it never writes the
docs). Each declares `smallest`, the options of its quickest run: the test suite runs
every experiment of the registry so (tests/test_bench.py), and a run it cannot do (a
count below what it needs) is refused by its option's type, `at_least(n)`, with a
message, before anything loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import figures
from .report import DOC, update_section
from .timing import Conditions


def option(*flags: str, **kwargs: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """One declared option: the arguments of `argparse.ArgumentParser.add_argument`."""
    return flags, kwargs


def at_least(n: int, why: str = "") -> Callable[[str], int]:
    """An option's type: an int >= n, else argparse's one-line refusal (and `why`), so an
    impossible run (`--batch 0`, a count that leaves nothing to time) is refused with a
    message before the model loads instead of failing halfway with a traceback."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < n:
            raise argparse.ArgumentTypeError(f"{value} is too small: use {n} or more"
                                             + (f" ({why})" if why else ""))
        return value

    parse.__name__ = f"int >= {n}"
    parse.minimum = n  # read by tests/test_bench.py
    return parse


@dataclass(frozen=True)
class Experiment:
    name: str
    run: Callable[[Bench], Any]
    options: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = ()
    threads: int | None = None  # its default torch thread count (None: torch's own)
    smallest: tuple[str, ...] = ()  # the options of its quickest run (with --tiny: seconds)

    @property
    def help(self) -> str:
        return (self.run.__doc__ or "").strip().splitlines()[0]


def experiment(name: str, *options, threads: int | None = None, smallest: tuple[str, ...] = ()):
    """Declare `fn(bench)` as the experiment `name` with these options, and `smallest`,
    the options of its quickest run (the suite runs it with `--tiny`)."""
    return lambda fn: Experiment(name, fn, options, threads, tuple(smallest))


class Bench:
    """What every experiment receives: its options (`args`), the embedded model loaded
    once, engines on that model, the conditions of the run, and the writers."""

    def __init__(self, args) -> None:
        self.args = args
        self.conditions = Conditions()
        self._loaded: tuple[Any, Any] | None = None

    def model(self) -> tuple[Any, Any]:
        """(model, tokenizer), loaded once: `--tiny` a tiny random Llama over SmolLM2's
        vocabulary with SmolLM2's tokenizer (chat templates and text prompts work as with
        the real model; long contexts too), else `--model` or the embedded SmolLM2, fp32 on
        the CPU unless said otherwise."""
        if self._loaded is None:
            import torch

            torch.manual_seed(0)
            a = self.args
            if self.tiny:
                from transformers import AutoTokenizer

                from ..models import embedded_model_dir, tiny_llama

                tok = AutoTokenizer.from_pretrained(embedded_model_dir())
                model = tiny_llama(vocab_size=len(tok), max_positions=8192,
                                   eos_token_id=tok.eos_token_id)
                self._loaded = model.to(getattr(a, "device", "cpu")), tok
            else:
                from ..models import load_model

                self._loaded = load_model(getattr(a, "model", None), getattr(a, "dtype", "float32"),
                                          getattr(a, "device", "cpu"))
        return self._loaded

    @property
    def tiny(self) -> bool:
        return bool(getattr(self.args, "tiny", False))

    @property
    def writes_docs(self) -> bool:
        """Unless --no-docs, or --tiny (a random model's figures belong on no page)."""
        return not (self.args.no_docs or self.tiny)

    def engine(self, **config):
        """An Engine on the shared model; `config` are EngineConfig fields."""
        from .. import Engine, EngineConfig

        model, tokenizer = self.model()
        config.setdefault("device", getattr(self.args, "device", "cpu"))
        return Engine(EngineConfig(**config), model=model, tokenizer=tokenizer)

    def publish(self, section: str, lines: list[str], doc: Path = DOC) -> str:
        """Print the section (its lines, then the conditions line); unless --no-docs,
        write it between its markers in docs/benchmarks.md (or `doc`)."""
        markdown = "\n".join([*lines, "", self.conditions.line()])
        print(markdown)
        if self.tiny:
            print("(--tiny: a random model's figures; the docs are left as they are)")
        if self.writes_docs:
            print("updated", update_section(section, markdown, doc))
        return markdown

    def record(self, values: dict[str, float], command: str) -> None:
        """Figures other pages quote (docs/figures.json), unless --no-docs or --tiny."""
        if self.writes_docs:
            c = self.conditions.as_dict()
            figures.record(values, source=f"{command} ({self.conditions.line().strip('_')})",
                           conditions=figures.conditions_of(c["load_start"], c["load_end"],
                                                            c["cores"]))


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after an option's help, unless the help already says its
    default in words: a None, or a flag's True or False, would read as something else
    (`--no-docs (default: False)`). An on/off pair names the form that is the default
    (`--prefix-caching/--no-prefix-caching ... (default: --prefix-caching)`); a list
    default reads as typed (`8 32`)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or not action.option_strings:
            return text
        if isinstance(action, argparse.BooleanOptionalAction) and isinstance(action.default, bool):
            on, off = action.option_strings
            return f"{text} (default: {on if action.default else off})"
        if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        shown = (" ".join(map(str, action.default)) if isinstance(action.default, (list, tuple))
                 else action.default)
        return f"{text} (default: {str(shown).replace('%', '%%')})"

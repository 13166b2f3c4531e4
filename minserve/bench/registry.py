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
takes `--threads` and `--no-docs`.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Experiment:
    name: str
    run: Callable[[Bench], Any]
    options: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = ()
    threads: int | None = None  # its default torch thread count (None: torch's own)

    @property
    def help(self) -> str:
        return (self.run.__doc__ or "").strip().splitlines()[0]


def experiment(name: str, *options, threads: int | None = None):
    """Declare `fn(bench)` as the experiment `name` with these options."""
    return lambda fn: Experiment(name, fn, options, threads)


class Bench:
    """What every experiment receives: its options (`args`), the embedded model loaded
    once, engines on that model, the conditions of the run, and the writers."""

    def __init__(self, args) -> None:
        self.args = args
        self.conditions = Conditions()
        self._loaded: tuple[Any, Any] | None = None

    def model(self) -> tuple[Any, Any]:
        """(model, tokenizer), loaded once: `--tiny` a tiny random Llama (no tokenizer),
        else `--model` or the embedded SmolLM2, fp32 on the CPU unless said otherwise."""
        if self._loaded is None:
            import torch

            torch.manual_seed(0)
            a = self.args
            if getattr(a, "tiny", False):
                from ..models import tiny_llama

                self._loaded = tiny_llama(eos_token_id=0).to(getattr(a, "device", "cpu")), None
            else:
                from ..models import load_model

                self._loaded = load_model(getattr(a, "model", None), getattr(a, "dtype", "float32"),
                                          getattr(a, "device", "cpu"))
        return self._loaded

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
        if not self.args.no_docs:
            print("updated", update_section(section, markdown, doc))
        return markdown

    def record(self, values: dict[str, float], command: str) -> None:
        """Figures other pages quote (docs/figures.json), unless --no-docs."""
        if not self.args.no_docs:
            figures.record(values, source=f"{command} ({self.conditions.line().strip('_')})")

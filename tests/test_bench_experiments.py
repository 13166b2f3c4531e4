"""Every experiment of `minserve bench --list` runs, and refuses what it cannot run.

The experiments come from the registry (`minserve.bench.cli.EXPERIMENTS`), so one added
there is covered here without a line of this file changing:

* each declares `smallest`, the options of its quickest run, and runs so with `--tiny`
  (a tiny random Llama over SmolLM2's tokenizer) to its end, printing its section and
  writing no page (`--no-docs`, and `--tiny` never writes one anyway);
* every count option refuses a value below its minimum with argparse's one line (exit
  2), before anything loads: `at_least(n)` is its type;
* the issue's crash, `decode-throughput --batch 1 --new-tokens 2`, and a configuration
  no engine takes end in a message and exit 2, not a traceback.
"""

from __future__ import annotations

import argparse

import pytest

from minserve.__main__ import main
from minserve.bench.cli import EXPERIMENTS

SEED_LIKE = {"--seed"}  # any int is a seed


def shares_did_its_work(out: str) -> None:
    """`minserve bench shares` at its quickest: two `minserve serve` processes, before
    (--reclaim off) and after; the KV lent to one tenant is taken back for the newcomer
    (served on both, with its ticks), and the keyed streams from one address are all
    served."""
    table = {row.split(" | ")[0].lstrip("| "): row.split(" | ")[2:4]
             for row in out.splitlines() if row.startswith("| ")}
    lent = next(v for k, v in table.items() if k.startswith("the whole KV budget"))
    assert all("s (" in side for side in lent), lent
    assert table["4 keyed streams from one address"] == ["4 of 4", "4 of 4"]


def decode_throughput_did_its_work(out: str) -> None:
    """Each path's decode-only ticks were timed (its `TickTimes` trace): a rate, not '–',
    and above the path's rate over the whole batch, which includes the prefill."""
    head, row = [line for line in out.splitlines() if line.startswith("| ")][:2]
    cells = dict(zip(head.strip("| ").split(" | "), row.strip("| ").split(" | ")))
    for path in ("readable", "serve"):
        assert float(cells[f"{path} decode ticks tok/s"]) > float(cells[f"{path} tok/s"]), cells


# What an experiment's smallest run must show beyond ending (its own smoke test, run once)
DID_ITS_WORK = {"shares": shares_did_its_work, "decode-throughput": decode_throughput_did_its_work}


def counts(name: str) -> list[argparse.Action]:
    """The experiment's options that take an integer count."""
    from minserve.__main__ import build_parser

    sub = build_parser()[1]["bench"]
    [parser] = [a.choices[name] for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
    return [a for a in parser._actions if a.option_strings
            and (a.type is int or hasattr(a.type, "minimum"))]


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_every_experiment_runs_to_its_end_at_its_smallest_options(name, tmp_path, monkeypatch,
                                                                  capsys):
    e = EXPERIMENTS[name]
    assert e.smallest, (f"{name}: declare its quickest run, @experiment(..., smallest=(...)), "
                        "a few seconds with --tiny")
    monkeypatch.chdir(tmp_path)  # what an experiment writes beside it (serving's report)
    assert main(["bench", name, *e.smallest, "--tiny", "--no-docs", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "load average (1 min)" in out  # its section, to the conditions line at the end
    DID_ITS_WORK.get(name, lambda out: None)(out)


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_every_count_option_refuses_a_value_below_its_minimum_with_a_message(name, capsys):
    options = counts(name)
    plain = [a.option_strings[0] for a in options
             if a.type is int and not SEED_LIKE & set(a.option_strings)]
    assert not plain, f"{name}: {plain} take any int; give them type=at_least(n)"
    for action in options:
        if not hasattr(action.type, "minimum"):
            continue
        flag = action.option_strings[0]
        with pytest.raises(SystemExit) as exit_:
            main(["bench", name, flag, str(action.type.minimum - 1), "--no-docs"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {'/'.join(action.option_strings)}" in err and "too small" in err, err


def test_a_decode_throughput_run_with_no_decode_only_tick_is_refused_not_a_zero_division(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "decode-throughput", "--batch", "1", "--new-tokens", "2", "--no-docs"])
    assert exit_.value.code == 2
    assert "--new-tokens: 2 is too small: use 3 or more" in capsys.readouterr().err


def test_options_no_engine_can_take_end_in_one_line_naming_what_to_change(tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--tiny", "-n", "2", "--peers", "none", "--no-progress",
                 "--backend", "padded", "--prefill-mode", "mixed_batch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minserve bench serving: error: EngineConfig: ") and "paged" in err
    assert "Traceback" not in err

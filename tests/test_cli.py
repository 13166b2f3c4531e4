"""The command lines as a newcomer meets them: mistakes get one line that says what to do."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from minserve import EngineConfig
from minserve.__main__ import main
from minserve.models import resolve_device
from minserve.server.access import Tenant
from minserve.server.cli import port_problem

ROOT = Path(__file__).resolve().parents[1]


def test_a_mistyped_serve_flag_prints_serves_usage_and_the_flag_it_meant(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--batch-size", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: minserve serve")  # serve's usage, not the top level's
    assert "--batch-size -> --max-batch-size" in err


def test_a_device_this_machine_lacks_is_a_one_line_value_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the error case cannot arise here")
    with pytest.raises(ValueError, match="sees no CUDA GPU.*use device 'cpu' or 'auto'"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="not a device name"):
        resolve_device("gpu")
    assert resolve_device("cpu").type == "cpu"


def test_minserve_serve_with_device_cuda_on_a_cpu_machine_exits_2_with_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = subprocess.run([sys.executable, "-m", "minserve", "serve", "--device", "cuda",
                        "--model", "/nonexistent", "--port", "0"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "AssertionError" not in r.stderr
    assert "minserve serve: error: device='cuda'" in r.stderr


def test_a_port_in_use_is_named_with_the_flag_and_variable_that_change_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        problem = port_problem("127.0.0.1", port, "--port", "MINSERVE_PORT")
    assert problem and f"127.0.0.1:{port}" in problem
    assert "--port N or MINSERVE_PORT=N" in problem
    assert port_problem("127.0.0.1", 0, "--port", "MINSERVE_PORT") is None


@pytest.mark.parametrize("cmd, variable", [
    (["-m", "minserve", "serve"], "MINSERVE_PORT"), (["app.py"], "MINSERVE_APP_PORT")])
def test_serve_and_the_demo_refuse_a_busy_port_before_loading_the_model(cmd, variable):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, *cmd, "--port", str(port), "--model", "/nonexistent"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--port N or {variable}=N" in r.stderr
    assert "loading" not in r.stderr  # refused before any model work


def test_serving_front_ends_default_to_chunked_prefill_and_a_flag_or_variable_turns_it_off():
    """A long prompt must not stall other users' streams for its whole prefill (C1):
    `minserve serve` and the chat demo default to chunked prefill; EngineConfig (what a
    notebook steps) keeps monolithic."""
    import argparse

    import app as chat_demo
    from minserve.chat.logic import APP_DEFAULTS
    from minserve.server.cli import SERVING_DEFAULTS, add_serve_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    served = engine_config_from_args(p.parse_args([]), {}, defaults=SERVING_DEFAULTS)
    # the server: chunks of 256 prompt tokens inside the decode forward (Version B)
    assert (served.prefill_mode, served.prefill_chunk_size) == ("mixed_batch", 256)
    assert "default: 256" in p.format_help().replace("\n", " ")
    off = engine_config_from_args(p.parse_args([]), {"MINSERVE_PREFILL_CHUNK_SIZE": "0"},
                                  defaults=SERVING_DEFAULTS)
    assert off.prefill_chunk_size == 0  # a whole prompt per forward
    flag = engine_config_from_args(p.parse_args(["--prefill-chunk-size", "64"]),
                                   {"MINSERVE_PREFILL_CHUNK_SIZE": "0"}, defaults=SERVING_DEFAULTS)
    assert (flag.prefill_mode, flag.prefill_chunk_size) == ("mixed_batch", 64)
    chunked = engine_config_from_args(p.parse_args(["--prefill-mode", "chunked"]), {},
                                      defaults=SERVING_DEFAULTS)
    assert (chunked.prefill_mode, chunked.prefill_chunk_size) == ("chunked", 256)
    demo, _, _ = chat_demo.config_from_args(chat_demo.parse_args([]), env={})
    assert demo.prefill_mode == "chunked"
    assert APP_DEFAULTS["prefill_chunk_size"] == SERVING_DEFAULTS["prefill_chunk_size"]
    assert EngineConfig().prefill_mode == "monolithic"


def test_threads_come_from_the_flag_or_minserve_threads_and_bad_values_say_so():
    import argparse

    import torch

    from minserve.server.cli import add_threads_argument, apply_threads, serving_threads

    p = argparse.ArgumentParser()
    add_threads_argument(p)
    before = torch.get_num_threads()
    try:
        assert apply_threads(p.parse_args([]), {}) is None and torch.get_num_threads() == before
        assert apply_threads(p.parse_args([]), {"MINSERVE_THREADS": "1"}) == 1
        assert torch.get_num_threads() == 1
        assert apply_threads(p.parse_args(["--threads", "2"]), {"MINSERVE_THREADS": "1"}) == 2
        with pytest.raises(ValueError, match="MINSERVE_THREADS"):
            apply_threads(p.parse_args([]), {"MINSERVE_THREADS": "many"})
        cores = len(os.sched_getaffinity(0))
        assert serving_threads() == max(1, cores - 1)  # the server leaves one core to HTTP
    finally:
        torch.set_num_threads(before)


def test_serve_refuses_a_bad_keys_file_or_two_kinds_of_key_before_loading_the_model(
        tmp_path, capsys):
    bad = tmp_path / "keys.json"
    bad.write_text('{"short": {"tenant": "a"}}')
    assert main(["serve", "--api-keys-file", str(bad)]) == 2
    assert "use 16 or more" in capsys.readouterr().err
    assert main(["serve", "--api-keys-file", str(bad), "--api-key", "k"]) == 2
    assert "not both" in capsys.readouterr().err


def test_a_shared_server_caps_one_request_and_shares_the_rest_fairly_by_default():
    """H5, H6: `serve` caps one request at half the KV budget, orders waiting requests by
    the fair policy and shares rows, KV, queue and a tick's prompt tokens between those
    that want them, with no fixed per-session or per-tenant cap (a lone client gets the
    whole batch); and says so at start-up."""
    import argparse

    from minserve.server.cli import (
        SERVING_DEFAULTS,
        add_serve_arguments,
        engine_config_from_args,
        fairness_line,
    )

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    served = engine_config_from_args(p.parse_args([]), {}, defaults=SERVING_DEFAULTS)
    assert (served.max_request_kv_share, served.max_tenant_kv_share,
            served.max_rows_per_session) == (0.5, 1.0, None)
    assert (served.policy, served.shares, served.max_prefill_tokens) == ("fair", "equal", 512)
    assert EngineConfig().max_request_kv_share == 1.0  # a notebook's engine: no cap
    assert EngineConfig().shares == "off"
    given = engine_config_from_args(p.parse_args(["--policy", "fcfs", "--shares", "off"]), {},
                                    defaults=SERVING_DEFAULTS)
    line = fairness_line(given, None)  # said plainly at start-up: what is not fair
    assert "arrival order" in line and "shares off" in line
    keys = {"k1": Tenant("alice"), "k2": Tenant("bob")}
    line = fairness_line(served, keys)
    assert "the 2 tenants" in line and "fair (VTC)" in line and "lone client" in line
    assert "'default'" in fairness_line(served, None)  # no keys: who is one session


def test_serve_says_what_the_engine_runs_on(tiny_model):
    """The start-up line a benchmark or a bug report needs: backend, forward, batch, threads."""
    from minserve import Engine
    from minserve.server.cli import engine_line

    paged = Engine(EngineConfig(device="cpu", backend="paged", model_runner="auto",
                                prefill_mode="mixed_batch", prefill_chunk_size=16,
                                max_batch_size=4, num_blocks=32), model=tiny_model)
    line = engine_line(paged)
    assert "paged backend, compact forward, mixed_batch prefill (chunks of 16)" in line
    assert "up to 4 rows, 32 KV blocks of 16" in line and "torch thread" in line
    padded = Engine(EngineConfig(device="cpu"), model=tiny_model)
    assert "padded backend, HF model, monolithic prefill (chunks of whole prompts)" in engine_line(padded)


def test_serve_refuses_a_mistyped_trusted_proxy_before_loading_the_model(capsys):
    assert main(["serve", "--forwarded-allow-ips", "10.0.0.0/8,proxy.local",
                 "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "--forwarded-allow-ips: 'proxy.local' is not an address" in err
    assert "loading" not in err

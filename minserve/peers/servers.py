"""OpenAI-compatible servers as child processes, for side-by-side runs (docs/benchmarks.md, "Side by side").

The peers a user would pick instead of minserve, each started the way its own docs
say, on the same model folder (the converted embedded SmolLM2, fp32), on loopback:

    minserve   python -m minserve serve --host 127.0.0.1 --port P [its defaults]
    vLLM CPU   <venv>/bin/python -m vllm.entrypoints.openai.api_server --model DIR
               --dtype float32 --max-model-len 4096 ...      (VLLM_CPU_KVCACHE_SPACE=2)
    HF         transformers serve --continuous-batching --device cpu --dtype float32 DIR

vLLM lives in its own virtual environment (`scripts/peers_setup.sh` makes it: its
torch is not ours). `vllm serve` itself fails with the `vllm-cpu` package (it looks
up package metadata under the name `vllm`), hence the module entry point.

`running(cmd)` starts one in its own process group, waits until `GET /v1/models`
answers 200 (vLLM compiles the model on its first start: minutes), yields the base
URL, and stops the whole group afterwards, whatever happened in between.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ServerCommand:
    """How to start one server: argv, extra environment, how long its start may take."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 900.0  # vLLM's first start compiles the model

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def minserve_command(model_dir: str | None, port: int, extra: list[str] | None = None,
                     python: str = sys.executable) -> ServerCommand:
    """`minserve serve` as a user starts it: its defaults, plus `extra` flags."""
    argv = [python, "-m", "minserve", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]
    if model_dir:
        argv += ["--model", model_dir]
    return ServerCommand("minserve", argv + list(extra or []), port, start_timeout_s=300)


def vllm_command(model_dir: str, port: int, venv: str | Path, max_model_len: int = 4096,
                 kv_space_gib: int = 2, extra: list[str] | None = None) -> ServerCommand:
    """vLLM's CPU build from its own venv. KV space 2 GiB, fp32, context 4096."""
    python = str(Path(venv) / "bin" / "python")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--host", "127.0.0.1", "--port", str(port), *(extra or [])]
    return ServerCommand("vLLM CPU", argv, port, {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)})


def hf_command(model_dir: str, port: int, python: str = sys.executable) -> ServerCommand:
    """Hugging Face's own server, continuous batching on, fp32 on the CPU."""
    cli = str(Path(python).parent / "transformers")
    argv = [cli, "serve", "--continuous-batching", "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", model_dir]
    return ServerCommand("HF transformers serve", argv, port, start_timeout_s=300)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server's whole process group (vLLM forks an engine core), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


@contextmanager
def running(cmd: ServerCommand, log_path: str | Path) -> Iterator[str]:
    """Start `cmd`, wait until it serves `/v1/models`, yield its base URL, stop it.

    Its output goes to `log_path`; a server that exits or does not answer within
    `cmd.start_timeout_s` raises RuntimeError quoting the log's last lines.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **cmd.env}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + cmd.start_timeout_s
        while not _answers(cmd.base_url + "/v1/models"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace").splitlines()[-15:]
                why = (f"exited with {proc.returncode}" if proc.poll() is not None
                       else f"did not answer within {cmd.start_timeout_s:.0f} s")
                raise RuntimeError(f"{cmd.name} {why}; {log_path}:\n" + "\n".join(tail))
            time.sleep(1.0)
        yield cmd.base_url
    finally:
        stop_group(proc)

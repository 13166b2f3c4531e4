"""Disaggregated prefill as a class meets it (docs/backends.md, SPEC C4, H8): one figure each.

    python scripts/disagg_scenarios.py [--code DIR] [NAME ...]    # a JSON line per finding

Each finding starts the real `python -m minserve serve --prefill-mode disaggregated`
(tenants from a keys file, the serving defaults) and talks to it over loopback with the
same client, whatever code it runs: `--code DIR` puts another copy of the project first
on the server's PYTHONPATH (a checkout from before a fix, say), so the figures before
and after come from this one file. The model is a tiny random Llama with SmolLM2's
tokenizer, except where only the real one's compute time shows the finding (`flood`,
`cancel`, `death`: SmolLM2-135M, the embedded model) and `startup` (a first script on
the embedded model). Slow: minutes per finding on two busy cores, more before the fixes.

    startup   a script that builds the engine without `if __name__ == "__main__":`
    flood     one tenant's 8 prompts of 2,000 tokens, another's 8-token chat 1 s later
    cancel    40 prompts of 2,000 tokens abandoned, then a fresh request
    idle      the same, then nothing: how long the staging blocks stay in use
    death     12 prompts on the worker, kill -9 of the worker: how many fail
    health    four deaths: /health, the refusals, the log; a hangup to the process group
    shutdown  a death with prompts queued, then one SIGTERM; a stopped worker, one SIGTERM
    orphans   kill -9 of the server: what is left, and its shared memory
    memory    1,000 requests: the worker's private memory, every 100
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from minserve.bench.health import wait_healthy

ROOT = Path(__file__).resolve().parents[1]
TINY_DIR = Path(tempfile.gettempdir()) / "minserve-tiny-chat-4096"
KEYS = {"ms-alice-Q7fK2pX9vL3mT8wR": {"tenant": "alice"},
        "ms-bob-Hd4Jw8Zq2Nc6Yb": {"tenant": "bob"},
        "ms-teacher-Vx3Lp9Rk5Tg7Ws": {"tenant": "teacher", "may_read_all_stats": True}}
ALICE, BOB, TEACHER = list(KEYS)
DISAGG = ("--prefill-mode", "disaggregated", "--threads", "1", "--prefill-worker-threads", "1")
DEFAULT = ("--threads", "2")  # the serving default (mixed_batch prefill), the same two cores
CODE = ROOT  # the project the servers run (--code)


def tiny_model_dir() -> Path:
    """A tiny random Llama (4,096 positions, for 2,000-token prompts) with SmolLM2's
    tokenizer, as a folder `minserve serve --model` loads (made once)."""
    if not TINY_DIR.exists():
        from transformers import AutoTokenizer

        from minserve.models import embedded_model_dir, tiny_llama

        part = Path(tempfile.mkdtemp(dir=TINY_DIR.parent))
        tiny_llama(vocab_size=49152, max_positions=4096).save_pretrained(part)
        AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(part)
        os.replace(part, TINY_DIR)
    return TINY_DIR


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(CODE), os.environ.get("PYTHONPATH", "")])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `minserve serve` in a process group of its own (as from a terminal)."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url, self.lines = proc, url, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def stats(self) -> dict:
        return httpx.get(self.url + "/scheduler/stats", timeout=30,
                         headers={"Authorization": f"Bearer {TEACHER}"}).json()

    def worker(self) -> dict:
        return self.stats().get("prefill_worker") or {}

    def complete(self, key: str, prompt, max_tokens: int, timeout: float = 600, **body):
        return httpx.post(self.url + "/v1/completions", timeout=timeout,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0, **body})

    def first_token_s(self, key: str, prompt, max_tokens: int = 4, timeout: float = 600) -> float:
        """Seconds from sending a streamed request to its first token."""
        t0 = time.monotonic()
        with httpx.stream("POST", self.url + "/v1/completions", timeout=timeout,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if choices[0].get("text"):
                        return time.monotonic() - t0
        return float("nan")


@contextmanager
def serve(*flags: str, model: str = "tiny", up_s: float = 300):
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.json"
        keys_file.write_text(json.dumps(KEYS))
        port = free_port()
        cmd = [sys.executable, "-m", "minserve", "serve", "--port", str(port),
               "--api-keys-file", str(keys_file), "--log-level", "info", *flags]
        if model == "tiny":
            cmd += ["--model", str(tiny_model_dir())]
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env(), start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
        srv = Server(proc, f"http://127.0.0.1:{port}")
        try:
            wait_healthy(proc, srv.url, up_s, said=lambda: "\n".join(srv.lines[-8:]),
                         poll_s=0.3)
            yield srv
        finally:
            for pid in [proc.pid, *descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(10)


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in Path(f"/proc/{p}/task").iterdir()
                    for c in (t / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            kids = []
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def mib(pid: int, *fields: str) -> int:
    """Sum of /proc/PID/smaps_rollup fields (or status fields), in MiB."""
    total = 0
    for name in ("smaps_rollup", "status"):
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in fields and v.strip().endswith("kB"):
                total += int(v.split()[0])
    return total // 1024


def prompt(i: int, n: int) -> list[int]:
    """A prompt of `n` token ids, different for every `i` (no prefix cache hits)."""
    return [(7919 * i + 13 * k) % 40000 + 200 for k in range(n)]


def in_threads(fns) -> list:
    out = [None] * len(fns)

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001  (a client's failure is a result here)
            out[i] = e

    ts = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in ts:
        t.start()
    return ts, out


# ================================================================== the findings
UNGUARDED = '''\
from minserve import Engine, EngineConfig, SamplingParams

engine = Engine(EngineConfig(backend="paged", prefill_mode="disaggregated"))
print(engine.generate(["Hi"], SamplingParams(max_tokens=4))[0].text)
'''


def startup(hang_s: float = 180) -> dict[str, Any]:
    """A student's first script, without the main guard, on the embedded model."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "first.py"
        script.write_text(UNGUARDED)
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp, env=env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=hang_s)
            hung = False
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *descendants(proc.pid)]:
                os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate()
            hung = True
    lines = err.decode().strip().splitlines()
    return {"seconds": round(time.monotonic() - t0, 1), "hung": hung,
            "returncode": proc.returncode, "last_line": lines[-1][:400] if lines else ""}


def flood() -> dict[str, Any]:
    """alice sends 8 prompts of 2,000 tokens; 1 s later bob's 8-token chat: bob's first
    token, in the default mode and disaggregated (embedded model)."""
    out = {}
    for mode, flags in (("default", DEFAULT), ("disaggregated", DISAGG)):
        with serve(*flags, model="embedded") as srv:
            srv.first_token_s(BOB, prompt(99, 8))  # warm-up
            t0 = time.monotonic()
            ts, res = in_threads([lambda i=i: srv.complete(ALICE, prompt(i, 2000), 8)
                                  for i in range(8)])
            time.sleep(1.0)
            chat = srv.first_token_s(BOB, prompt(100, 8))
            for t in ts:
                t.join()
            out[mode] = {"chat_first_token_s": round(chat, 2),
                         "flood_done_s": round(time.monotonic() - t0, 1),
                         "flood_statuses": sorted({getattr(r, "status_code", repr(r))
                                                   for r in res})}
    out["ratio"] = round(out["disaggregated"]["chat_first_token_s"]
                         / out["default"]["chat_first_token_s"], 2)
    return out


def storm(srv: Server, n: int = 40) -> None:
    """`n` streamed prompts of 2,000 tokens from alice whose clients hang up within 1.5 s."""
    rng = random.Random(0)
    hang_up_after = [rng.uniform(0.2, 1.5) for _ in range(n)]

    def abandon(i, after):  # a client that sends its request, then closes the socket
        body = json.dumps({"prompt": prompt(i, 2000), "max_tokens": 8, "stream": True}).encode()
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Authorization: Bearer " + ALICE.encode() + b"\r\n"
                         b"Content-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(after)

    ts, _ = in_threads([lambda i=i, t=t: abandon(i, t) for i, t in enumerate(hang_up_after)])
    for t in ts:
        t.join()


def cancel() -> dict[str, Any]:
    """40 prompts of 2,000 tokens whose clients hang up within 1.5 s; then a fresh 4-token
    request's first token, in the default mode and disaggregated (embedded model); and
    what the worker's stats said just before it."""
    out = {}
    for mode, flags in (("default", DEFAULT), ("disaggregated", DISAGG)):
        with serve(*flags, model="embedded") as srv:
            srv.first_token_s(BOB, prompt(99, 4))  # warm-up
            storm(srv)
            time.sleep(0.5)
            worker = srv.worker() if mode == "disaggregated" else {}
            fresh = srv.first_token_s(BOB, prompt(1000, 4))
            row = {"fresh_first_token_s": round(fresh, 2)}
            if worker:
                row["worker_after_storm"] = {k: worker.get(k) for k in (
                    "staging_blocks_used", "staging_blocks", "dropped_tokens", "abandoned")}
                row["on_worker_listed"] = len(worker.get("on_worker", []))
                row["worker_restarts_after"] = srv.worker().get("restarts")  # none expected
            out[mode] = row
    return out


def idle() -> dict[str, Any]:
    """The same storm, then nothing: how long an idle server keeps the abandoned prompts'
    staging blocks "used" (embedded model)."""
    with serve(*DISAGG, model="embedded") as srv:
        srv.first_token_s(BOB, prompt(99, 4))
        storm(srv)
        t0, seen = time.monotonic(), []
        while time.monotonic() - t0 < 120:  # no request from here on
            seen.append(srv.worker().get("staging_blocks_used"))
            if seen[-1] == 0:
                break
            time.sleep(1.0)
        return {"staging_used_after_storm": seen[0], "idle_s_until_free":
                round(time.monotonic() - t0, 1) if seen[-1] == 0 else f">120 ({seen[-1]} used)",
                "worker_restarts": srv.worker().get("restarts")}  # none expected


def death() -> dict[str, Any]:
    """12 prompts of 600 tokens on the worker, one of them being computed: kill -9 of the
    worker. How many of the 12 fail? (embedded model)"""
    with serve(*DISAGG, model="embedded") as srv:
        srv.first_token_s(BOB, prompt(99, 4))
        ts, res = in_threads([lambda i=i: srv.complete(ALICE, prompt(i, 600), 4)
                              for i in range(12)])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the worker computes one of them
            w = srv.worker()
            if any(j.get("started") for j in w.get("on_worker", [])):
                break
            time.sleep(0.1)
        held = len(srv.worker().get("on_worker", []))
        os.kill(w["pid"], signal.SIGKILL)
        for t in ts:
            t.join()
        codes = [getattr(r, "status_code", repr(r)) for r in res]
    return {"on_worker_at_kill": held, "ok": codes.count(200), "failed": 12 - codes.count(200),
            "statuses": sorted(set(map(str, codes)))}


def health() -> dict[str, Any]:
    """Four deaths of the worker, each followed by a request (which makes any engine look
    at its worker) and a wait for a new worker: what the requests, /health and the log
    say. Then, on a fresh server, a terminal hangup to the process group."""
    out: dict[str, Any] = {}
    with serve(*DISAGG) as srv:
        statuses = []
        for i in range(4):
            w = srv.worker()
            try:
                os.kill(w["pid"], signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass
            time.sleep(1.0)
            statuses.append(srv.complete(ALICE, prompt(i, 8), 2).status_code)
            deadline = time.monotonic() + 60
            while i < 3 and time.monotonic() < deadline:  # a new worker, ready
                now = srv.worker()
                if now.get("pid") not in (None, w["pid"]) and now.get("ready"):
                    break
                time.sleep(0.3)
        h = httpx.get(srv.url + "/health", timeout=10)
        r = srv.complete(ALICE, prompt(9, 8), 2)
        out["after_4_deaths"] = {
            "request_statuses_after_each_death": statuses,
            "health_status": h.status_code, "health": h.json(),
            "request_status": r.status_code, "request_error": r.text[:300],
            "log_lines_on_restarts": [ln[:200] for ln in srv.lines if "restart" in ln.lower()]}
    with serve(*DISAGG) as srv:
        worker = srv.worker()["pid"]
        kids = descendants(srv.proc.pid)
        os.killpg(srv.proc.pid, signal.SIGHUP)
        time.sleep(3.0)
        out["hangup_to_the_group"] = {
            "server_alive": srv.proc.poll() is None,
            "worker_alive": alive(worker), "children_before": len(kids),
            "children_alive_after": sum(alive(k) for k in kids),
            "worker_pid_after": (srv.worker() or {}).get("pid") if srv.proc.poll() is None else None,
            "worker_pid_before": worker}
    return out


def shutdown() -> dict[str, Any]:
    """One SIGTERM (--shutdown-grace-s 5): after a worker death with 12 prompts queued;
    and with the worker stopped (SIGSTOP) and a prompt on it. Seconds to exit."""
    out = {}
    for case in ("after a death with prompts queued", "worker stopped"):
        with serve(*DISAGG, "--shutdown-grace-s", "5") as srv:
            w = srv.worker()["pid"]
            os.kill(w, signal.SIGSTOP)
            in_threads([lambda i=i: srv.complete(ALICE, prompt(i, 2000), 4, timeout=300)
                        for i in range(12 if case.startswith("after") else 1)])
            time.sleep(3.0)
            if case.startswith("after"):
                os.kill(w, signal.SIGKILL)
                time.sleep(3.0)
            kids = descendants(srv.proc.pid)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            try:
                srv.proc.wait(120)
                took = round(time.monotonic() - t0, 1)
            except subprocess.TimeoutExpired:
                took = ">120 (still running)"
            time.sleep(1.0)
            out[case] = {"seconds_to_exit": took, "left_behind": sum(alive(k) for k in kids),
                         "logged_finished": any("Finished server process" in ln
                                                for ln in srv.lines)}
    return out


def orphans(model: str = "tiny") -> dict[str, Any]:
    """kill -9 of the server: which of its children are still alive 5 s later, and the
    shared memory the worker had mapped."""
    with serve(*DISAGG, model=model) as srv:
        srv.complete(ALICE, prompt(1, 500), 2)
        worker = srv.worker()["pid"]
        kids = descendants(srv.proc.pid)
        shm = mib(worker, "RssShmem")
        srv.proc.kill()
        srv.proc.wait(10)
        time.sleep(5.0)
        left = [k for k in kids if alive(k)]
        return {"children": len(kids), "alive_5_s_after": len(left),
                "worker_alive": alive(worker), "worker_shared_memory_mib": shm}


def memory(n: int = 1000, every: int = 100, clients: int = 8) -> dict[str, Any]:
    """n requests (prompts of 8 to 2,000 tokens, 4 tokens out, `clients` at a time): the
    worker's private memory (and the server's) every `every` requests (tiny model)."""
    with serve(*DISAGG) as srv:
        worker = srv.worker()["pid"]
        rng = random.Random(0)
        lengths = [rng.randrange(8, 2000) for _ in range(n)]
        series, done, lock = [], [0], threading.Lock()
        series.append((0, mib(worker, "Private_Clean", "Private_Dirty"),
                       mib(srv.proc.pid, "Private_Clean", "Private_Dirty")))
        t0 = time.monotonic()

        def client(k):
            for i in range(k, n, clients):
                srv.complete(ALICE, prompt(i, lengths[i]), 4, user=f"s{k}")
                with lock:
                    done[0] += 1
                    if done[0] % every == 0:
                        series.append((done[0], mib(worker, "Private_Clean", "Private_Dirty"),
                                       mib(srv.proc.pid, "Private_Clean", "Private_Dirty")))

        ts, _ = in_threads([lambda k=k: client(k) for k in range(clients)])
        for t in ts:
            t.join()
        warm = [p for d, p, _ in series if d >= 200]
        return {"requests": n, "seconds": round(time.monotonic() - t0),
                "worker_private_mib": [p for _, p, _ in series],
                "server_private_mib": [s for _, _, s in series],
                "worker_growth_after_200_mib": max(warm) - min(warm) if warm else None,
                "worker_pid_unchanged": srv.worker().get("pid") == worker}


FINDINGS = {"startup": startup, "flood": flood, "cancel": cancel, "idle": idle, "death": death,
            "health": health, "shutdown": shutdown, "orphans": orphans, "memory": memory}


def main() -> None:
    global CODE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", choices=list(FINDINGS), default=[],
                   help="findings to run (default: all)")
    p.add_argument("--code", type=Path, default=ROOT,
                   help="the minserve project the servers run (default: this one)")
    a = p.parse_args()
    CODE = a.code.resolve()
    tiny_model_dir()
    for name in a.names or list(FINDINGS):
        t0 = time.monotonic()
        try:
            result = FINDINGS[name]()
        except Exception as e:  # noqa: BLE001  (one finding's failure is its figure)
            result = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps({"finding": name, "code": str(CODE), "load": os.getloadavg()[0],
                          "took_s": round(time.monotonic() - t0), **result}), flush=True)


if __name__ == "__main__":
    main()

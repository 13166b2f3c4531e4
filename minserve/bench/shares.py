"""`minserve bench shares`: a newcomer to a lent machine, on the real CLI (SPEC H6, H7).

Each scenario of a class's findings (docs/security.md) runs against `python -m minserve serve` as a teacher starts it
(a keys file, the serving defaults, `--threads 1`), over a tiny random Llama saved with
SmolLM2's tokenizer and 8,192 positions, with real HTTP clients (httpx, streaming): twice,
on two servers up side by side, "before" (`--reclaim off`: a share is only held back, the
behaviour before taking back; or, with `--before-source DIR`, another checkout's code) and
"after" (the defaults: borrowed rows taken back). Each tenant's client binds a loopback
address of its own (127.0.0.N), as machines of a class would, except where one address is
the point (the 90 streams).

    scenario         what happens                                        measured
    borrowed-rows    one tenant alone starts --rows rows of --tokens;    the newcomer's first
                     another arrives --wait s later                      token, s and ticks
    borrowed-kv      one tenant holds the whole KV budget with 8         the same
                     requests (each within the per-request cap)
    class-script     --class-size students chat one request at a time;   students' first-token
                     one of them runs a --script-loops script (and a      p90, with and without
                     run without it)                                     the script; the
                                                                         script's rows / share
    maximal          --maximal tenants each send one request as large    a short chat's first
                     as the server allows; then a short chat             token (its delay
                                                                         over an idle one)
    flooders         --flooders tenants flood; an innocent one sends     the innocent's first
                     one chat                                            token
    streams          --streams keyed streams from one address at once    how many were served

A tick count is the server's (`/health`'s `ticks`) read just before the newcomer sends
and just after its first token arrives: within a tick or two of the engine's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .health import wait_healthy
from .metrics import percentile
from .registry import at_least, experiment, option
from .report import md_table

ROOT = Path(__file__).resolve().parents[2]
# its quickest run (a few seconds beside the two servers' start): two scenarios, tiny sizes
SMALLEST = ("--scenarios", "borrowed-kv", "streams", "--rows", "2", "--kv-blocks", "8",
            "--tokens", "8", "--wait", "0.2", "--streams", "4", "--class-size", "2")
SCENARIOS = ("borrowed-rows", "borrowed-kv", "class-script", "maximal", "flooders", "streams")
TEACHER = "ms-bench-teacher-Vx3Lp9Rk5T"
CONTEXT = 8192  # the tiny model's positions: SmolLM2's (a maximal request is 8,184 tokens)


def key_of(tenant: str) -> str:
    """A key the keys file accepts (16+ characters, 8+ different ones), by tenant name."""
    return f"ms-bench-{tenant}-Q7fK2pX9"


def model_dir() -> Path:
    """A tiny random Llama (8,192 positions) with SmolLM2's tokenizer, made once."""
    path = Path(tempfile.gettempdir()) / "minserve-tiny-chat-8192"
    if not path.exists():
        from transformers import AutoTokenizer

        from ..models import embedded_model_dir, tiny_llama

        part = Path(tempfile.mkdtemp(dir=path.parent))  # renamed when complete
        tiny_llama(vocab_size=49152, max_positions=CONTEXT).save_pretrained(part)
        AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(part)
        os.replace(part, path)
    return path


class Server:
    """`python -m minserve serve` in a process of its own, with every tenant's key."""

    def __init__(self, name: str, flags: list[str], tenants: list[str], folder: Path,
                 source: str | None = None) -> None:
        keys = {key_of(t): {"tenant": t} for t in tenants}
        keys[TEACHER] = {"tenant": "teacher", "may_read_all_stats": True}
        keys_file = folder / f"keys-{name}.json"
        keys_file.write_text(json.dumps(keys, indent=1))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if source:  # another checkout's code: found first, from its own folder
            env["PYTHONPATH"] = source + os.pathsep + env.get("PYTHONPATH", "")
        self.log = open(folder / f"serve-{name}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minserve", "serve", "--model", str(model_dir()),
             "--port", str(port), "--api-keys-file", str(keys_file), "--threads", "1",
             "--log-level", "warning", *flags], cwd=source or ROOT, env=env,
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_up(self, timeout: float = 300.0) -> None:
        wait_healthy(self.proc, self.url, timeout, f"minserve serve ({self.name})",
                     lambda: f"see {self.log.name}")

    def stop(self) -> None:
        """Ask it to stop (SIGINT: it drains, then exits); `wait` for it after."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def wait(self) -> None:
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------ clients
class Clients:
    """An httpx client per loopback address (one per tenant, as a class's machines)."""

    def __init__(self, srv: Server) -> None:
        self.srv = srv
        self.address: dict[str, str] = {}  # tenant -> its loopback address
        self.clients: dict[str, Any] = {}  # address -> httpx.AsyncClient

    def client(self, tenant: str | None, address: str | None = None):
        import httpx

        if address is None:  # 127.0.0.2, 127.0.0.3, ... (127.0.0.1: the teacher)
            n = len(self.address) + 2
            address = self.address.setdefault(tenant, f"127.0.{n // 250}.{n % 250 + 1}")
        if address not in self.clients:
            self.clients[address] = httpx.AsyncClient(
                base_url=self.srv.url, timeout=httpx.Timeout(600, connect=60),
                transport=httpx.AsyncHTTPTransport(
                    local_address=address, retries=0,
                    limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0)))
        return self.clients[address]

    async def close(self) -> None:
        for c in self.clients.values():
            await c.aclose()

    async def health_ticks(self) -> int:
        return (await self.client(None, "127.0.0.1").get("/health")).json()["ticks"]

    async def stats(self) -> dict[str, Any]:
        return (await self.client(None, "127.0.0.1").get(
            "/scheduler/stats", headers={"Authorization": f"Bearer {TEACHER}"})).json()

    async def drained(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            q = (await self.stats())["queues"]
            if not (q["pending"] or q["prefilling"] or q["active"]):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.srv.name}: did not drain")
            await asyncio.sleep(0.1)

    async def stream(self, tenant: str, prompt: list[int], max_tokens: int,
                     address: str | None = None, session: str | None = None,
                     first_token=None) -> dict[str, Any]:
        """One streamed completion: its first-token time, tokens' text chunks, status."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, **({"user": session} if session else {})}
        t0, out = time.perf_counter(), {"ok": False, "ttft_s": None, "chunks": 0}
        try:
            async with self.client(tenant, address).stream(
                    "POST", "/v1/completions", json=body,
                    headers={"Authorization": f"Bearer {key_of(tenant)}"}) as r:
                out["status"] = r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        out["ok"] = r.status_code == 200
                        break
                    if out["ttft_s"] is None and r.status_code == 200:
                        out["ttft_s"] = time.perf_counter() - t0
                        if first_token is not None:
                            await first_token()
                    out["chunks"] += 1
        except Exception as e:  # a transport error: what a refused connection looked like
            out["error"] = type(e).__name__
        return out


def ids(n: int, salt: int) -> list[int]:
    """A prompt of `n` token ids no other request shares (no prefix-cache hits)."""
    return [1000 + (salt * 7919 + i * 104729) % 40000 for i in range(n)]


async def newcomer(c: Clients, tenant: str, salt: int) -> dict[str, Any]:
    """A short chat's first token: seconds, and the server's ticks in between."""
    ticks: dict[str, int] = {"before": await c.health_ticks()}

    async def at_first() -> None:
        ticks["after"] = await c.health_ticks()

    r = await c.stream(tenant, ids(12, salt), 8, first_token=at_first)
    return {"ttft_s": r["ttft_s"], "ticks": ticks.get("after", ticks["before"]) - ticks["before"],
            "ok": r["ok"]}


async def hold(c: Clients, tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # hung up: the server cancels them
    await c.drained()


async def wait_rows(c: Clients, tenant: str, rows: int, timeout: float) -> None:
    """Until `tenant` holds `rows` batch rows (or `timeout` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await c.stats()).get("shares", {}).get(tenant, {}).get("rows", 0) >= rows:
            return
        await asyncio.sleep(0.1)


# ------------------------------------------------------------------ the scenarios
async def borrowed_rows(c: Clients, a, tag: str) -> dict[str, Any]:
    lender = [asyncio.create_task(c.stream(f"lender{tag}", ids(8, i), a.tokens))
              for i in range(a.rows)]
    await wait_rows(c, f"lender{tag}", a.rows, 60)
    await asyncio.sleep(a.wait)
    got = await newcomer(c, f"newcomer{tag}", 1)
    await hold(c, lender)
    return got


async def borrowed_kv(c: Clients, a, tag: str) -> dict[str, Any]:
    n = min(8, a.rows)
    each = a.kv_blocks * 16 // n  # the whole budget in n requests, each within the cap
    lender = [asyncio.create_task(c.stream(f"kvlender{tag}", ids(8, 100 + i), each - 8))
              for i in range(n)]
    await wait_rows(c, f"kvlender{tag}", n, 60)
    await asyncio.sleep(a.wait)
    got = await newcomer(c, f"kvnewcomer{tag}", 2)
    await hold(c, lender)
    return got


async def maximal(c: Clients, a, tag: str) -> dict[str, Any]:
    budget = a.kv_blocks * 16
    most = min(CONTEXT, budget // 2) - 8  # the server's largest max_tokens for 8 prompt tokens
    big = [asyncio.create_task(c.stream(f"max{i}{tag}", ids(8, 200 + i), most))
           for i in range(a.maximal)]
    await asyncio.sleep(a.wait)
    got = await newcomer(c, f"chat{tag}", 3)
    await hold(c, big)
    return got


async def flooders(c: Clients, a, tag: str) -> dict[str, Any]:
    stop = asyncio.Event()

    async def flood(tenant: str, k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            await c.stream(tenant, ids(8, 300 + 1000 * k + n), a.tokens)

    loops = [asyncio.create_task(flood(f"flooder{f}{tag}", f * a.rows + i))
             for f in range(a.flooders) for i in range(a.rows)]
    await asyncio.sleep(a.wait)
    got = await newcomer(c, f"innocent{tag}", 4)
    stop.set()
    await hold(c, loops)
    return got


async def class_script(c: Clients, a, tag: str, script: bool) -> dict[str, Any]:
    """Students chat one request at a time (a short think between); with `script`, one
    more tenant runs --script-loops loops. Students' first tokens, and the script's rows
    against its share (polled from the stats) and its part of the tokens."""
    stop, ttfts = asyncio.Event(), []
    students = [f"student{i}{tag}" for i in range(a.class_size)]

    async def student(name: str, k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            r = await c.stream(name, ids(16, 5000 + 100 * k + n), 24)
            if r["ttft_s"] is not None and not stop.is_set():
                ttfts.append(r["ttft_s"])
            await asyncio.sleep(a.think)

    async def loop(k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            await c.stream(f"script{tag}", ids(16, 90000 + 1000 * k + n), 128)

    before = (await c.stats())["usage"]["tenants"]
    tasks = [asyncio.create_task(student(s, k)) for k, s in enumerate(students)]
    if script:
        tasks += [asyncio.create_task(loop(k)) for k in range(a.script_loops)]
    held, shares, over = [], [], []
    deadline = time.monotonic() + a.class_seconds
    while time.monotonic() < deadline:
        table = (await c.stats()).get("shares", {})
        me = table.get(f"script{tag}")
        if me:
            held.append(me["rows"])
            shares.append(me["share_rows"])
        over += [t["rows"] / t["share_rows"] for n, t in table.items()
                 if n in students and t["share_rows"]]
        await asyncio.sleep(0.25)
    stop.set()
    await hold(c, tasks)
    after = (await c.stats())["usage"]["tenants"]
    made = {t: after.get(t, {}).get("output_tokens", 0) - before.get(t, {}).get("output_tokens", 0)
            for t in [*students, f"script{tag}"]}
    total = sum(made.values()) or 1
    return {"p90_s": percentile(ttfts, 90), "requests": len(ttfts),
            "script_rows": sum(held) / len(held) if held else 0.0,
            "script_share_rows": sum(shares) / len(shares) if shares else 0.0,
            "script_tokens": made[f"script{tag}"] / total,
            "student_rows_over_share_max": max(over, default=0.0)}


async def streams(c: Clients, a, tag: str) -> dict[str, Any]:
    got = await asyncio.gather(*(c.stream(f"student{i % a.class_size}{tag}", ids(8, 7000 + i), 8,
                                          address="127.0.0.1", session=f"s{i}")
                                 for i in range(a.streams)))
    await c.drained()
    return {"served": sum(g["ok"] for g in got), "of": a.streams,
            "transport_errors": sum("error" in g for g in got)}


def tenants(a) -> list[str]:
    """Every tenant the scenarios use (the class twice: alone, "a", beside the script, "b")."""
    names = ["idle", "lender", "newcomer", "kvlender", "kvnewcomer", "chat", "innocent",
             *(f"max{i}" for i in range(a.maximal)), *(f"flooder{f}" for f in range(a.flooders))]
    for run in ("a", "b", ""):
        names += [f"student{i}{run}" for i in range(a.class_size)] + [f"script{run}"]
    return names


async def run_all(servers: dict[str, Server], a) -> dict[str, dict[str, Any]]:
    """Every scenario, before then after on each (the same client, one run)."""
    clients = {side: Clients(srv) for side, srv in servers.items()}
    out: dict[str, dict[str, Any]] = {side: {} for side in servers}
    try:
        for side, c in clients.items():  # a newcomer to an idle server, for reference
            out[side]["idle"] = await newcomer(c, "idle", 0)
        for name in a.scenarios:
            for side, c in clients.items():
                if name == "class-script":
                    out[side]["class-alone"] = await class_script(c, a, "a", script=False)
                    out[side][name] = await class_script(c, a, "b", script=True)
                else:
                    fn = {"borrowed-rows": borrowed_rows, "borrowed-kv": borrowed_kv,
                          "maximal": maximal, "flooders": flooders, "streams": streams}[name]
                    out[side][name] = await fn(c, a, "")
                print(f"{side} {name}: {out[side][name]}", flush=True)
    finally:
        for c in clients.values():
            await c.close()
    return out


# ------------------------------------------------------------------ the table
def first_token(r: dict[str, Any]) -> str:
    if not r.get("ok") or r.get("ttft_s") is None:
        return "not served"
    return f"{r['ttft_s']:.2f} s ({r['ticks']} tick{'' if r['ticks'] == 1 else 's'})"


def table_rows(out: dict[str, dict[str, Any]], a) -> list[list[str]]:
    b, f = out["before"], out["after"]
    rows = [["a newcomer to an idle server", "first token", first_token(b["idle"]),
             first_token(f["idle"]), "—"]]
    what = {"borrowed-rows": (f"{a.rows} rows of {a.tokens} tokens lent to one tenant; a "
                              f"newcomer {a.wait:g} s later", "≤ 1 s (20 ticks)"),
            "borrowed-kv": (f"the whole KV budget ({a.kv_blocks * 16:,} tokens) lent to one "
                            f"tenant in {min(8, a.rows)} requests", "≤ 1 s (20 ticks)"),
            "maximal": (f"{a.maximal} tenants' maximal requests, then a short chat",
                        "≤ 1 s over idle"),
            "flooders": (f"{a.flooders} tenants flood ({a.rows} loops each); an innocent's chat",
                         "≤ 1 s (20 ticks)")}
    for name in a.scenarios:
        if name in what:
            rows.append([what[name][0], "first token", first_token(b[name]),
                         first_token(f[name]), what[name][1]])
        elif name == "class-script":
            rows.append([f"{a.class_size} students one request at a time, beside one's "
                         f"{a.script_loops}-loop script ({a.class_seconds:g} s each)",
                         "students' first token p90: alone / beside the script",
                         f"{b['class-alone']['p90_s']:.2f} / {b[name]['p90_s']:.2f} s",
                         f"{f['class-alone']['p90_s']:.2f} / {f[name]['p90_s']:.2f} s",
                         "≤ 1.5x alone"])
            rows.append(["", "the script's rows (its share), its part of all tokens",
                         f"{b[name]['script_rows']:.1f} ({b[name]['script_share_rows']:.1f}), "
                         f"{100 * b[name]['script_tokens']:.0f} %",
                         f"{f[name]['script_rows']:.1f} ({f[name]['script_share_rows']:.1f}), "
                         f"{100 * f[name]['script_tokens']:.0f} %", "—"])
        elif name == "streams":
            rows.append([f"{a.streams} keyed streams from one address", "served",
                         f"{b[name]['served']} of {b[name]['of']}"
                         + (f" ({b[name]['transport_errors']} transport errors)"
                            if b[name]["transport_errors"] else ""),
                         f"{f[name]['served']} of {f[name]['of']}"
                         + (f" ({f[name]['transport_errors']} transport errors)"
                            if f[name]["transport_errors"] else ""), "all"])
    return rows


def figures_of(out: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The figures other pages quote (docs/figures.json): per scenario run, before and after."""
    values: dict[str, float] = {}
    for side, runs in out.items():
        for name, r in runs.items():
            key = f"shares.{name.replace('-', '_')}_{side}"
            if "ttft_s" in r and r.get("ok"):
                values[f"{key}_ttft_s"] = round(r["ttft_s"], 2)
                values[f"{key}_ticks"] = r["ticks"]
            elif "p90_s" in r and r["p90_s"] is not None:
                values[f"{key}_p90_s"] = round(r["p90_s"], 2)
            elif "served" in r:
                values[f"{key}_served"] = r["served"]
    return values


@experiment("shares",
            option("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                   help="which scenarios to run (default: all six)"),
            option("--rows", type=at_least(2), default=64,
                   help="the server's batch rows (--max-batch-size), the rows lent in "
                        "borrowed-rows and each flooder's loops (default: 64, serve's own)"),
            option("--kv-blocks", type=at_least(2), default=2048,
                   help="the server's KV blocks of 16 tokens (--num-blocks; default: 2048, "
                        "serve's own: 32,768 tokens)"),
            option("--tokens", type=at_least(1), default=500,
                   help="max_tokens of a borrowed row and of a flooder's request (default 500)"),
            option("--wait", type=float, default=3.0,
                   help="seconds between the lender's start and the newcomer (default 3)"),
            option("--class-size", type=at_least(1), default=30, help="students (default 30)"),
            option("--script-loops", type=at_least(1), default=40,
                   help="the script's concurrent loops (default 40)"),
            option("--class-seconds", type=float, default=30.0,
                   help="how long the class chats, alone and beside the script (default 30 s)"),
            option("--think", type=float, default=0.5,
                   help="a student's pause between two requests (default 0.5 s)"),
            option("--maximal", type=at_least(1), default=8,
                   help="tenants sending a maximal request (default 8)"),
            option("--flooders", type=at_least(1), default=3, help="flooding tenants (default 3)"),
            option("--streams", type=at_least(1), default=90,
                   help="keyed streams from one address (default 90)"),
            option("--before-source", default=None, metavar="DIR",
                   help="run 'before' from this checkout's code (e.g. `git archive` of an "
                        "older commit) instead of this code with --reclaim off (default: none)"),
            threads=1, smallest=SMALLEST)
def shares(bench):
    """A newcomer to a lent machine, over the real CLI: before and after taking back (H6)."""
    a = bench.args
    flags = ["--max-batch-size", str(a.rows), "--num-blocks", str(a.kv_blocks)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        servers = {"before": Server("before", flags + ([] if a.before_source else
                                                         ["--reclaim", "off"]),
                                    tenants(a), folder, a.before_source),
                   "after": Server("after", flags, tenants(a), folder)}
        try:
            for srv in servers.values():
                srv.wait_up()
            out = asyncio.run(run_all(servers, a))
        finally:
            for srv in servers.values():
                srv.stop()
            for srv in servers.values():  # both at once: their shutdowns overlap
                srv.wait()
    before = ("another checkout's code (`--before-source`)" if a.before_source
              else "`--reclaim off`")
    command = ("minserve bench shares" + ("" if a.rows == 64 else f" --rows {a.rows}")
               + ("" if a.tokens == 500 else f" --tokens {a.tokens}")
               + (" --before-source DIR" if a.before_source else ""))
    bench.publish("shares", [
        "## Shares taken back: a newcomer to a lent machine", "",
        "A class's findings over the real CLI (docs/security.md): `python -m minserve serve` with a keys file "
        "and its defaults (fair policy, equal shares, mixed-batch prefill, "
        f"{a.rows} rows, {a.kv_blocks * 16:,} KV tokens, `--threads 1`) on a tiny random "
        "Llama with SmolLM2's tokenizer and 8,192 positions; streaming HTTP clients, each "
        f"tenant on a loopback address of its own. Before: {before}; after: the defaults "
        "(borrowed rows taken back). Both servers up side by side, each scenario run on one "
        f"then the other with the same client. `{command}` (one run):", "",
        *md_table(["scenario", "measured", "before", "after", "target"], table_rows(out, a))])
    bench.record(figures_of(out), command)
    return 0

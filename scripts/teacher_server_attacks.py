"""The teacher's server (docs/security.md, SPEC H7), attacked as a class would: one figure each.

    python scripts/teacher_server_attacks.py [NAME ...]    # every finding, a JSON line each

Each finding starts `python -m minserve serve` as a teacher starts it (a keys file, the
serving defaults) over a tiny random Llama saved with the real SmolLM2 tokenizer, and
talks to it over loopback sockets only (the same client before and after a fix). A
client that must look like another machine binds another loopback address (127.0.0.2,
...): Linux routes all of 127/8 to the loopback device. About three minutes on two
busy cores; docs/security.md gives the figures before and after.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
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
MODEL_DIR = Path(tempfile.gettempdir()) / "minserve-tiny-chat-1024"
KEYS = {"ms-alice-Q7fK2pX9vL3mT8wR": {"tenant": "alice"},
        "ms-mallory-Hd4Jw8Zq2Nc6Yb": {"tenant": "mallory"},
        "ms-teacher-Vx3Lp9Rk5Tg7Ws": {"tenant": "teacher", "may_set_priority": True,
                                      "may_read_all_stats": True}}
ALICE, MALLORY, TEACHER = list(KEYS)


def tiny_model_dir() -> Path:
    """A tiny random Llama (1,024 positions) with SmolLM2's tokenizer, as a folder
    `minserve serve --model` loads (made once)."""
    if not MODEL_DIR.exists():
        from transformers import AutoTokenizer

        from minserve.models import embedded_model_dir, tiny_llama

        part = Path(tempfile.mkdtemp(dir=MODEL_DIR.parent))  # renamed when complete
        tiny_llama(vocab_size=49152, max_positions=1024).save_pretrained(part)
        AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(part)
        os.replace(part, MODEL_DIR)
    return MODEL_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keys_with_reload_grant(keys: dict) -> dict:
    """The teacher's key with the grant to reload keys, where this code has that grant."""
    from minserve.server import access

    if "may_reload_keys" in getattr(access, "GRANTS", ()):
        keys = {k: ({**v, "may_reload_keys": True} if v["tenant"] == "teacher" else v)
                for k, v in keys.items()}
    return keys


class Cli:
    """A running `minserve serve`: its url, its output lines (stdout and stderr, as they
    come), and the keys file it reads."""

    def __init__(self, proc: subprocess.Popen, url: str, keys_file: Path) -> None:
        self.proc, self.url, self.keys_file = proc, url, keys_file
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def get(self, path: str, key: str | None = None, **kw) -> httpx.Response:
        headers = {**({"Authorization": f"Bearer {key}"} if key else {}),
                   **kw.pop("headers", {})}
        return httpx.get(self.url + path, headers=headers, timeout=kw.pop("timeout", 30), **kw)

    def post(self, path: str, key: str | None, body: dict, **kw) -> httpx.Response:
        headers = {**({"Authorization": f"Bearer {key}"} if key else {}),
                   **kw.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, json=body,
                          timeout=kw.pop("timeout", 60), **kw)


@contextmanager
def cli(*flags: str, keys: dict | None = None):
    """`python -m minserve serve --model <tiny> --api-keys-file keys.json FLAGS`, up."""
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.json"
        keys_file.write_text(json.dumps(keys_with_reload_grant(keys or KEYS), indent=1))
        port = free_port()
        cmd = [sys.executable, "-m", "minserve", "serve", "--model", str(tiny_model_dir()),
               "--port", str(port), "--api-keys-file", str(keys_file), "--threads", "1",
               "--log-level", "info", *flags]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                preexec_fn=_as_from_a_terminal)
        srv = Cli(proc, f"http://127.0.0.1:{port}", keys_file)
        try:
            wait_healthy(proc, srv.url, 120, said=lambda: "\n".join(srv.lines[-5:]),
                         probe_s=1)
            yield srv
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            srv.reader.join(5)


def _as_from_a_terminal() -> None:
    """SIGHUP as a shell leaves it (this script may run under nohup, which ignores it)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def from_address(address: str) -> httpx.Client:
    """An HTTP client whose connections come from `address` (a loopback address)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30)


def raw(url: str, address: str = "127.0.0.1") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10, source_address=(address, 0))


def completion(key: str, prompt, max_tokens: int, **body) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            **body}


# ============================================================== 1. usage per tenant
def usage_per_tenant() -> dict[str, Any]:
    """alice is served 4 requests; mallory is refused once for size, once by a gate
    (G3) and once for a priority it may not set. What do the teacher's stats say?"""
    with cli("--policy", "fair", "--num-blocks", "16", "--kv-budget-tokens", "4096") as srv:
        real = {"prompt_tokens": 0, "completion_tokens": 0}
        for i in range(4):
            u = srv.post("/v1/completions", ALICE, completion(ALICE, list(range(10, 22)), 10,
                                                              user=f"s{i}")).json()["usage"]
            real["prompt_tokens"] += u["prompt_tokens"]
            real["completion_tokens"] += u["completion_tokens"]
        refusals = [srv.post("/v1/completions", MALLORY, b).status_code for b in (
            completion(MALLORY, [1] * 10, 2100),               # size: over the request cap
            completion(MALLORY, list(range(1, 301)), 4),       # G3: 19 blocks of a 16-block pool
            completion(MALLORY, [1, 2], 2, priority=3))]      # auth: priority not granted
        stats = srv.get("/scheduler/stats", TEACHER).json()
        csv = srv.get("/scheduler/usage.csv", TEACHER)
        own = srv.get("/scheduler/stats", ALICE).json()
    usage = (stats.get("usage") or {}).get("tenants") or {}
    return {"alice_real_tokens": real, "mallory_statuses": refusals,
            "teacher_stats_has_usage": bool(usage),
            "alice_fair_counter_shown": (stats.get("policy") or {}).get("counters", {}).get("alice"),
            "usage_alice": usage.get("alice"), "usage_mallory_refused":
                (usage.get("mallory") or {}).get("refused"),
            "refusals_counted_anywhere": stats.get("rejected"),
            "csv_status": csv.status_code, "csv_head": csv.text.splitlines()[:1]
            if csv.status_code == 200 else None,
            "alice_sees_tenants": sorted((own.get("usage") or {}).get("tenants") or {})}


def access_log() -> dict[str, Any]:
    """Who does the access log name? A forged X-Forwarded-For, a key in the query string."""
    with cli() as srv:
        srv.post("/v1/completions", ALICE, completion(ALICE, [5, 6], 2),
                 headers={"X-Forwarded-For": "6.6.6.6"})
        query = httpx.get(srv.url + f"/v1/models?api_key={MALLORY}", timeout=10).status_code
        time.sleep(0.5)
        lines = list(srv.lines)
    requests = [ln for ln in lines if "/v1/" in ln]
    return {"access_lines": requests[-2:],
            "a_line_names_alice": any("alice" in ln for ln in requests),
            "forged_address_logged": any("6.6.6.6" in ln for ln in lines),
            "query_key_status": query,
            "query_key_in_log": any(MALLORY in ln for ln in lines),
            "any_key_in_log": any(k in ln for k in KEYS for ln in lines)}


# ============================================================== 2. keys without a restart
def sighup_reload() -> dict[str, Any]:
    """Mid-stream, the teacher adds dave, removes mallory and sends SIGHUP; then
    writes a broken file and sends SIGHUP again."""
    out: dict[str, Any] = {}
    with cli("--max-model-len", "1024") as srv:
        srv.post("/v1/completions", ALICE, completion(ALICE, [3, 4], 6))
        before = (srv.get("/scheduler/stats", TEACHER).json().get("usage") or {}).get("tenants")
        lines: list[str] = []

        def stream():
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                                  headers={"Authorization": f"Bearer {ALICE}"},
                                  json={**completion(ALICE, [7], 1000), "stream": True}) as r:
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
            except httpx.HTTPError as e:
                lines.append(f"client error: {type(e).__name__}")

        t = threading.Thread(target=stream)
        t.start()
        while len(lines) < 3 and t.is_alive():
            time.sleep(0.01)
        keys = {k: v for k, v in KEYS.items() if v["tenant"] != "mallory"}
        dave = "ms-dave-Fp8Kc3Xn6Rb2Qm"
        keys[dave] = {"tenant": "dave"}
        srv.keys_file.write_text(json.dumps(keys_with_reload_grant(keys)))
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        t.join(60)
        out["exit_code_after_sighup"] = srv.proc.poll()
        out["stream_ended_with_done"] = bool(lines) and lines[-1] == "data: [DONE]"
        out["stream_chunks"] = len(lines)
        if srv.proc.poll() is None:
            out["dave_status"] = srv.get("/v1/models", dave).status_code
            out["mallory_status"] = srv.get("/v1/models", MALLORY).status_code
            after = (srv.get("/scheduler/stats", TEACHER).json().get("usage") or {}).get("tenants")
            out["alice_usage_before_after"] = [
                (before or {}).get("alice", {}).get("output_tokens"),
                (after or {}).get("alice", {}).get("output_tokens")]
            srv.keys_file.write_text('{"ms-broken-key-entry": ')
            srv.proc.send_signal(signal.SIGHUP)
            time.sleep(1.0)
            out["alive_after_bad_file"] = srv.proc.poll() is None
            if srv.proc.poll() is None:
                out["dave_status_after_bad_file"] = srv.get("/v1/models", dave).status_code
                r = srv.post("/admin/reload-keys", TEACHER, {})
                out["admin_reload_bad_file"] = [r.status_code, r.text[:160]]
            out["reload_log"] = [ln for ln in srv.lines if "keys" in ln.lower()][-3:]
        out["s_to_signal_effect"] = round(time.monotonic() - t0, 2)
    return out


# ============================================================== 3. the keys file
def keys_file_traps() -> dict[str, Any]:
    """Each trap in a keys file, given to `minserve serve` (a model that does not exist:
    a file that is accepted goes on to load it)."""
    good = "Q7fK2pX9vL3mT8wRz4Yc"
    cases = {
        "duplicate": '{\n "Kq9Xw2Lp7Rt3Vb6Ns1Jd": {"tenant": "alice"},\n'
                     ' "Kq9Xw2Lp7Rt3Vb6Ns1Jd": {"tenant": "bob"}\n}',
        "trailing_space": json.dumps({good: {"tenant": "alice"},
                                      "Zr5Tn8Wq2Kd7HxPm3Lf ": {"tenant": "bob"}}, indent=1),
        "non_ascii": json.dumps({good: {"tenant": "alice"},
                                 "Zr5Tn8Wq2Kd7clé9Gh4Bv": {"tenant": "bob"}},
                                ensure_ascii=False, indent=1),
        "eight_chars": json.dumps({good: {"tenant": "alice"}, "bob12345": {"tenant": "bob"}},
                                  indent=1),
        "weak_16": json.dumps({good: {"tenant": "alice"}, "aaaaaaaaaaaaaaaa": {"tenant": "bob"}},
                              indent=1),
        "bad_tenant": json.dumps({good: {"tenant": "alice"}, "Wm4Ry7Tb2Xk9Pq5Lz3": {"tenant": "b/b"}},
                                 indent=1),
    }
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in cases.items():
            f = Path(tmp) / f"{name}.json"
            f.write_text(text, encoding="utf-8")
            r = subprocess.run([sys.executable, "-m", "minserve", "serve", "--api-keys-file",
                                str(f), "--model", "/nonexistent", "--port", "0"],
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
            keys = [k for k in json.loads(text, object_pairs_hook=list)]
            secret_bits = {k[0][i:i + 4] for k in keys for i in range(len(k[0]) - 3)}
            err = r.stderr.strip().splitlines()
            out[name] = {"refused_before_loading": "loading" not in r.stderr,
                         "message": err[-1][:200] if err else "",
                         "echoes_key_characters": any(b in r.stderr for b in secret_bits
                                                      if b.strip() and b != "aaaa")}
        r = subprocess.run([sys.executable, "-m", "minserve", "keys", "new", "--tenants",
                            "alice,bob"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        out["keys_new"] = {"rc": r.returncode}
        if r.returncode == 0:
            made = json.loads(r.stdout)
            out["keys_new"].update(tenants=sorted(v["tenant"] for v in made.values()),
                                   key_chars=sorted({len(k) for k in made}))
    return out


# ============================================================== 4. before authentication
def connection_flood(n: int = 528) -> dict[str, Any]:
    """127.0.0.2 opens `n` connections that send half a request line and no key."""
    with cli() as srv:
        mark = len(srv.lines)
        held, refused = [], 0
        for _ in range(n):
            try:
                s = raw(srv.url, "127.0.0.2")
                s.sendall(b"GET /v1/mod")
                held.append(s)
            except OSError:
                refused += 1
        time.sleep(1.0)
        closed = 0
        for s in held:  # which of them has the server closed (or answered) by now?
            s.setblocking(False)
            try:
                closed += s.recv(1 << 16) is not None
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        try:
            health = httpx.get(srv.url + "/health", timeout=5).status_code
        except httpx.HTTPError as e:
            health = type(e).__name__
        try:
            other = srv.get("/v1/models", ALICE, timeout=5).status_code
        except httpx.HTTPError as e:
            other = type(e).__name__
        logged = srv.lines[mark:]
        for s in held:
            s.close()
    return {"attack": f"{n} half request lines from 127.0.0.2", "connect_refused": refused,
            "closed_by_server_within_1s": closed, "health_from_127.0.0.1": health,
            "alice_from_127.0.0.1": other, "log_lines_during": len(logged),
            "log_sample": logged[-2:]}


def health_reserve(max_connections: int = 16) -> dict[str, Any]:
    """16 addresses together hold max_connections + 16 idle connections (the reserve
    included); then: /health, and a non-health request made on a reserve connection."""
    with cli("--max-connections", str(max_connections)) as srv:
        held = []
        for i in range(max_connections + 16):
            try:
                held.append(raw(srv.url, f"127.0.1.{1 + i % 16}"))
            except OSError:
                pass
        time.sleep(2.5)
        try:
            health = httpx.get(srv.url + "/health", timeout=5).status_code
        except httpx.HTTPError as e:
            health = type(e).__name__
        for s in held:
            s.close()
        time.sleep(0.5)
        # max_connections connections from 4 addresses, then a keyed request beyond them
        busy = [raw(srv.url, f"127.0.2.{1 + i % 4}") for i in range(max_connections)]
        time.sleep(0.5)
        extra = raw(srv.url, "127.0.0.1")
        extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      + ALICE.encode() + b"\r\n\r\n")
        extra.settimeout(5)
        try:
            status = extra.recv(4096).split(b"\r\n")[0].decode()
        except OSError as e:
            status = type(e).__name__
        for s in [*busy, extra]:
            s.close()
    return {"attack": f"{max_connections + 16} idle connections of max_connections="
                      f"{max_connections} from 16 addresses",
            "health_after_2.5s": health, "non_health_request_in_the_reserve": status}


def key_guessing(n: int = 2000) -> dict[str, Any]:
    """127.0.0.2 tries `n` wrong keys as fast as one keep-alive connection allows."""
    with cli() as srv:
        mark = len(srv.lines)
        statuses: dict[int, int] = {}
        retry_after = None
        t0 = time.monotonic()
        with from_address("127.0.0.2") as c:
            for i in range(n):
                r = c.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer ms-guess-{i:012d}"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                retry_after = retry_after or r.headers.get("retry-after")
            elapsed = time.monotonic() - t0
            right_same_address = c.get(srv.url + "/v1/models",
                                       headers={"Authorization": f"Bearer {ALICE}"}).status_code
        right_other = srv.get("/v1/models", ALICE).status_code
        time.sleep(0.5)
        logged = srv.lines[mark:]
    return {"attack": f"{n} wrong keys from 127.0.0.2", "seconds": round(elapsed, 2),
            "statuses": statuses, "retry_after": retry_after,
            "log_lines": len(logged), "log_sample": logged[-2:],
            "right_key_same_address_then": right_same_address,
            "right_key_127.0.0.1_then": right_other}


# ============================================================== 5. charge the work
def uncharged_tokenizing(loops: int = 12, chars: int = 199_000) -> dict[str, Any]:
    """12 loops send a chat of 199,000 characters (refused: longer than the context);
    alice's first token, streamed, before and during."""
    text = ("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[:chars]

    with cli() as srv:
        quiet = _ttft(srv)
        stop, threads, statuses, messages = _mallory_loops(srv, text, loops)
        cpu0 = _proc_cpu(srv.proc.pid)
        busy = _ttft(srv)
        cpu = round(_proc_cpu(srv.proc.pid) - cpu0, 2)
        stop.set()
        for t in threads:
            t.join()
        usage = (srv.get("/scheduler/stats", TEACHER).json().get("usage") or {}).get("tenants")
    return {"attack": f"{loops} loops of a {chars:,}-character chat",
            "alice_ttft_quiet_s": quiet, "alice_ttft_under_attack_s": busy,
            "mallory_statuses": statuses, "refusal_messages": sorted(messages)[:3],
            "server_cpu_s_while_alice_measured": cpu,
            "mallory_usage": (usage or {}).get("mallory")}


def unprovable_tokenizing(loops: int = 12, chars: int = 60_000) -> dict[str, Any]:
    """The same loops with a text no bound proves too long (random letters, no space:
    at least 741 tokens by its bytes, 44,000 in fact, on a 1,024-token context): it must
    be tokenized to be refused. The tenant's tokenizer budget is what is left."""
    import random

    rng = random.Random(0)
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
                   for _ in range(chars))
    with cli() as srv:
        quiet = _ttft(srv)
        stop, threads, statuses, _ = _mallory_loops(srv, text, loops)
        cpu0, t0 = _proc_cpu(srv.proc.pid), time.monotonic()
        busy = _ttft(srv)
        cpu = (_proc_cpu(srv.proc.pid) - cpu0) / (time.monotonic() - t0)
        stop.set()
        for t in threads:
            t.join()
        usage = (srv.get("/scheduler/stats", TEACHER).json().get("usage") or {}).get("tenants")
    return {"attack": f"{loops} loops of a {chars:,}-letter chat without spaces",
            "alice_ttft_quiet_s": quiet, "alice_ttft_under_attack_s": busy,
            "mallory_statuses": statuses, "server_cpu_cores_while_alice_measured": round(cpu, 2),
            "mallory_tokenizer_s": ((usage or {}).get("mallory") or {}).get("tokenizer_s")}


def _mallory_loops(srv, text: str, loops: int):
    """`loops` threads send mallory's chat of `text` again and again until `stop` is set;
    started, and given 2 s to load the server. Returns (stop, threads, statuses by code,
    the first 150 characters of each distinct error message)."""
    stop, statuses, messages = threading.Event(), {}, set()

    def loop():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                r = c.post(srv.url + "/v1/chat/completions",
                           headers={"Authorization": f"Bearer {MALLORY}"},
                           json={"messages": [{"role": "user", "content": text}]})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                try:
                    messages.add(r.json()["error"]["message"][:150])
                except (ValueError, KeyError):
                    pass

    threads = [threading.Thread(target=loop) for _ in range(loops)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    return stop, threads, statuses, messages


def _ttft(srv, n: int = 7) -> float:
    """alice's median time to her first streamed token, over `n` small chats."""
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {ALICE}"},
                          json={"messages": [{"role": "user", "content": "Hi there"}],
                                "max_tokens": 2, "stream": True}) as r:
            for line in r.iter_lines():
                if '"content"' in line and '"content": ""' not in line:
                    break
        times.append(time.monotonic() - t0)
    return round(statistics.median(times), 3)


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def refusal_advice() -> dict[str, Any]:
    """A 600-token prompt where one request may reserve 500 tokens: what does the 400 advise?"""
    with cli("--kv-budget-tokens", "1000") as srv:
        r = srv.post("/v1/completions", ALICE, completion(ALICE, [1] * 600, 10))
        chat = srv.post("/v1/chat/completions", ALICE,
                        {"messages": [{"role": "user", "content": "word " * 700}],
                         "max_tokens": 10})
    return {"prompt_600_ids": [r.status_code, r.json()["error"]["message"]],
            "chat_700_words": [chat.status_code, chat.json()["error"]["message"]]}


# ============================================================== 6. explain
def explain_leaks() -> dict[str, Any]:
    """mallory's head waits on G2 (it needs 170 tokens of KV) behind two running requests
    of its own; alice's requests wait behind it, one in the session `default`, one as
    `user: José`. What does alice's explain sentence say of mallory's request?"""
    out: dict[str, Any] = {}
    with cli("--kv-budget-tokens", "1000", "--max-tenant-kv-share", "1",
             "--max-model-len", "1024") as srv:
        def send(key, body, **kw):
            return threading.Thread(target=srv.post, args=("/v1/completions", key, body),
                                    kwargs={"timeout": 300, **kw})

        run = [send(MALLORY, completion(MALLORY, [9], 440)) for _ in range(2)]
        for t in run:
            t.start()
        time.sleep(0.3)
        head = send(MALLORY, completion(MALLORY, [8] * 10, 160))
        head.start()
        time.sleep(0.2)
        mine = [send(ALICE, completion(ALICE, [3], 2), headers={"X-Request-Id": "a-1"}),
                send(ALICE, completion(ALICE, [3], 2, user="José"),
                     headers={"X-Request-Id": "a-2"})]
        for t in mine:
            t.start()
        deadline, seen = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            ex = srv.get("/scheduler/explain/a-1", ALICE).json()
            if ex.get("state") == "pending" and ex.get("position", 0) > 0:
                seen = ex
                by_body = srv.post("/scheduler/explain/a-2", ALICE, {"user": "José"})
                out["explain_a_user_jose_by_body"] = [by_body.status_code, by_body.json().get(
                    "state") or by_body.json().get("error", {}).get("code")]
                break
            time.sleep(0.05)
        out["alice_sentence"] = (seen or {}).get("sentence")
        out["sentence_names_the_heads_need"] = bool(seen) and "170" in seen["sentence"]
        for t in (*run, head, *mine):
            t.join()
        utf8 = httpx.post(srv.url + "/v1/completions", timeout=30, json=completion(ALICE, [3], 1),
                          headers={"Authorization": f"Bearer {ALICE}",
                                   "X-Session-Id": "José".encode()})
        body = utf8.json()
        out["utf8_session_header"] = [utf8.status_code, (body.get("minserve") or {}).get(
            "session") or body.get("error", {}).get("message", "")[:120]]
    return out


ATTACKS = [usage_per_tenant, access_log, sighup_reload, keys_file_traps, connection_flood,
           health_reserve, key_guessing, uncharged_tokenizing, unprovable_tokenizing,
           refusal_advice, explain_leaks]


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or [a.__name__ for a in ATTACKS]
    for attack in ATTACKS:
        if attack.__name__ in names:
            t0 = time.monotonic()
            try:
                result = attack()
            except Exception as e:  # an attack the old code cannot even run: say so
                result = {"error": repr(e)[:300]}
            print(json.dumps({"name": attack.__name__, **result,
                              "took_s": round(time.monotonic() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

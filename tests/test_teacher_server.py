"""The teacher's server (SPEC H7, docs/security.md), as a teacher runs it: `python -m minserve
serve --api-keys-file keys.json`, a real process on loopback, its log read as it writes it.

One server for the module (a tiny random Llama saved with SmolLM2's tokenizer): usage per
tenant in real tokens and refusals by reason, the access log, then the keys reloaded by
SIGHUP and by the teacher's endpoint while a stream runs (last: it changes the keys).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from minserve.bench.health import wait_healthy

from .test_server import wait_until

ROOT = Path(__file__).resolve().parents[1]
ALICE, MALLORY, TEACHER = "ms-alice-Q7fK2pX9vL3m", "ms-mallory-Hd4Jw8Zq2N", "ms-teacher-Vx3Lp9Rk5T"
DAVE = "ms-dave-Fp8Kc3Xn6Rb2Qm"
KEYS = {ALICE: {"tenant": "alice"}, MALLORY: {"tenant": "mallory"},
        "ms-bob-Zr5Tn8Wq2Kd7Hx": {"tenant": "bob"},
        TEACHER: {"tenant": "teacher", "may_set_priority": True, "may_read_all_stats": True,
                  "may_reload_keys": True}}


class Served:
    def __init__(self, proc, url, keys_file):
        self.proc, self.url, self.keys_file, self.lines = proc, url, keys_file, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for raw in self.proc.stdout:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def call(self, method, path, key=None, **kw):
        headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **kw.pop("headers", {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=60, **kw)

    def complete(self, key, prompt, max_tokens, headers=None, **body):
        return self.call("POST", "/v1/completions", key, headers=headers or {}, json={
            "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **body})

    def usage(self, key=TEACHER):
        return self.call("GET", "/scheduler/stats", key).json()["usage"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from minserve.models import embedded_model_dir, tiny_llama

    tmp = tmp_path_factory.mktemp("teacher")
    model = tmp / "model"
    tiny_llama(vocab_size=49152, max_positions=1024).save_pretrained(model)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(model)
    keys_file = tmp / "keys.json"
    keys_file.write_text(json.dumps(KEYS, indent=1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "minserve", "serve", "--model", str(model), "--port", str(port),
         "--api-keys-file", str(keys_file), "--threads", "1", "--log-level", "info",
         "--kv-budget-tokens", "900", "--max-request-kv-share", "1",
         "--max-tenant-kv-share", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # as from a shell
    srv = Served(proc, f"http://127.0.0.1:{port}", keys_file)

    try:
        wait_healthy(proc, srv.url, 120, probe_s=1, said=lambda: "\n".join(srv.lines))
        yield srv
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        finally:
            proc.kill()


def test_usage_per_tenant_is_real_tokens_and_each_refusal_counted_by_reason(served):
    sent = {"prompt_tokens": 0, "output_tokens": 0}
    for i in range(3):
        u = served.complete(ALICE, list(range(10, 22)), 5 + i).json()["usage"]
        sent["prompt_tokens"] += u["prompt_tokens"]
        sent["output_tokens"] += u["completion_tokens"]
    assert served.complete(MALLORY, [1] * 10, 2100).status_code == 400  # size
    assert served.complete(MALLORY, [1] * 10, 1000).status_code == 429  # G2: 1010 > 900, ever
    assert served.complete(MALLORY, [1, 2], 2, priority=3).status_code == 403  # auth: no grant
    wait_until(lambda: served.usage()["tenants"]["alice"]["requests_finished"] == 3,
               what="the ledger to book alice's requests")
    usage = served.usage()
    alice = usage["tenants"]["alice"]
    assert {k: alice[k] for k in sent} == sent  # what each response said, not a virtual counter
    assert alice["finish_reasons"] == {"length": 3} and alice["tokenizer_s"] > 0
    assert usage["tenants"]["mallory"]["refused"] == {"gate": 1, "size": 1, "auth": 1,
                                                      "rate": 0, "invalid": 0}
    assert usage["tenants"]["mallory"]["requests_finished"] == 0  # a refusal is not served
    assert usage["tenants"]["bob"]["requests_finished"] == 0  # every tenant of the file
    own = served.usage(ALICE)  # a student sees its own row only
    assert set(own["tenants"]) == {"alice"} and "unauthenticated" not in own
    csv = served.call("GET", "/scheduler/usage.csv", TEACHER)
    rows = {line.split(",")[0]: line.split(",") for line in csv.text.splitlines()}
    assert csv.headers["content-type"].startswith("text/csv")
    assert rows["alice"][1:4] == [str(sent["prompt_tokens"]), "0", str(sent["output_tokens"])]
    assert set(rows) == {"tenant", "alice", "bob", "mallory", "teacher"}


def test_the_access_log_names_the_tenant_and_the_socket_never_a_key(served):
    mark = len(served.lines)
    assert served.complete(ALICE, [5, 6], 1, user="lab-3",
                           headers={"X-Forwarded-For": "6.6.6.6"}).status_code == 200
    r = served.call("GET", f"/v1/models?api_key={MALLORY}")
    assert r.status_code == 400 and r.json()["error"]["code"] == "key_in_query"
    wait_until(lambda: len(served.lines) >= mark + 2, what="the access log lines")
    time.sleep(0.3)
    lines = served.lines[mark:]
    assert any('127.0.0.1 alice "POST /v1/completions" 200' in ln for ln in lines), lines
    assert any('127.0.0.1 - "GET /v1/models?…" 400' in ln for ln in lines), lines
    assert not any("6.6.6.6" in ln for ln in served.lines)  # before: the forged address
    assert not any(k in ln for k in KEYS for ln in served.lines)  # before: ?api_key= in clear


def test_sighup_reloads_the_keys_while_a_stream_runs_and_a_bad_file_changes_nothing(served):
    before = served.usage()["tenants"]["alice"]["output_tokens"]
    lines: list[str] = []

    def stream():
        with httpx.stream("POST", served.url + "/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {MALLORY}"},
                          json={"prompt": [7], "max_tokens": 300, "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True}}) as r:
            lines.extend(line for line in r.iter_lines() if line)

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: len(lines) >= 2, timeout=60, what="the stream to start")
    keys = {k: v for k, v in KEYS.items() if v["tenant"] != "mallory"}
    served.keys_file.write_text(json.dumps({**keys, DAVE: {"tenant": "dave"}}))
    mark = len(served.lines)
    served.proc.send_signal(signal.SIGHUP)  # before: the process died (exit 129), stream cut
    wait_until(lambda: served.call("GET", "/v1/models", DAVE).status_code == 200,
               what="dave's new key to work")
    assert lines[-1] != "data: [DONE]"  # mallory's stream still runs...
    assert served.call("GET", "/v1/models", MALLORY).status_code == 401  # ...her new ones: 401
    t.join(120)
    assert served.proc.poll() is None and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 300
    assert served.usage()["tenants"]["alice"]["output_tokens"] == before  # usage survives
    assert any("tenants added: dave; removed: mallory" in ln for ln in served.lines[mark:])

    served.keys_file.write_text(  # dave's key twice: the last would silently win
        f'{{\n "{ALICE}": {{"tenant": "alice"}},\n "{DAVE}": {{"tenant": "dave"}},\n'
        f' "{TEACHER}": {json.dumps(KEYS[TEACHER])},\n "{DAVE}": {{"tenant": "eve"}}\n}}')
    mark = len(served.lines)
    served.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: any("NOT reloaded" in ln for ln in served.lines[mark:]),
               what="the refusal in the log")
    refusal = next(ln for ln in served.lines[mark:] if "NOT reloaded" in ln)
    assert "line 5 (tenant 'eve'): the same key as line 3 (tenant 'dave')" in refusal
    assert not any(k in ln for k in (*KEYS, DAVE) for ln in served.lines)
    assert served.call("GET", "/v1/models", DAVE).status_code == 200  # the old keys stay
    assert served.call("GET", "/v1/models", TEACHER).status_code == 200

    r = served.call("POST", "/admin/reload-keys", TEACHER)
    assert r.status_code == 400 and "line 5" in r.json()["error"]["message"]
    assert served.call("POST", "/admin/reload-keys", DAVE).status_code == 403
    served.keys_file.write_text(json.dumps(KEYS))
    r = served.call("POST", "/admin/reload-keys", TEACHER)
    assert r.status_code == 200 and r.json()["tenants_removed"] == ["dave"]
    assert served.call("GET", "/v1/models", DAVE).status_code == 401

"""A keys file is strict (SPEC H7, docs/security.md): every trap is refused at load with the
line that is wrong and no character of any key; `minserve keys new` makes strong keys."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from minserve.__main__ import main
from minserve.bench.health import wait_healthy
from minserve.server.keys import KeyRing, load_api_keys

from .test_server import wait_until

ROOT = Path(__file__).resolve().parents[1]

GOOD = "Q7fK2pX9vL3mT8wRz4Yc"
OTHER = "Zr5Tn8Wq2Kd7HxPm3Lf1"


def entries(*pairs) -> str:
    """A keys file, one entry per line: line 1 is '{', the first entry line 2, ..."""
    return "{\n" + ",\n".join(f" {json.dumps(k, ensure_ascii=False)}: {json.dumps(v)}"
                              for k, v in pairs) + "\n}\n"


@pytest.mark.parametrize("trap, bad_key, says", [
    ("duplicate", GOOD, "line 3 (tenant 'bob'): the same key as line 2 (tenant 'alice')"),
    ("trailing space", OTHER + " ", "line 3 (tenant 'bob'): the key has whitespace"),
    ("non-ASCII", "Zr5Tn8Wq2Kd7clé9Gh4Bv", "line 3 (tenant 'bob'): character 15 of the key"),
    ("8 characters", "Zr5Tn8Wq", "line 3 (tenant 'bob'): the key has 8 characters; use 16"),
    ("repetitive", "ab" * 10, "line 3 (tenant 'bob'): the key uses only 2 different"),
    ("bad tenant", OTHER, "line 3: tenant 'b/b'"),
])
def test_each_trap_of_a_keys_file_is_refused_naming_its_line_and_no_key(tmp_path, capsys,
                                                                       trap, bad_key, says):
    tenant = "b/b" if trap == "bad tenant" else "bob"
    f = tmp_path / "keys.json"
    f.write_text(entries((GOOD, {"tenant": "alice"}), (bad_key, {"tenant": tenant})),
                 encoding="utf-8")
    with pytest.raises(ValueError) as e:
        load_api_keys(str(f))  # before: the first four were accepted
    message = str(e.value)
    assert says in message
    for key in (GOOD, bad_key):  # before: "key Wm4R...: tenant 'b/b'"
        assert not any(key[i:i + 4] in message for i in range(len(key) - 3)), message
    # and `serve` stops on it before loading a model (the model here does not exist)
    assert main(["serve", "--api-keys-file", str(f), "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert says in err and "loading" not in err


def test_keys_new_makes_strong_keys_a_teacher_and_merges_into_a_file(tmp_path, capsys):
    assert main(["keys", "new", "--tenants", "alice,bob", "--teacher", "ms"]) == 0
    made = json.loads(capsys.readouterr().out)
    f = tmp_path / "keys.json"
    f.write_text(json.dumps(made))
    keys = load_api_keys(str(f))  # what `serve` accepts
    assert sorted(t.name for t in keys.values()) == ["alice", "bob", "ms"]
    assert all(len(k) >= 32 and len(set(k)) >= 8 for k in keys)
    teacher = next(t for t in keys.values() if t.name == "ms")
    assert teacher.may_read_all_stats and teacher.may_reload_keys and teacher.may_set_priority
    assert not any(t.may_read_all_stats for t in keys.values() if t.name != "ms")
    assert main(["keys", "new", "--tenants", "carol", "--merge", str(f)]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert made.items() <= merged.items() and len(merged) == 4
    assert main(["keys", "new", "--tenants", "alice,alice"]) == 2
    assert main(["keys", "check", str(f)]) == 0
    assert "3 keys, 3 tenants" in capsys.readouterr().out


def test_a_refused_reload_keeps_every_old_key_and_a_good_one_swaps_them_whole(tmp_path):
    f = tmp_path / "keys.json"
    f.write_text(entries((GOOD, {"tenant": "alice"}), (OTHER, {"tenant": "bob"})))
    ring = KeyRing(load_api_keys(str(f)), str(f))
    before = ring.pairs
    f.write_text(entries((GOOD, {"tenant": "alice"}), (GOOD, {"tenant": "eve"})))
    with pytest.raises(ValueError, match="line 3"):
        ring.reload()
    assert ring.pairs is before and ring.reloads == 0
    f.write_text(entries((GOOD, {"tenant": "alice"}), ("ms-" + OTHER, {"tenant": "carol"})))
    summary = ring.reload()
    assert summary["tenants_added"] == ["carol"] and summary["tenants_removed"] == ["bob"]
    assert summary["keys_added"] == 1 and summary["keys_removed"] == 1
    assert {t.name for _, t in ring.pairs} == {"alice", "carol"} and before is not ring.pairs


def test_keys_new_in_place_adds_students_without_ever_emptying_the_file(tmp_path, capsys):
    """`minserve keys new --merge keys.json > keys.json` left keys.json empty (the shell
    truncates it before the program runs). --in-place (and --output) write a temporary file
    and rename it: the file holds the old keys or the new ones, never nothing; owner-only,
    and a write that fails leaves the old file as it was."""
    f = tmp_path / "keys.json"
    assert main(["keys", "new", "--tenants", "alice,bob", "--output", str(f)]) == 0
    assert capsys.readouterr().out == ""  # the keys went to the file, not the terminal
    assert oct(f.stat().st_mode & 0o777) == oct(0o600)
    before = json.loads(f.read_text())
    inode = f.stat().st_ino
    assert main(["keys", "new", "--tenants", "carol", "--merge", str(f), "--in-place"]) == 0
    after = json.loads(f.read_text())
    assert before.items() <= after.items() and len(after) == 3
    assert f.stat().st_ino != inode  # renamed over it, not rewritten in place
    assert sorted(t.name for t in load_api_keys(str(f)).values()) == ["alice", "bob", "carol"]
    assert main(["keys", "new", "--tenants", "b/b", "--merge", str(f), "--in-place"]) == 2
    assert main(["keys", "new", "--tenants", "dave", "--in-place"]) == 2  # no --merge file
    assert json.loads(f.read_text()) == after  # refusals leave the file as it was
    assert list(tmp_path.iterdir()) == [f]  # no temporary file left behind
    with pytest.raises(SystemExit):
        main(["keys", "new", "--help"])
    assert "empties keys.json" in capsys.readouterr().out


def test_sighup_while_the_model_loads_is_deferred_not_fatal(tmp_path):
    """SIGHUP during `minserve serve`'s model load killed it (exit 129, nothing logged).
    Now it is noted and the keys file read again once the server is up: a key added
    while the model loaded works."""
    from transformers import AutoTokenizer

    from minserve.models import embedded_model_dir, tiny_llama

    model = tmp_path / "model"
    tiny_llama(vocab_size=49152, max_positions=256).save_pretrained(model)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(model)
    alice, dave = "ms-alice-Q7fK2pX9vL3m", "ms-dave-Fp8Kc3Xn6Rb2Qm"
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({alice: {"tenant": "alice"}}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "minserve", "serve", "--model", str(model), "--port", str(port),
         "--api-keys-file", str(keys), "--threads", "1"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # as from a shell
    lines = []
    try:
        for raw in proc.stdout:  # until the model starts loading
            lines.append(raw.decode())
            if lines[-1].startswith("loading "):
                break
        keys.write_text(json.dumps({alice: {"tenant": "alice"}, dave: {"tenant": "dave"}}))
        proc.send_signal(signal.SIGHUP)
        threading.Thread(target=lambda: lines.extend(r.decode() for r in proc.stdout),
                         daemon=True).start()
        url = f"http://127.0.0.1:{port}"

        wait_healthy(proc, url, 120, probe_s=1, said=lambda: "".join(lines))  # before: exit 129
        wait_until(lambda: any("keys reloaded" in ln for ln in lines), what="the reload")
        assert any("SIGHUP while the server starts: deferred" in ln for ln in lines)
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {dave}"},
                         timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        finally:
            proc.kill()

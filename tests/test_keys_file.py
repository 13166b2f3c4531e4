"""A keys file is strict (SPEC H7, docs/security.md): every trap is refused at load with the
line that is wrong and no character of any key; `minserve keys new` makes strong keys."""

from __future__ import annotations

import json

import pytest

from minserve.__main__ import main
from minserve.server.keys import KeyRing, load_api_keys

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

"""The keys file: strict at load, reloaded without a restart, generated (SPEC H5, H7).

    minserve keys new --tenants alice,bob --teacher teacher --output keys.json
    minserve serve --api-keys-file keys.json
    minserve keys new --tenants dave --merge keys.json --in-place
    kill -HUP <pid>                      # or POST /admin/reload-keys with the teacher's key

Never `minserve keys new --merge keys.json > keys.json`: the shell empties keys.json
before the program runs, so there is nothing left to merge (it exits 2 and leaves the
file empty, and the next restart of the server fails). `--output` and `--in-place`
write a temporary file beside the target and rename it over the target (`write_keys`):
a reader (a reload, a restart) sees the old file or the new one, never an empty or a
half-written one.

A keys file is read line by line in the sense that every refusal names the line that
is wrong, and never a character of any key (an error message ends up in terminals,
logs and screenshots). A file is refused, whole, when:

    a key appears twice          json.load would keep the last entry: one student
                                 would silently become another
    a key has whitespace around  no client sends it that way: it could never authenticate
    a key is not printable ASCII HTTP header values are bytes; the OpenAI SDK's client
                                 cannot send a UTF-8 key
    a key is short or repetitive under 16 characters, or under 8 different ones

`KeyRing` holds the keys the server accepts now. A reload builds the new set aside
and swaps it in with one assignment: a request is checked against the old set or
the new one, never half of each; a request already past the check keeps running (its
stream finishes); counters and usage are per tenant name, so they survive. A file
that fails any check is refused and the old keys stay.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import stat
import sys
import tempfile
from typing import Any

from .access import GRANTS, TENANT_NAME, Tenant, check_key, tenant_entry

MIN_FILE_KEY_CHARS = 16  # a key in a file; `create_app(api_keys=...)` in code needs 8
MIN_DISTINCT_CHARS = 8  # "aaaaaaaaaaaaaaaa" is 16 characters and no secret
KEY_PREFIX = "ms-"  # what `keys new` starts a key with: grep-able in a leaked paste
TEACHER_GRANTS = {g: True for g in GRANTS}


def _json_entries(text: str, source: str) -> list[tuple[int, str, Any]]:
    """(line, key, value) for each top-level entry of a JSON object, duplicates kept
    (json.load keeps only the last of them, and says nothing)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:  # its message never quotes the document
        raise ValueError(f"{source}: not valid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{source}: use a JSON object mapping each API key to "
                         '{"tenant": NAME} (make one with: minserve keys new --tenants a,b)')
    decoder, entries = json.JSONDecoder(), []
    i = _skip_space(text, text.index("{") + 1)
    while text[i] != "}":  # the text is valid JSON: a string, ':', a value, ',' or '}'
        key, end = json.decoder.scanstring(text, i + 1)
        line = text.count("\n", 0, i) + 1
        value, i = decoder.raw_decode(text, _skip_space(text, _skip_space(text, end) + 1))
        entries.append((line, key, value))
        i = _skip_space(text, i)
        if text[i] == ",":
            i = _skip_space(text, i + 1)
    return entries


def _skip_space(text: str, i: int) -> int:
    while text[i] in " \t\r\n":
        i += 1
    return i


def load_api_keys(path: str) -> dict[str, Tenant]:
    """The keys file at `path` -> key -> Tenant; ValueError naming the line to change."""
    source = f"--api-keys-file {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{source}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{source}: not UTF-8 text (byte {e.start})") from None
    keys: dict[str, Tenant] = {}
    first_line: dict[str, tuple[int, str]] = {}
    for line, key, entry in _json_entries(text, source):
        who = entry.get("tenant") if isinstance(entry, dict) else None
        where = f"{source} line {line}" + (f" (tenant {who!r})" if isinstance(who, str)
                                           and TENANT_NAME.fullmatch(who) else "")
        if key in first_line:
            seen_line, seen_who = first_line[key]
            raise ValueError(f"{where}: the same key as line {seen_line} (tenant "
                             f"{seen_who!r}); each key must appear once, or one student "
                             "would silently become another")
        check_key(key, where, MIN_FILE_KEY_CHARS, MIN_DISTINCT_CHARS)
        keys[key] = tenant_entry(entry, where)
        first_line[key] = (line, keys[key].name)
    return keys


def new_key() -> str:
    """A key no one will guess: 192 random bits in 32 URL-safe characters."""
    while True:
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        if len(set(key)) >= MIN_DISTINCT_CHARS:  # all but certain; checked, not hoped
            return key


def tenant_names(keys: dict[str, Tenant]) -> set[str]:
    return {t.name for t in keys.values()}


class KeyRing:
    """The keys this server accepts now; `reload` swaps in the file's current ones.

    `pairs` is what `BearerAuth` compares a request's key against: read once per
    request, replaced whole by a reload (single assignment on the event loop), so
    every request sees one consistent set."""

    def __init__(self, keys: dict[str, Tenant], path: str | None = None) -> None:
        self.path = path
        self.reloads = 0
        self._use(keys)

    def _use(self, keys: dict[str, Tenant]) -> None:
        self.keys = dict(keys)
        self.pairs = [(k.encode("ascii", "surrogateescape"), t) for k, t in self.keys.items()]

    def reload(self) -> dict[str, Any]:
        """Read the keys file again. ValueError (the old keys stay) if it is refused."""
        if self.path is None:
            raise ValueError("this server was started without --api-keys-file: there is no "
                             "keys file to reload")
        new = load_api_keys(self.path)
        before, after = tenant_names(self.keys), tenant_names(new)
        summary = {"keys": len(new), "tenants": len(after),
                   "tenants_added": sorted(after - before),
                   "tenants_removed": sorted(before - after),
                   "keys_added": len(new.keys() - self.keys.keys()),
                   "keys_removed": len(self.keys.keys() - new.keys())}
        self._use(new)
        self.reloads += 1
        return summary


def reload_message(summary: dict[str, Any], path: str) -> str:
    """One log line for a reload that took (no key, only counts and tenant names)."""
    added = ", ".join(summary["tenants_added"]) or "none"
    removed = ", ".join(summary["tenants_removed"]) or "none"
    return (f"keys reloaded from {path}: {summary['keys']} keys, {summary['tenants']} tenants; "
            f"keys added {summary['keys_added']}, removed {summary['keys_removed']}; tenants "
            f"added: {added}; removed: {removed} (their running requests finish; new ones "
            "get 401)")


def write_keys(path: str, text: str) -> None:
    """Replace the file at `path` with `text` in one step: written to a temporary file in
    the same folder (owner-only: it holds secrets; an existing file's mode is kept),
    flushed to disk, then renamed over `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".keys-", suffix=".tmp", dir=folder)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------ minserve keys ...
def add_keys_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="keys_cmd", required=True)
    new = sub.add_parser(
        "new", help="make a keys file with a strong new key per tenant",
        description="Print a keys file with a strong new key per tenant, or write it with "
                    "--output FILE / --in-place. Do not redirect onto the file you --merge "
                    "(`... --merge keys.json > keys.json`): the shell empties keys.json "
                    "before this program runs. --output and --in-place write a temporary "
                    "file and rename it, so the file is never empty or half-written.")
    new.add_argument("--tenants", required=True,
                     help="comma-separated tenant names (1-64 of letters, digits, '._-')")
    new.add_argument("--teacher", default=None,
                     help="one more tenant with every grant (priority, every tenant's stats, "
                          "reloading keys) (default: none)")
    new.add_argument("--merge", default=None, metavar="FILE",
                     help="start from this keys file (checked) and add the new tenants "
                          "(default: start from nothing)")
    new.add_argument("--output", default=None, metavar="FILE",
                     help="write the keys file to FILE through a temporary file renamed over "
                          "it, owner-only (default: print it to stdout; never redirect it "
                          "onto the --merge file: the shell empties that file first)")
    new.add_argument("--in-place", action="store_true",
                     help="with --merge: write the result back to that file, as --output "
                          "does (default: print to stdout)")
    check = sub.add_parser("check", help="check a keys file as `serve` and a reload would")
    check.add_argument("file", help="the keys file, as given to --api-keys-file")


def keys_command(args: argparse.Namespace) -> int:
    """`minserve keys new` / `minserve keys check`: the JSON goes to stdout, errors to stderr."""
    try:
        if args.keys_cmd == "check":
            keys = load_api_keys(args.file)
            print(f"{args.file}: {len(keys)} keys, {len(tenant_names(keys))} tenants; "
                  "grants: " + "; ".join(f"{g}: {', '.join(sorted({t.name for t in keys.values() if getattr(t, g)})) or 'nobody'}"
                                         for g in GRANTS))
            return 0
        if args.in_place and (not args.merge or args.output):
            raise ValueError("--in-place writes back to the --merge file: give --merge FILE "
                             "(and no --output)")
        target = args.merge if args.in_place else args.output
        out: dict[str, Any] = {}
        if args.merge:
            load_api_keys(args.merge)  # refuse to build on a file serve would refuse
            with open(args.merge, encoding="utf-8") as f:
                out = json.load(f)
        names = [n.strip() for n in args.tenants.split(",") if n.strip()]
        if args.teacher:
            names.append(args.teacher)
        for name in names:
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant {name!r}: use 1-64 letters, digits and '._-'")
        if len(set(names)) != len(names):
            raise ValueError("a tenant is named twice in --tenants/--teacher")
        for name in names:
            grants = TEACHER_GRANTS if name == args.teacher else {}
            out[new_key()] = {"tenant": name, **grants}
        if target:
            write_keys(target, json.dumps(out, indent=1) + "\n")
            tenants = {v["tenant"] for v in out.values()}
            print(f"{target}: {len(out)} keys, {len(tenants)} tenants (added: "
                  f"{', '.join(names)})", file=sys.stderr)
            return 0
    except (ValueError, OSError) as e:
        print(f"minserve keys: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1))
    return 0

"""The front door: who may call (an optional API key) and which model names answer.

Both are checked before any work is queued. The key is checked in a pure-ASGI
middleware, before routing and body parsing: a client without it learns
nothing, not even whether its JSON parses. (Starlette's `BaseHTTPMiddleware`
runs the rest of the app in a task of its own and re-streams the body, which
has tangled with streaming and disconnect handling before; the server relies
on both, so a 20-line ASGI class keeps the path from socket to handler plain.)
"""

from __future__ import annotations

import hmac
import math
import re
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import parse_qsl

from ..engine import Engine
from .errors import OpenAIError

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def served_model_names(engine: Engine, extra: tuple[str, ...] = ()) -> list[str]:
    """Names a request's `model` may use: the engine's own name first, then aliases.

    The last path component of a folder or hub id (`SmolLM2-135M-Instruct` for
    `HuggingFaceTB/SmolLM2-135M-Instruct`), the hub id of the embedded model, and
    `minserve`, which always means "whatever this server runs".
    """
    name = engine.model_name
    names = [name, name.rstrip("/").rsplit("/", 1)[-1], *extra, "minserve"]
    if name == "SmolLM2-135M-Instruct" and engine.config.model is None:
        names.insert(1, EMBEDDED_HUB_ID)
    return list(dict.fromkeys(names))


def check_model(model: str | None, names: list[str]) -> None:
    if model is not None and model not in names:
        raise OpenAIError(404, f"The model '{model}' does not exist. This server serves "
                               f"'{names[0]}' (also accepted: {', '.join(names[1:])}).",
                          param="model", code="model_not_found")


def model_card(engine: Engine, names: list[str], created: int) -> dict[str, Any]:
    return {"id": names[0], "object": "model", "created": created, "owned_by": "minserve",
            "max_model_len": engine.max_model_len, "aliases": names[1:]}


TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class Tenant:
    """Who a request comes from (SPEC H5), and what its key is granted.

    `--api-keys-file` maps each API key to one of these. A request's session (`user` /
    `X-Session-Id`) lives inside its tenant, and the fair counters, stats, explain,
    request ids and the prefix cache are kept per tenant. `scoped` is False for the one
    tenant of a server without a keys file (open, or `--api-key`): the engine then sees
    no tenant at all, as before tenants existed."""

    name: str
    may_set_priority: bool = False  # may send a `priority` other than 0
    may_read_all_stats: bool = False  # /scheduler/stats shows every tenant's counters
    may_reload_keys: bool = False  # POST /admin/reload-keys (the teacher's key; SPEC H7)
    scoped: bool = True

    def engine_tenant(self) -> str | None:
        return self.name if self.scoped else None

    def engine_session(self, session: str) -> str:
        """The engine's session name: the tenant's prefix makes another tenant's unnameable."""
        return f"{self.name}/{session}" if self.scoped else session


GRANTS = tuple(f.name for f in fields(Tenant) if f.name.startswith("may_"))
MIN_KEY_CHARS = 8  # a key given in code (`create_app(api_keys=...)`); a keys file: keys.py


def check_key(key: Any, where: str, min_chars: int = MIN_KEY_CHARS,
              min_distinct: int = 0) -> None:
    """ValueError unless `key` is one an HTTP client can send and nobody guesses. The
    message says where and what, never a character of the key (it lands in logs)."""
    if not isinstance(key, str):
        raise ValueError(f"{where}: an API key must be a string")
    if key != key.strip():
        raise ValueError(f"{where}: the key has whitespace at its start or end, so no client "
                         "could ever send it; remove it")
    bad = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ValueError(f"{where}: character {bad + 1} of the key is a space or not printable "
                         "ASCII; a key travels in an HTTP header (the OpenAI SDK sends ASCII "
                         "only): use letters, digits and punctuation (minserve keys new)")
    if len(key) < min_chars:
        raise ValueError(f"{where}: the key has {len(key)} characters; use {min_chars} or more "
                         "(minserve keys new makes strong ones)")
    if len(set(key)) < min_distinct:
        raise ValueError(f"{where}: the key uses only {len(set(key))} different character(s); "
                         f"use {min_distinct} or more (minserve keys new makes strong ones)")


def tenant_entry(entry: Any, where: str) -> Tenant:
    """A key's value, `{"tenant": NAME, "may_...": bool}` -> Tenant (ValueError if not)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("tenant"), str):
        raise ValueError(f'{where}: its value must be an object with "tenant": NAME')
    if not TENANT_NAME.fullmatch(entry["tenant"]):
        raise ValueError(f"{where}: tenant {entry['tenant']!r}: use 1-64 letters, digits "
                         "and '._-'")
    unknown = set(entry) - {"tenant", *GRANTS}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; a key may have "
                         f"'tenant' and the grants {list(GRANTS)}")
    for g in GRANTS:
        if not isinstance(entry.get(g, False), bool):
            raise ValueError(f"{where}: {g} must be true or false")
    return Tenant(entry["tenant"], **{g: entry[g] for g in GRANTS if g in entry})


def parse_api_keys(data: Any, source: str = "the API keys") -> dict[str, Tenant]:
    """`{"KEY": {"tenant": "NAME", "may_set_priority": false, ...}, ...}` -> key -> Tenant.
    ValueError saying what to change for anything else (unknown grants included). A keys
    file is read by `keys.load_api_keys`, stricter and by line."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{source}: use a JSON object mapping each API key to "
                         '{"tenant": NAME, "may_set_priority": false}')
    keys = {}
    for n, (key, entry) in enumerate(data.items(), 1):
        where = f"{source}: entry {n}"
        check_key(key, where)
        keys[key] = tenant_entry(entry, where)
    return keys


def tenant_of(scope) -> Tenant | None:
    """The tenant `BearerAuth` found for this request (None on a server without keys)."""
    return (scope.get("state") or {}).get("minserve_tenant")


class BearerAuth:
    """Pure-ASGI middleware: `Authorization: Bearer <api_key>` or 401 (`/health` stays open,
    for liveness probes). Checked before routing, so an unauthenticated client learns
    nothing else, not even whether its JSON parses.

    The scheme is case-insensitive (RFC 9110: `bearer KEY` is the same credential).
    Two Authorization headers are refused (400): which one a proxy or the server
    would believe is ambiguous, so neither is. A key in the query string (`?api_key=`)
    is refused (400): a URL is written to logs and histories; keys travel in the header.

    The keys are `ring.pairs` (keys.KeyRing), read once per request: a reload swaps
    them whole. Each refusal is a failure of the client's address (`guard.failed`); an
    address over its budget gets 429 before its key is even compared (guard.py), unless
    the key authenticated from that address before (`guard.known_good`): a student is
    not locked out by a classmate's wrong key on the same NAT."""

    OPEN_PATHS = ("/health",)
    QUERY_KEY_NAMES = {"api_key", "api-key", "apikey", "key", "access_token", "token"}

    def __init__(self, app, ring, guard=None) -> None:
        self.app, self.ring, self.guard = app, ring, guard

    def _refusal(self, scope) -> OpenAIError | None:
        host = (scope.get("client") or ("",))[0]
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        scheme, _, token = (given[0] if len(given) == 1 else b"").strip().partition(b" ")
        token = token.strip()
        wait = self.guard.retry_after(host) if self.guard is not None else None
        if wait is not None and not self.guard.known_good(host, token):
            return OpenAIError(429, "too many requests without a valid API key from your "
                                    f"address; retry in {math.ceil(wait)} s",
                               "rate_limit_exceeded", code="too_many_auth_failures",
                               headers={"Retry-After": str(max(1, math.ceil(wait)))})
        err, found = None, None
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"),
                          keep_blank_values=True)
        if any(name.lower() in self.QUERY_KEY_NAMES for name, _ in query):
            err = OpenAIError(400, "send the API key in the header 'Authorization: Bearer "
                                   "<key>', never in the URL (URLs are logged)",
                              code="key_in_query")
        elif len(given) > 1:
            err = OpenAIError(400, f"send one Authorization header, not {len(given)}",
                              code="duplicate_authorization")
        else:
            for key, tenant in self.ring.pairs:  # every key compared: no early exit to time
                if hmac.compare_digest(token, key) and scheme.lower() == b"bearer":
                    found = tenant
            if found is None:  # compare_digest: constant time in the key
                err = OpenAIError(401, "missing or invalid API key: send 'Authorization: "
                                       "Bearer <key>'", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        if err is not None:
            if self.guard is not None:
                self.guard.failed(host)
            return err
        if self.guard is not None:
            self.guard.good(host, token)  # compared even while others' guessing throttles
        scope.setdefault("state", {})["minserve_tenant"] = found
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            err = self._refusal(scope)
            if err is not None:
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

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
import json
import re
from dataclasses import dataclass, fields
from typing import Any

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
    scoped: bool = True

    def engine_tenant(self) -> str | None:
        return self.name if self.scoped else None

    def engine_session(self, session: str) -> str:
        """The engine's session name: the tenant's prefix makes another tenant's unnameable."""
        return f"{self.name}/{session}" if self.scoped else session


GRANTS = tuple(f.name for f in fields(Tenant) if f.name.startswith("may_"))


def parse_api_keys(data: Any, source: str = "the API keys") -> dict[str, Tenant]:
    """`{"KEY": {"tenant": "NAME", "may_set_priority": false, ...}, ...}` -> key -> Tenant.
    ValueError saying what to change for anything else (unknown grants included)."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{source}: use a JSON object mapping each API key to "
                         '{"tenant": NAME, "may_set_priority": false}')
    keys = {}
    for key, entry in data.items():
        where = f"{source}: key {key[:4]}..."
        if not isinstance(key, str) or len(key) < 8:
            raise ValueError(f"{where}: an API key must be a string of 8 characters or more")
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
        keys[key] = Tenant(entry["tenant"], **{g: entry[g] for g in GRANTS if g in entry})
    return keys


def load_api_keys(path: str) -> dict[str, Tenant]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--api-keys-file {path}: not valid JSON ({e})") from None
    return parse_api_keys(data, f"--api-keys-file {path}")


def tenant_of(scope) -> Tenant | None:
    """The tenant `BearerAuth` found for this request (None on a server without keys)."""
    return (scope.get("state") or {}).get("minserve_tenant")


class BearerAuth:
    """Pure-ASGI middleware: `Authorization: Bearer <api_key>` or 401 (`/health` stays open,
    for liveness probes). Checked before routing, so an unauthenticated client learns
    nothing else, not even whether its JSON parses.

    The scheme is case-insensitive (RFC 9110: `bearer KEY` is the same credential).
    Two Authorization headers are refused (400): which one a proxy or the server
    would believe is ambiguous, so neither is."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app, api_key: str | None = None,
                 tenants: dict[str, Tenant] | None = None) -> None:
        # one key (`--api-key`: one unscoped tenant that sees all stats), or many
        tenants = tenants or {api_key: Tenant("default", may_read_all_stats=True,
                                              scoped=False)}
        self.app = app
        self.keys = [(k.encode(), t) for k, t in tenants.items()]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            err = None
            if len(given) > 1:
                err = OpenAIError(400, "send one Authorization header, not "
                                       f"{len(given)}", code="duplicate_authorization")
            else:
                scheme, _, token = (given[0] if given else b"").strip().partition(b" ")
                token, found = token.strip(), None
                for key, tenant in self.keys:  # every key compared: no early exit to time
                    if hmac.compare_digest(token, key) and scheme.lower() == b"bearer":
                        found = tenant
                if found is not None:
                    scope.setdefault("state", {})["minserve_tenant"] = found
                else:  # compare_digest: constant time in the key
                    err = OpenAIError(401, "missing or invalid API key: send 'Authorization: "
                                           "Bearer <key>'", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
            if err is not None:
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

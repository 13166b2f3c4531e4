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


class BearerAuth:
    """Pure-ASGI middleware: `Authorization: Bearer <api_key>` or 401 (`/health` stays open,
    for liveness probes). Checked before routing, so an unauthenticated client learns
    nothing else, not even whether its JSON parses.

    The scheme is case-insensitive (RFC 9110: `bearer KEY` is the same credential).
    Two Authorization headers are refused (400): which one a proxy or the server
    would believe is ambiguous, so neither is."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            err = None
            if len(given) > 1:
                err = OpenAIError(400, "send one Authorization header, not "
                                       f"{len(given)}", code="duplicate_authorization")
            else:
                scheme, _, token = (given[0] if given else b"").strip().partition(b" ")
                ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(),
                                                                          self.expected)
                if not ok:  # compare_digest: constant time in the key
                    err = OpenAIError(401, "missing or invalid API key: send 'Authorization: "
                                           "Bearer <key>'", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
            if err is not None:
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

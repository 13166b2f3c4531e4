"""Errors in OpenAI's shape: every non-200 answer of the HTTP server (SPEC H1, G6).

Every OpenAI client already knows how to read this body, so a refusal shows up
in the client's own exception type (`openai.RateLimitError`,
`openai.BadRequestError`, ...) with our message in it:

    {"error": {"message": "...", "type": "invalid_request_error",
               "param": "max_tokens", "code": "invalid_value"}}

A gate refusal (429) carries more than OpenAI's four fields: which gate said
no and the numbers that decided it (G6), so a client (or a learner reading
curl output) can see *why*, not just *that*:

    {"error": {"message": "the pending queue is full (4/4); retry later",
               "type": "rate_limit_exceeded", "param": null, "code": "queue_full",
               "gate": "G1", "numbers": {"pending": 4, "max_queue_size": 4},
               "retryable": true}}
    + headers  Retry-After: 1   x-should-retry: true

`retryable` is honest about the gate. G1 (queue full) is transient: retry after
a moment. A hard G2/G3 refusal means the request can *never* fit on this engine
as configured (prompt + max_tokens above the whole KV budget, or a prompt bigger
than the block pool); retrying the same request is pointless, so we say
`retryable: false` and send `x-should-retry: false`, the header the official
OpenAI SDKs obey instead of their automatic retry on 429. `Retry-After` is
still sent on every 429, as HTTP clients expect.

`rejection_response` is the one function other front ends (the Gradio app)
need to show a refusal exactly as the HTTP API does.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

TRANSIENT_GATES = ("G1",)  # refusals that may pass if retried later


class OpenAIError(Exception):
    """An HTTP error with an OpenAI-shaped body. Raise it anywhere in a handler."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code
        self.extra, self.headers = dict(extra or {}), dict(headers or {})

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers,
                             code=self.code)


class ErrorResponse(JSONResponse):
    """An OpenAIError's JSON response that leaves its `code` in the request's scope
    state when sent, where the access log (and the usage ledger it feeds) reads why
    a request was refused without parsing the body."""

    def __init__(self, *args, code: str | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.code = code

    async def __call__(self, scope, receive, send) -> None:
        scope.setdefault("state", {})["minserve_error_code"] = self.code
        await super().__call__(scope, receive, send)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


# ------------------------------------------------------------------ gate refusals (429)
def rejection_error(rejection: dict[str, Any], retry_after_s: float = 1.0) -> OpenAIError:
    """A `Rejection.to_dict()` (from a handle's final event) -> the 429 to send.

    The body names the gate, its reason code and the numbers that decided it (G6).
    """
    retryable = rejection.get("gate") in TRANSIENT_GATES
    message = rejection.get("message") or "the request was refused by a gate"
    if not retryable:
        message += " (this request can never fit on this engine as configured; do not retry it)"
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s))),
               "x-should-retry": "true" if retryable else "false"}
    return OpenAIError(
        429, message, type="rate_limit_exceeded", code=rejection.get("reason"),
        extra={"gate": rejection.get("gate"), "numbers": dict(rejection.get("numbers") or {}),
               "retryable": retryable},
        headers=headers)


def rejection_response(rejection: dict[str, Any],
                       retry_after_s: float = 1.0) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for a rejection: for front ends that are not this app.

        status, body, headers = rejection_response(handle.output.rejection)
        gr.Warning(body["error"]["message"])
    """
    err = rejection_error(rejection, retry_after_s)
    return err.status, err.body(), err.headers


# ------------------------------------------------------------------ validation (400)
def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """pydantic's error list -> one 400 naming the first bad field.

    FastAPI answers 422 with its own shape by default; OpenAI clients expect 400
    with `{"error": {...}}`, so we translate. A union field (`prompt`, `stop`,
    a message's `content`) fails once per alternative, each error's location
    ending in the alternative's name (`("stop", "list[str]", 0)`); we fold
    those into one "expected one of" message at the union's own path.
    """

    def where(e: dict[str, Any]) -> list:  # the path inside the body
        return [p for p in e.get("loc", ()) if p != "body"]

    first = errors[0]
    loc = where(first)
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"the request body is not valid JSON ({detail})".replace(" ()", ""),
                           code="invalid_json")
    if not loc:  # the body itself: not an object, or missing
        if first.get("input") is None:
            return bad_request("the request body is empty: send a JSON object, e.g. "
                               '{"prompt": "Hello", "max_tokens": 16}', code="empty_body")
        got = type(first.get("input")).__name__
        return bad_request(f"the request body must be a JSON object, got {got}",
                           code="invalid_type")
    field = str(loc[0])
    if first.get("type") == "missing":
        return bad_request(f"'{_path(loc)}' is a required property", field,
                           code="missing_required")
    same = [where(e) for e in errors if where(e)[:1] == loc[:1]]
    common = loc
    for other in same:  # longest common prefix of this field's error paths
        n = 0
        while n < min(len(common), len(other)) and common[n] == other[n]:
            n += 1
        common = common[:n]
    branches = [p[len(common)] for p in same if len(p) > len(common)]
    if len(same) > 1 and common and all(isinstance(b, str) for b in branches):
        inside = [e for e in errors if where(e)[:len(common)] == common
                  and len(where(e)) > len(common) + 1]
        if inside:  # the value had a right shape but a bad element: report that element
            first = inside[0]
            loc = common + where(first)[len(common) + 1:]  # drop the alternative's name
        else:  # no alternative fits the value's JSON type at all
            got = _json_type(first.get("input"))
            return bad_request(f"invalid type for '{_path(common)}': got {got}, expected one "
                               f"of {', '.join(dict.fromkeys(branches))}", field,
                               code="invalid_type")
    kind = "invalid_type" if first.get("type", "").endswith("_type") else "invalid_value"
    return bad_request(f"invalid value for '{_path(loc)}': {first.get('msg')}", field, code=kind)


def _path(loc: list) -> str:
    """["messages", 0, "role"] -> "messages[0].role" (how a JSON path reads)."""
    return str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])


def _json_type(value: Any) -> str:
    names = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array",
             dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# ------------------------------------------------------------------ wiring
_HTTP_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app can produce come out in OpenAI's shape."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Anything else is our bug: the client gets a 500 in OpenAI's shape and no
        # detail (no traceback, no paths); the log gets the traceback.
        logging.getLogger("minserve").error("unhandled error on %s %s", request.method,
                                            request.url.path, exc_info=exc)
        return OpenAIError(500, "internal server error (the server log has the details)",
                           "server_error", code="internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(exc.status_code, str(exc.detail), kind,
                           code=_HTTP_CODES.get(exc.status_code),
                           headers=dict(exc.headers or {})).response()

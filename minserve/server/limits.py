"""Limits: what one client may cost everyone else, and how long it may take to say it.

Every number is a field of `ServerLimits` (flags of `minserve serve`, a table in
docs/http_api.md). Each guards against one way a single client could stall or
starve the whole service:

    what                        where it is enforced                     answer
    body size                   `RequestLimits`, from Content-Length      413, before reading it
                                (and counted while reading a chunked one)
    body read time              `RequestLimits`, the whole body (a total  408
                                deadline, not per chunk: a byte every
                                20 s must not hold a connection forever)
    Content-Type                `RequestLimits`, POST only                415
    prompt characters           the route, before tokenising              400
    stop strings, `user`        the request schema                        400
    header read time            `TimedH11Protocol` (uvicorn has none for  connection closed
                                a connection that never finishes its
                                request line and headers: slowloris)
    idle keep-alive             uvicorn `timeout_keep_alive`              connection closed
    requests in flight          `RequestLimits` (`/health` is exempt)     503, OpenAI's shape
    open connections            `TimedH11Protocol`: max_connections +     503, OpenAI's shape
                                HEALTH_RESERVE (room kept for /health:
                                a reserve connection may only ask it)
    connections per address     `TimedH11Protocol`, guard.py: those that  429 + Retry-After, read
                                have shown no valid key                   and answered, closed
    connections per tenant      `ConnectionShare`, guard.py: those that   429 + Retry-After, closed
                                have shown the tenant's key
    shutdown grace              `MinserveServer.handle_exit` (cli.py)     final chunk / 503

Tokenising runs in a worker thread (the route awaits it), never on the event
loop, so a large prompt no longer freezes `/health` and every stream.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, fields

from .errors import OpenAIError


@dataclass
class ServerLimits:
    """Per-server limits; every field is a `minserve serve` flag of the same name."""

    max_body_bytes: int = 1 << 20  # 1 MiB: ~250k tokens of text, far past any context here
    max_prompt_chars: int = 200_000  # checked before tokenising (prompt or all messages)
    max_stop_strings: int = 4  # OpenAI's limit; each is scanned at every token
    max_stop_chars: int = 200  # per stop string
    max_user_chars: int = 256  # the `user` field / X-Session-Id: a fair-policy session name
    header_timeout_s: float = 10.0  # request line + headers must arrive within this
    body_timeout_s: float = 30.0  # the whole request body must arrive within this
    keep_alive_s: int = 5  # an idle keep-alive connection is closed after this
    max_connections: int = 512  # requests in flight (and open connections); beyond: 503
    shutdown_grace_s: float = 30.0  # on SIGTERM, running requests may finish within this
    # before authentication, per client address (guard.py, SPEC H7): connections that have
    # not shown a valid key (all of loopback counts as one address)
    max_connections_per_address: int = 64
    # after: the share of max_connections one tenant's keys may hold open (0.25: 128 of 512)
    max_tenant_connection_share: float = 0.25
    auth_failures_burst: int = 20  # requests without a valid key before the throttle...
    auth_failures_per_s: float = 1.0  # ...then one more try per 1/this seconds
    # tokenizer time per tenant (tokenizing.py): a bucket of CPU seconds, refilled
    tokenizer_burst_s: float = 2.0
    tokenizer_s_per_s: float = 0.25

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"ServerLimits: {f.name}={v!r}; use a number > 0")
        if self.max_tenant_connection_share > 1:
            raise ValueError(f"ServerLimits: max_tenant_connection_share="
                             f"{self.max_tenant_connection_share!r}; use a share of "
                             "max_connections in (0, 1]")


SHUTTING_DOWN = "the server is shutting down"
HEALTH_RESERVE = 16  # connections beyond max_connections still accepted: /health answers
HEALTH_HEADER_S = 2.0  # a reserve connection must have asked for /health within this
HEALTH_REQUESTS = (b"GET /health ", b"GET /health?", b"HEAD /health ", b"HEAD /health?")
OPEN_PATHS = ("/health",)  # never counted against max_connections


def too_busy(limit: int) -> OpenAIError:
    return OpenAIError(503, f"the server has {limit} requests in flight (max_connections); "
                            "retry in a moment", "server_error", code="too_many_connections",
                       headers={"Retry-After": "1"})


def shutting_down_error() -> OpenAIError:
    return OpenAIError(503, f"{SHUTTING_DOWN}; retry on another instance or later",
                       "server_error", code="server_shutdown", headers={"Retry-After": "5"})


class RequestLimits:
    """Pure-ASGI middleware: draining, Content-Type, body size and body read time.

    Checked before routing and parsing, so a 20 MB body is refused from its
    Content-Length without reading it, and a body sent without one (chunked) is
    cut off as soon as it passes the limit. The body is read here, with a
    deadline per chunk, and handed on to the app.
    """

    def __init__(self, app, limits: ServerLimits, state,
                 post_paths: tuple[str, ...] | None = None) -> None:
        self.app, self.limits, self.state = app, limits, state
        # POST routes with a JSON body (a path ending in "/": every path under it); a POST
        # elsewhere goes to the router (404, 405) unread
        self.post_paths = post_paths
        self.in_flight = 0  # requests past this door and not answered yet (one event loop)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limits.max_connections:
            await too_busy(self.limits.max_connections).response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self._checked(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _checked(self, scope, receive, send) -> None:
        if getattr(self.state, "draining", False) and scope["path"] != "/health":
            await shutting_down_error().response()(scope, receive, send)
            return
        if scope["method"] != "POST" or (self.post_paths is not None and not any(
                scope["path"] == p or (p.endswith("/") and scope["path"].startswith(p))
                for p in self.post_paths)):
            await self.app(scope, receive, send)
            return
        headers = {}
        for k, v in scope["headers"]:
            headers.setdefault(k, v)
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            got = ctype.decode("latin-1") or "none"
            err = OpenAIError(415, f"send the body as JSON with 'Content-Type: application/json' "
                                   f"(got {got})", code="unsupported_media_type")
            await err.response()(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await too_large(limit).response()(scope, receive, send)
            return
        try:
            body = await self._read_body(receive, limit)
        except OpenAIError as err:
            await err.response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive, limit: int) -> bytes:
        """The whole body (at most `limit` bytes; FastAPI would read it all anyway) within
        `body_timeout_s` in all: one deadline for the body, not one per chunk (once,
        a byte every 20 s kept 511 connections open under a per-chunk 30 s)."""
        timeout, parts, seen = self.limits.body_timeout_s, [], 0
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise asyncio.TimeoutError
                msg = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                raise OpenAIError(408, f"the request body did not arrive within {timeout:g} s",
                                  code="request_timeout") from None
            if msg["type"] == "http.disconnect":
                raise OpenAIError(400, "the client went away while sending the body",
                                  code="client_disconnected")
            chunk = msg.get("body", b"")
            seen += len(chunk)
            if seen > limit:
                raise too_large(limit)
            parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts)


def _replay(body: bytes, receive):
    """A `receive` that hands the app the body already read, then the real messages
    (the disconnect the server waits for while a request runs)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than {limit} bytes", code="body_too_large")


def health_request(head: bytes) -> bool | None:
    """Whether the first bytes of a connection ask for /health: True, False, or None
    while they could still become such a request line."""
    if head.startswith(HEALTH_REQUESTS):
        return True
    return None if any(r.startswith(head) for r in HEALTH_REQUESTS) else False


def raw_response(status: str, err: OpenAIError) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's shape, for refusals made before h11 parses
    anything (at accept): the connection is closed after it."""
    payload = json.dumps(err.body()).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in err.headers.items())
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"{extra}content-length: {len(payload)}\r\n\r\n").encode() + payload


def timed_h11_protocol(header_timeout_s: float, max_connections: int | None = None,
                       guard=None):
    """uvicorn's h11 protocol with a deadline for the request line and headers, and the
    connection limits made at accept.

    uvicorn times out an idle keep-alive connection, but not one that was just
    opened and sends nothing, or half a header line at a time (slowloris): such a
    connection stays open forever. This subclass arms a timer whenever the
    connection is between requests and has begun (or not begun) a new one, and
    closes the connection if the headers are not complete in time (counted against
    its address: `guard.failed`).

    At accept: past max_connections + HEALTH_RESERVE, 503. Past the address's own cap of
    connections without a valid key (`guard`): the connection may still show a key, within
    the short header deadline of the reserve, and is answered either way (429 unless the
    key moved it to its tenant: `ConnectionShare`), then closed; past twice that cap, 429
    at once. A connection in the reserve (past max_connections) is a health check or
    nothing: its first bytes must be `GET /health` (or HEAD) within HEALTH_HEADER_S, and
    it is closed after that one answer. Before, anyone could hold the reserve idle, and
    /health answered 503 with the rest.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from .guard import REFUSE

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._counted_as = None  # the (host, port) `guard` counts this connection under
            self._health_only, self._head = False, b""
            self.limit_concurrency = None  # uvicorn's own 503 is plain text: ours is below
            open_now = len(self.connections)
            if max_connections is not None and open_now > max_connections + HEALTH_RESERVE:
                self._refuse("503 Service Unavailable", too_busy(max_connections))
                return
            peer = tuple(self.client) if self.client else None
            short = False
            if guard is not None and peer is not None:
                state = guard.connection_opened(peer)
                if state == REFUSE:
                    self._refuse("429 Too Many Requests", too_many_from(
                        guard.limits.max_connections_per_address))
                    return
                self._counted_as, short = peer, guard.still_over(peer)
            self._health_only = max_connections is not None and open_now > max_connections
            timeout = min(header_timeout_s, HEALTH_HEADER_S) if (self._health_only or short) \
                else header_timeout_s
            self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _refuse(self, status: str, err: OpenAIError) -> None:
            self.transport.write(raw_response(status, err))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._health_only and self._head is not None:  # not yet seen a request line
                self._head += data
                verdict = health_request(self._head)
                if verdict is None:
                    return  # wait for more (the short header deadline still runs)
                if verdict is False:
                    self._refuse("503 Service Unavailable", reserve_only(max_connections))
                    return
                data, self._head = self._head, None
            super().data_received(data)
            waiting_for_headers = self.conn.their_state in (h11.IDLE,)
            if waiting_for_headers and self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)
            elif not waiting_for_headers and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            over = self._counted_as is not None and guard.still_over(self._counted_as)
            if (self._health_only or over) and not self.transport.is_closing():
                self.transport.close()  # one answer per reserve (or over-cap) connection

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            if self._counted_as is not None:
                guard.connection_closed(self._counted_as)
                self._counted_as = None
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if guard is not None and self.client:
                    guard.failed(self.client[0])  # slowloris is an unauthenticated try too
                self.transport.close()

    return TimedH11Protocol


def too_many_from(limit: int) -> OpenAIError:
    return OpenAIError(429, f"your address already has {limit} connections open to this server "
                            "without a valid API key (max_connections_per_address); send your "
                            "key, close some, or retry in a moment",
                       "rate_limit_exceeded", code="too_many_connections_from_address",
                       headers={"Retry-After": "1", "Connection": "close"})


def too_many_for_tenant(limit: int) -> OpenAIError:
    return OpenAIError(429, f"your API key's tenant already has {limit} connections open to "
                            "this server (max_tenant_connection_share of max_connections); "
                            "close some, or retry in a moment", "rate_limit_exceeded",
                       code="too_many_connections_for_tenant",
                       headers={"Retry-After": "1", "Connection": "close"})


class ConnectionShare:
    """Pure-ASGI middleware, inside `BearerAuth`: the request has shown a valid key (or
    needs none), so its connection now counts against its tenant instead of its address
    (`ClientGuard.request_seen`, guard.py). A tenant over its share of connections, or a
    connection beyond its address's cap that has no key to show, gets 429 with
    Retry-After and `Connection: close`: an answer the OpenAI SDK reads and retries,
    never a bare close. `/health` is not counted."""

    def __init__(self, app, guard, tenant_of) -> None:
        self.app, self.guard, self.tenant_of = app, guard, tenant_of

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            tenant = self.tenant_of(scope)  # None: a server without keys
            refused = self.guard.request_seen(
                scope.get("client"), None if tenant is None else tenant.name,
                capped=tenant is not None and tenant.scoped)  # --api-key: one tenant, no cap
            if refused is not None:
                err = (too_many_from(self.guard.limits.max_connections_per_address)
                       if refused == "address" else too_many_for_tenant(self.guard.tenant_cap))
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def reserve_only(limit: int) -> OpenAIError:
    return OpenAIError(503, f"the server has {limit} connections open (max_connections); the "
                            "few kept beyond that answer GET /health only: retry in a moment",
                       "server_error", code="too_many_connections", headers={"Retry-After": "1"})

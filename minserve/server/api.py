"""The OpenAI-compatible HTTP server: one FastAPI app over one running Engine (SPEC H1–H3).

    client ──POST /v1/chat/completions──► validate (400) ─► encode ─► engine.submit ─► handle
                                                                         │ G1 refusal: at once
           ◄── 429 + gate + numbers ◄── first event is a rejection? ◄────┤ G2/G3: at next admit
           ◄── 200 + SSE / JSON     ◄── first event is a token ◄─────────┘

The one idea worth reading this file for: **the status line waits for the
engine's first word.** A gate can refuse a request at submit (G1) or later, at
admit (hard G2/G3). HTTP lets us send the status only once, so for streaming
and non-streaming alike we wait for the handle's first event before sending
anything: a final event carrying a `rejection` becomes a 429 naming the gate;
a token becomes `200` and the stream starts. A client therefore never gets a
`200` that turns out to be a refusal, and never hangs on a request nobody will
run (G4).

The other: **a client that leaves cancels its request (H3).** Before the
response starts we race the engine against the ASGI `http.disconnect`
message; once streaming, Starlette notices the hang-up and cancels the stream.
Either way `handle.cancel()` runs in a `finally`, so the row is evicted at the
next tick and its reservation (R1) and KV blocks go back.

The engine's worker thread does all model work; the event loop only submits
(thread-safe, fast), awaits handles (`async for` never blocks the loop) and
writes bytes. The engine is started and stopped in the app's lifespan.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import Engine, request_cap_message
from ..explain import explain
from ..streaming import RequestHandle, StreamEvent
from .access import BearerAuth, Tenant, check_model, model_card, served_model_names, tenant_of
from .accesslog import AccessLog
from .errors import (
    OpenAIError,
    bad_request,
    install_error_handlers,
    rejection_error,
    rejection_response,
)
from .guard import ClientGuard
from .limits import (
    SHUTTING_DOWN,
    ConnectionShare,
    RequestLimits,
    ServerLimits,
    shutting_down_error,
)
from .schemas import (
    OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    ExplainRequest,
    GenerationRequest,
    sampling_params,
)
from .shapes import SSE_DONE, ResponseShaper, sse
from .teacher import install_teacher_routes, usage_view
from .tokenizing import PromptBound, TokenizerBudget, retry_seconds
from .usage import CLIENT_GONE, Delivery, UsageLedger

__all__ = ["create_app", "rejection_response", "served_model_names", "OpenAIError"]

T = TypeVar("T")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_PRIORITY = 10  # `priority` lies in [-MAX_PRIORITY, MAX_PRIORITY] (a grant, H5)


class RecentOwners:
    """request id -> (tenant, session), for the newest `size` server-named requests
    (bounded: a server runs for months; explain answers about recent requests)."""

    def __init__(self, size: int) -> None:
        self.size, self._owners = size, OrderedDict()
        self._lock = threading.Lock()

    def add(self, request_id: str, session: tuple[str, str]) -> None:
        with self._lock:
            self._owners[request_id] = session
            self._owners.move_to_end(request_id)
            while len(self._owners) > self.size:
                self._owners.popitem(last=False)

    def get(self, request_id: str) -> tuple[str, str] | None:
        with self._lock:
            return self._owners.get(request_id)


def create_app(engine: Engine, *, api_key: str | None = None, manage_engine: bool = True,
               default_max_tokens: int = 256, retry_after_s: float = 1.0,
               model_aliases: tuple[str, ...] = (), limits: ServerLimits | None = None,
               session_stats: bool = False, api_keys: dict[str, Any] | None = None,
               allow_priority: bool = False, keys_file: str | None = None,
               trusted_proxies: str | None = None, loopback_apart: bool = False) -> FastAPI:
    """The app. `manage_engine`: start the worker at startup and stop it at shutdown.

    `default_max_tokens` is used by chat requests that omit max_tokens
    (completions keep OpenAI's 16); `retry_after_s` goes into `Retry-After` on 429s.
    `limits`: see limits.py. `session_stats`: show every session's counters on
    /scheduler/stats to any caller (otherwise only behind `api_key`, or one's own).
    `api_keys`: key -> Tenant (or its JSON dict, access.parse_api_keys): tenants (H5).
    `allow_priority`: without keys, let any client set `priority` (the operator's call).
    `keys_file`: where `api_keys` came from, read again on SIGHUP or POST /admin/reload-keys
    (keys.py). `trusted_proxies`: `--forwarded-allow-ips` (guard.py); the same value must
    reach uvicorn (`lifecycle.uvicorn_config` reads it from the app's state).
    `loopback_apart`: count each loopback alias (127.0.0.2, ...) as its own address
    (guard.py; by default all of loopback is one).
    """
    from .access import parse_api_keys
    from .keys import KeyRing

    limits = limits or ServerLimits()
    if api_keys and api_key:
        raise ValueError("give api_key (one tenant) or api_keys (tenants), not both")
    tenants = None
    if api_keys:
        tenants = {k: v if isinstance(v, Tenant) else parse_api_keys({k: v})[k]
                   for k, v in api_keys.items()}
    # a request BearerAuth let through without a tenant of its own is this one
    open_tenant = Tenant("default", may_set_priority=allow_priority,
                         may_read_all_stats=session_stats or bool(api_key), scoped=False)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if manage_engine:
            engine.start()
        yield
        if manage_engine:
            engine.stop()

    app = FastAPI(title="minserve", lifespan=lifespan,
                  description="OpenAI-compatible API over a minserve Engine.")
    app.state.engine = engine
    app.state.draining = False  # set on SIGTERM (cli.MinserveServer): new requests get 503
    app.state.limits = limits
    app.state.tenants = tenants
    # the keys accepted now (reloadable), or None on a server without keys
    app.state.keyring = None if not (api_key or tenants) else KeyRing(
        tenants or {api_key: Tenant("default", may_read_all_stats=True, scoped=False)},
        keys_file if tenants else None)
    app.state.ledger = ledger = UsageLedger()  # usage per tenant (usage.py, H7)
    app.state.trusted_proxies = trusted_proxies
    app.state.guard = ClientGuard(limits, trusted_proxies, on_refused=ledger.refused_anonymous,
                                  loopback_apart=loopback_apart)
    app.state.tokenizer_budget = TokenizerBudget(limits.tokenizer_burst_s,
                                                 limits.tokenizer_s_per_s)
    app.state.prompt_bound = (PromptBound.for_tokenizer(engine.tokenizer)
                              if engine.tokenizer is not None else None)
    app.state.settling = set()  # the tasks that book each request's usage when it ends
    # server-named request id -> (tenant, session) that sent it (who may ask explain)
    app.state.owners = RecentOwners(4096)
    install_error_handlers(app)
    app.add_middleware(RequestLimits, limits=limits, state=app.state,
                       post_paths=("/v1/completions", "/v1/chat/completions",
                                   "/scheduler/explain/"))
    # a connection that passed the key check counts against its tenant, not its address
    app.add_middleware(ConnectionShare, guard=app.state.guard, tenant_of=tenant_of)
    if app.state.keyring is not None:  # the check before anything but the access log
        app.add_middleware(BearerAuth, ring=app.state.keyring, guard=app.state.guard)
    # added last: the outermost, so it logs (and books) every answer, the 401s included
    app.add_middleware(AccessLog, ledger=ledger,
                       open_tenant=None if app.state.keyring is not None else open_tenant.name)

    def caller(request: Request) -> Tenant:
        return tenant_of(request.scope) or open_tenant
    names = served_model_names(engine, model_aliases)
    started = int(time.time())

    # ---------------------------------------------------------------- endpoints
    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(engine, names, started)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        check_model(model, names)
        return model_card(engine, names, started)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model, names)
        body.check_supported()
        body.check_limits(limits)
        prompt = body.single_prompt()
        if not isinstance(prompt, str) and len(prompt) > engine.max_model_len:
            raise bad_request(f"the prompt is {len(prompt)} token ids; this model's context "
                              f"is {engine.max_model_len} tokens", "prompt",
                              code="context_length_exceeded")
        who = caller(request)
        ids = await _tokenize(app, engine, who, prompt, body, "prompt")
        return await _generate(engine, request, body, ids, "completion",
                               OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS, retry_after_s, limits, who)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model, names)
        body.check_supported()
        body.check_limits(limits)
        who = caller(request)
        ids = await _tokenize(app, engine, who, body.template_messages(), body, "messages")
        return await _generate(engine, request, body, ids, "chat", default_max_tokens,
                               retry_after_s, limits, who)

    @app.get("/scheduler/stats")
    def scheduler_stats(request: Request) -> dict[str, Any]:
        # A plain `def`: FastAPI runs it in a thread, so the brief queue lock that
        # stats() takes never stalls the event loop.
        stats, who = engine.stats(), caller(request)
        stats["usage"] = usage_view(app, who)  # real tokens and refusals, per tenant (H7)
        if who.may_read_all_stats:  # a flag, the one --api-key, or a key's grant
            return stats
        # counters are per tenant when there are tenants (fair.py `unit`), else per session
        own = who.name if who.scoped else session_header(request)
        return aggregate_sessions(stats, own)

    @app.get("/scheduler/explain/{request_id}")
    def explain_request(request_id: str, request: Request) -> dict[str, Any]:
        """Where a request is and why (explain.py). Only for the session that sent it
        (X-Session-Id / `user`, as when it was sent, in the caller's tenant); anyone else
        gets the same 404 as for an id that does not exist, so ids of other sessions
        cannot be probed. A client-named id lives in its session's own namespace
        (`engine_request_id`): nobody else can reuse, confirm or shadow it (H5)."""
        return explain_for(request, request_id, session_header(request) or "default")

    @app.post("/scheduler/explain/{request_id}")
    def explain_by_body(request_id: str, request: Request,
                        body: ExplainRequest | None = None) -> dict[str, Any]:
        """The same, the session named as in a generation request's body (`user`): any
        name a client can send there, which a header could not carry (H7)."""
        if body is not None:
            body.check_limits(limits)
        session = (body.user if body is not None else None) or session_header(request)
        return explain_for(request, request_id, session or "default")

    def explain_for(request: Request, request_id: str, session: str) -> dict[str, Any]:
        who = caller(request)
        named = engine_request_id(who, session, request_id)
        s = engine.scheduler
        if named in s.requests or named in s.recent_finished:
            internal = named
        elif app.state.owners.get(request_id) == (who.name, session):
            internal = request_id  # a server-named id (cmpl-<uuid>) of this session
        else:
            raise OpenAIError(404, f"no request {request_id!r} for this session",
                              "invalid_request_error", code="request_not_found")
        # others_private: the sentence names no number of another client's request (H5)
        return scrub_explain(explain(engine.scheduler, internal, others_private=True),
                             internal, request_id, session)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness without locks: a thread's `is_alive()` and two plain reads, so this
        answers even while a tick holds the scheduler lock (it can never hang)."""
        alive = engine.running
        body = {"status": "ok" if alive else "unhealthy", "worker_alive": alive,
                "ticks": engine.scheduler.tick_count, "draining": app.state.draining}
        if not alive:
            body["error"] = OpenAIError(503, "the engine's worker thread is not running",
                                        "server_error", code="worker_dead").body()["error"]
        elif (down := prefill_worker_down(engine)) is not None:  # new prompts are refused
            body.update(status="unhealthy", error=down.body()["error"])
        if engine.scheduler.remote is not None:  # disaggregated: the prefill worker (H8)
            body["prefill_worker"] = engine.scheduler.remote.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    # HEAD /health: what some load balancers probe with (same answer, no body)
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
    install_teacher_routes(app, caller)  # usage.csv, /admin/reload-keys (teacher.py)
    return app


def prefill_worker_down(engine: Engine) -> OpenAIError | None:
    """disaggregated (SPEC H8): the prefill worker died past its restart budget, so the
    engine refuses new prompts until it starts one again: a 503 saying so and when (plain
    reads: `/health` calls it too)."""
    remote = engine.scheduler.remote
    if remote is None or remote.state != "given_up":
        return None
    retry = remote.health().get("retry_in_s", 0)
    return OpenAIError(503, f"{remote.broken} (see GET /health)", "server_error",
                       code="prefill_worker_down", headers={"Retry-After": str(int(retry) + 1)})


# ==================================================================== one request
async def _generate(engine: Engine, request: Request, body: GenerationRequest, ids: list[int],
                    kind: str, default_max_tokens: int, retry_after_s: float,
                    limits: ServerLimits, tenant: Tenant) -> Response:
    """Submit, wait for the first event, then answer: 429, streamed 200 or JSON 200."""
    check_priority(body.priority, tenant)
    cap = engine.request_kv_cap  # H5: what one request may reserve, prompt + max_tokens
    if engine.config.max_request_kv_share < 1:
        if body.requested_max_tokens() is None:  # the default shrinks to fit the cap
            default_max_tokens = max(1, min(default_max_tokens, cap - len(ids)))
        asked = body.requested_max_tokens() or default_max_tokens
        if len(ids) + asked > cap:  # say what to lower: the prompt, if it alone is too long
            raise OpenAIError(400, request_cap_message(
                len(ids), asked, cap, engine.scheduler.kv_budget_tokens,
                engine.config.max_request_kv_share),
                param=max_tokens_param(body) if len(ids) < cap else body.PROMPT_PARAM,
                code="request_too_large")
    sampling = sampling_params(body, len(ids), engine.max_model_len, default_max_tokens)
    session = body.user or session_header(request) or "default"  # H2
    if len(session) > limits.max_user_chars:
        raise bad_request(f"the session name (X-Session-Id) is {len(session)} characters; at "
                          f"most {limits.max_user_chars} are allowed", "user")
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    client_id = request.headers.get("x-request-id")  # the client may name it
    if client_id is not None and not REQUEST_ID.fullmatch(client_id):
        raise bad_request("X-Request-Id must be 1-128 characters of letters, digits and "
                          "'._:-'", "X-Request-Id")
    # A client's name lives in its own (tenant, session) namespace: it can collide only
    # with its own running request, never confirm or shadow another's (H5).
    engine_id = engine_request_id(tenant, session, client_id) if client_id else rid
    if engine_id in engine.scheduler.requests:
        raise bad_request(f"X-Request-Id {client_id!r} names a request of yours that is "
                          "still running; use a new id", "X-Request-Id")
    if not engine.running:  # nobody would ever tick this request: say so instead of hanging
        raise OpenAIError(503, "the engine's worker thread is not running (see GET /health)",
                          "server_error", code="worker_dead")
    if (down := prefill_worker_down(engine)) is not None:  # it would fail at its first tick
        raise down
    try:
        handle = engine.submit(ids, sampling, session_id=tenant.engine_session(session),
                               priority=body.priority, request_id=engine_id,
                               tenant=tenant.engine_tenant())
    except ValueError as e:
        raise bad_request(str(e), "prompt") from None
    handle.wait_for_worker()  # if the worker dies now, the loop below says so (503)
    delivery = Delivery(tokens=0)  # what reaches the client: the ledger bills only that
    _book_when_done(request.app, engine, handle, tenant, delivery)
    if not client_id:
        request.app.state.owners.add(engine_id, (tenant.name, session))
    engine_id = client_id or engine_id  # what the client is told (x-request-id)
    shaper = ResponseShaper(kind, rid, engine.model_name, len(ids), session, body.priority)
    events = _while_worker_lives(engine, handle.__aiter__())
    handed_off = False  # True once a streaming response owns the cancel
    try:
        first = await _unless_disconnected(request, anext(events))
        if first.finish_reason is not None:  # refused (429) or failed before any token
            raise _final_error(first, retry_after_s)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _sse_stream(first, events, handle, shaper, include_usage, delivery)
            handed_off = True
            return CancelOnCloseStream(stream, handle, delivery,
                                       headers={"x-request-id": engine_id})
        await _unless_disconnected(request, _drain(events))
        out = handle.output
        if out.finish_reason == "error":
            raise _engine_error(handle)
        delivery.tokens = None  # all of them, in the body
        return JSONResponse(shaper.final_body(out), headers={"x-request-id": engine_id})
    except ClientGone:  # nobody is listening; 499 is nginx's "client closed request"
        return Response(status_code=CLIENT_GONE)
    finally:
        if not handed_off:
            handle.cancel()  # no-op when finished; else evicted next tick, all released (H3)
            delivery.done.set()
            await events.aclose()


async def _sse_stream(first: StreamEvent, events: AsyncIterator[StreamEvent],
                      handle: RequestHandle, shaper: ResponseShaper,
                      include_usage: bool, delivery: Delivery) -> AsyncIterator[str]:
    """The SSE body: a chunk per text delta, the finish chunk, usage if asked, [DONE].
    `delivery.tokens`: the tokens whose text has gone to the client (a `yield` returns
    once Starlette has handed the chunk to the socket), all of them at the end."""
    try:
        if shaper.kind == "chat":
            yield sse(shaper.chunk(role=True))
        if first.text:
            yield sse(shaper.chunk(first.text))
            delivery.tokens = first.index + 1
        try:
            async for ev in events:
                got = time.perf_counter()
                if ev.text:
                    yield sse(shaper.chunk(ev.text))
                    if ev.token_id is not None:
                        delivery.tokens = ev.index + 1
                if handle.spans is not None and ev.index >= 0:  # MINSERVE_SPANS (spans.py)
                    handle.spans.token_sent(handle.request_id, ev.index, got, time.perf_counter())
                if ev.finish_reason is None:
                    continue
                out = handle.output
                if out.finish_reason == "error":  # the status line is long gone: say it in-band
                    yield sse(_engine_error(handle).body())
                yield sse(shaper.chunk(finish_reason=out.finish_reason, out=out))
                if include_usage:
                    yield sse(shaper.usage_chunk(out))
        except OpenAIError as e:  # the worker died mid-stream: say so, then end properly
            yield sse(e.body())
            yield sse(shaper.chunk(finish_reason="error"))
        yield SSE_DONE
        delivery.tokens = None  # the stream ended whole: every token's text went out
    finally:
        handle.cancel()  # the client left mid-stream (or we are shutting down): H3
        await events.aclose()


class CancelOnCloseStream(StreamingResponse):
    """An SSE response that cancels its request however the response ends (H3).

    When the client hangs up, Starlette cancels the task writing the stream. If
    our generator was parked at a `yield` (waiting for the socket, not for the
    engine), its own `finally` would only run whenever it is garbage-collected;
    this wrapper makes the cancel happen right away, every time.
    """

    def __init__(self, content: AsyncIterator[str], handle: RequestHandle,
                 delivery: Delivery, **kw) -> None:
        super().__init__(content, media_type="text/event-stream", **kw)
        self.headers["cache-control"] = "no-cache"
        self.handle, self.delivery = handle, delivery

    async def __call__(self, scope, receive, send) -> None:
        async def send_then_let_a_hangup_show(message) -> None:
            await send(message)
            if message["type"] == "http.response.body":
                # Once uvicorn has seen the client go (ASGI 2.3), it drops a chunk without
                # a word, and the same loop turn wakes Starlette's disconnect listener. One
                # turn here lets that listener cancel this send, so the stream's `yield`
                # returns only for a chunk written while the client was there: what
                # `delivery.tokens` counts. Without it, a chunk dropped in that turn was
                # billed (seen under load: 4 runs in 10 of test_usage's cancels test).
                await asyncio.sleep(0)

        try:
            await super().__call__(scope, receive, send_then_let_a_hangup_show)
        finally:
            self.handle.cancel()
            await self.body_iterator.aclose()
            self.delivery.done.set()  # what reached the client is known: book it


# ==================================================================== helpers
class ClientGone(Exception):
    """The client disconnected before we answered."""


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client hangs up. The body is already read, so the ASGI
    server's next message is `http.disconnect`: this waits, it does not poll."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, unless the client disconnects first: then cancel it, raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
        await asyncio.wait({work, gone})  # let both unwind before anyone touches `events`
    if work.cancelled():
        raise ClientGone
    return work.result()


async def _drain(events: AsyncIterator[StreamEvent]) -> None:
    async for _ in events:
        pass


def _final_error(ev: StreamEvent, retry_after_s: float) -> OpenAIError:
    """A request that ended before its first token: a gate refusal (429) or a failure."""
    if ev.rejection is not None:
        return rejection_error(ev.rejection, retry_after_s)
    if ev.finish_reason == "cancelled":
        return OpenAIError(503, "the request was cancelled before it started", "server_error",
                           code="cancelled")
    return _error_for(ev.error)


def _engine_error(handle: RequestHandle) -> OpenAIError:
    return _error_for(handle.events[-1].error)


def _error_for(error: str | None) -> OpenAIError:
    """A request the engine ended with an error: 503 when the server is going down,
    else 500 with the engine's one-line message (never a traceback)."""
    if error == SHUTTING_DOWN:
        return shutting_down_error()
    return OpenAIError(500, error or "the engine failed this request", "server_error",
                       code="engine_error")


async def _tokenize(app, engine: Engine, tenant: Tenant, prompt, body: GenerationRequest,
                    param: str) -> list[int]:
    """The prompt's token ids, the work charged to `tenant` (tokenizing.py, H7).

    429 `tokenizer_budget` while the tenant's tokenizer time is spent; 400 before
    tokenizing when the text alone proves the prompt too long for this request
    (`PromptBound`); else the tokenizer runs in a worker thread (never on the event
    loop: a long prompt would freeze /health and every stream), one at a time per
    tenant, and its CPU time is charged whether or not the request then runs."""
    budget, ledger = app.state.tokenizer_budget, app.state.ledger
    metered = tenant.name if tenant.scoped else None
    wait = budget.retry_after(metered) if metered else None
    if wait is not None:
        raise OpenAIError(429, f"this key's tokenizer time is spent: a tenant may use "
                               f"{budget.burst_s:g} s of CPU tokenizing at once, refilled at "
                               f"{budget.per_s:g} s per second (tokenizer_burst_s, "
                               f"tokenizer_s_per_s); retry in {wait:.1f} s, or send shorter "
                               "prompts", "rate_limit_exceeded", code="tokenizer_budget",
                          headers={"Retry-After": retry_seconds(wait), "x-should-retry": "true"})
    bound = app.state.prompt_bound
    limit = engine.max_model_len
    if engine.config.max_request_kv_share < 1:
        limit = min(limit, engine.request_kv_cap)
    text_like = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt)
                                            and isinstance(prompt[0], dict))
    # a bound can pass `limit` only if the text has more bytes (at most 4 per character)
    provable = bound is not None and text_like and 4 * body.prompt_chars() > limit

    def work() -> list[int]:
        if provable:
            text = prompt if isinstance(prompt, str) else engine.tokenizer.apply_chat_template(
                list(prompt), tokenize=False, add_generation_prompt=True)
            refuse_if_too_long(engine, body, *bound.at_least(text))
        return engine.encode(prompt)

    try:
        return await budget.run(metered, work,
                                on_charge=lambda s: ledger.tokenized(tenant.name, s))
    except ValueError as e:
        raise bad_request(str(e), param) from None


def refuse_if_too_long(engine: Engine, body: GenerationRequest, at_least: int, why: str) -> None:
    """400 when a prompt of `at_least` tokens cannot fit this request, saying what to lower
    (the prompt, or max_tokens to what could fit at most), before anything is tokenized."""
    ctx, share = engine.max_model_len, engine.config.max_request_kv_share
    cap = engine.request_kv_cap if share < 1 else None
    by_cap = cap is not None and cap < ctx
    limit = cap if by_cap else ctx
    code = "request_too_large" if by_cap else "context_length_exceeded"
    rule = (f"One request may reserve at most {cap} tokens of KV, prompt + max_tokens, of the "
            f"{engine.scheduler.kv_budget_tokens}-token budget (max_request_kv_share="
            f"{share:g}), so that no request holds everyone else out." if by_cap else
            f"This model's maximum context length is {ctx} tokens.")  # OpenAI's words
    prompt = f"the prompt is at least {at_least:,} tokens ({why}; counted before tokenizing)"
    asked = body.requested_max_tokens()
    if at_least + 1 > limit:
        raise OpenAIError(400, f"{rule} However, {prompt}, which leaves no room for a "
                               f"completion. Please shorten the prompt to fewer than {limit} "
                               "tokens.", param=body.PROMPT_PARAM, code=code)
    if asked is not None and at_least + asked > limit:
        name = max_tokens_param(body)
        raise OpenAIError(400, f"{rule} However, {prompt} and {name} is {asked}. Please "
                               f"lower {name} to {limit - at_least} or less (less still if the "
                               "prompt has more tokens than this bound), or shorten the "
                               "prompt.", param=name, code=code)


def max_tokens_param(body: GenerationRequest) -> str:
    """The field the client used for max_tokens (chat: max_completion_tokens wins)."""
    return "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None \
        else "max_tokens"


def session_header(request: Request) -> str | None:
    """X-Session-Id, if sent: one, and ASCII. A header value is bytes; a UTF-8 name would
    be read (as latin-1) as another session than the same name in the body's `user`, so
    it is refused, saying to send it there (H7)."""
    given = [v for k, v in request.scope["headers"] if k == b"x-session-id"]
    if len(given) > 1:  # which one a proxy or we would believe is ambiguous
        raise bad_request(f"send one X-Session-Id header, not {len(given)}", "X-Session-Id",
                          code="duplicate_session_id")
    if not given:
        return None
    if not given[0].isascii():
        raise bad_request("X-Session-Id holds a non-ASCII byte: HTTP header values are bytes, "
                          "and a UTF-8 name would be read as another session. Send the "
                          'session as the body\'s "user" instead (for explain: POST '
                          '/scheduler/explain/{id} with {"user": ...})', "X-Session-Id",
                          code="invalid_session_header")
    return given[0].decode("ascii")


def _book_when_done(app, engine: Engine, handle: RequestHandle, tenant: Tenant,
                    delivery: Delivery) -> None:
    """When the request ends (however the client left) and its response is over, book
    what it was served in the usage ledger: its prompt if computed, the tokens that
    reached the client (`delivery`), the rest apart; a gate's refusal is booked by the
    access log, from the 429."""
    async def book() -> None:
        try:
            async for _ in _while_worker_lives(engine, handle.__aiter__()):
                pass
        except OpenAIError:  # the worker died: nothing more will be served
            return
        await delivery.done.wait()
        out = handle.output
        if out is not None and out.rejection is None:
            app.state.ledger.served(tenant.name, out, delivery.tokens)

    task = asyncio.ensure_future(book())
    app.state.settling.add(task)
    task.add_done_callback(app.state.settling.discard)


async def _while_worker_lives(engine: Engine, events: AsyncIterator[StreamEvent],
                              poll_s: float = 1.0) -> AsyncIterator[StreamEvent]:
    """`events`, but a dead worker ends the wait with a 503 instead of hanging forever
    (nobody would ever tick this request again)."""
    pending = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=poll_s)
            if done:
                try:
                    ev = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                yield ev
            elif not engine.running:
                raise OpenAIError(503, "the engine's worker thread stopped (see GET /health)",
                                  "server_error", code="worker_dead")
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.wait({pending})  # let it unwind before closing what it iterates
        await events.aclose()


def check_priority(priority: int, tenant: Tenant) -> None:
    """H5: a priority other than the default is a grant, in a bounded range."""
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise bad_request(f"priority={priority}; use an integer in [-{MAX_PRIORITY}, "
                          f"{MAX_PRIORITY}] (higher runs first; default 0)", "priority",
                          code="priority_out_of_range")
    if priority != 0 and not tenant.may_set_priority:
        raise OpenAIError(403, "setting 'priority' needs a grant: only keys with "
                               '"may_set_priority": true in --api-keys-file (or any client of '
                               "a server started with --allow-priority) may send a priority "
                               "other than 0", "permission_error", param="priority",
                          code="priority_not_granted")


def engine_request_id(tenant: Tenant, session: str, client_id: str) -> str:
    """The engine's id for a client-named request: its tenant and session, then its name
    (a name holds no '/', a tenant none either, so the split is never ambiguous)."""
    return f"{tenant.name}/{session}/{client_id}"


def scrub_explain(out: dict[str, Any], internal: str, client_id: str,
                  session: str) -> dict[str, Any]:
    """engine.explain for its owner: the ids and the session as the client knows them, and
    nothing about other requests (the head that holds it: only whether it is its own)."""
    out = {**out, "request_id": client_id}
    if "session" in out:
        out["session"] = session
    held = out.get("held_by")
    if held is not None:
        mine = held.get("request_id") == internal
        out["held_by"] = ({**held, "request_id": client_id} if mine else
                          {"gate": held.get("gate"), "reason": held.get("reason"),
                           "hard": held.get("hard"), "request_id": None,
                           "note": "the head of the queue is another client's request"})
    return out


def aggregate_sessions(stats: dict[str, Any], own: str | None) -> dict[str, Any]:
    """/scheduler/stats for anyone: the policy's per-session maps folded into counts and
    a spread, plus the caller's own session (named by X-Session-Id) if it has one; of
    the shares (H6), how many tenants (sessions) share now and the caller's own."""
    policy = dict(stats.get("policy") or {})
    counters = policy.pop("counters", None) or {}
    served = policy.pop("served", None) or {}
    queued = policy.pop("queued", None) or {}
    if counters:
        policy["sessions"] = len(counters)
        policy["counter_min"], policy["counter_max"] = min(counters.values()), max(counters.values())
        policy["sessions_waiting"] = len(queued)
        if own in counters:
            policy["own_session"] = {"session": own, "counter": counters[own],
                                     "served": served.get(own), "queued": queued.get(own, 0)}
    out = {**stats, "policy": policy}
    if "shares" in stats:  # H6: how many share now, and the caller's own share only
        table = stats["shares"]
        out["shares"] = {"contenders": len(table), "own": table.get(own)}
    return out

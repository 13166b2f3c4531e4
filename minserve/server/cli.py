"""`minserve serve`: every engine knob as a flag and an environment variable, then uvicorn.

    minserve serve --max-batch-size 8 --max-queue-size 32 --policy fair
    MINSERVE_MAX_QUEUE_SIZE=32 MINSERVE_POLICY=fair minserve serve   # the same, from the environment

The flags are generated from `EngineConfig`'s fields, so a knob added there is
servable at once and the names can never drift from the SPEC's (A2): field
`max_queue_size` -> flag `--max-queue-size` -> variable `MINSERVE_MAX_QUEUE_SIZE` (every
variable carries the project's prefix: bare `MODEL`, `DEVICE` or `SEED` belong to
other tools too).
Precedence: flag > environment > the server's own defaults (`SERVING_DEFAULTS`)
> EngineConfig's default. An empty variable counts as unset. Bad values fail before the model loads, with EngineConfig's
message saying what to change.

Server-only settings carry a `MINSERVE_` prefix (`MINSERVE_HOST`,
`MINSERVE_PORT`, `MINSERVE_API_KEY`): bare `HOST` is set by some shells to the
machine's name, and binding to it by accident would expose the server.

`BackgroundServer` runs the same server in a thread on a free loopback port:
for tests, and for notebooks that want to `curl` their own engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
import typing
from typing import Any

from ..config import (
    ADMISSIONS,
    BACKENDS,
    CUDA_GRAPHS,
    DECODE_ATTENTIONS,
    DTYPES,
    MODEL_RUNNERS,
    POLICIES,
    RECLAIMS,
    SHARES,
    EngineConfig,
    PrefillMode,
)
from .limits import ServerLimits

# What a server shared by several users needs over EngineConfig's defaults (which suit a
# notebook that steps one tick at a time): chunked prefill, so one long prompt cannot
# stall everybody else's stream for its whole prefill (C1). `minserve bench long-prompt`
# measures the stall both ways (docs/benchmarks.md); `--prefill-chunk-size 0` restores
# monolithic prefill. The chat demo (app.py) starts from these too.
#
# And what a server a class shares needs (SPEC H5, H6, docs/security.md): no request may
# reserve more than half the KV budget, so a maximal request never holds everybody out;
# the fair policy orders the waiting requests by tenant (without keys, by session); and
# rows, KV, queue places and a tick's prompt tokens are shared between the tenants
# (sessions) that want them, a lone client getting the whole machine (shares.py).
SERVING_DEFAULTS: dict[str, Any] = {
    # serving speed (docs/benchmarks.md, "Side by side"): blocks with prefix caching,
    # the compact forward where it runs the model, decode attention in C where it can be
    # built (fast/decode_kernel.c), prompt chunks inside the decode forward
    # and room for 64 rows in 2,048 blocks of 16 tokens (1.5 GB of KV for SmolLM2-135M)
    "backend": "paged", "model_runner": "auto", "decode_attention": "auto",
    "cuda_graphs": "auto",  # on a GPU: the decode step replayed (fast/cuda_graphs.py)
    "prefill_mode": "mixed_batch",
    "prefill_chunk_size": 256, "max_batch_size": 64, "num_blocks": 2048,
    # a shared server (SPEC H5, H6): no request takes the whole budget; the rest is shared
    "max_request_kv_share": 0.5, "policy": "fair", "shares": "equal",
    # a tick computes at most 2 chunks of prompt over all rows, split between tenants
    "max_prefill_tokens": 512}
CHOICES = {"policy": POLICIES, "backend": BACKENDS, "dtype": DTYPES, "admission": ADMISSIONS,
           "shares": SHARES, "reclaim": RECLAIMS,
           "model_runner": MODEL_RUNNERS, "decode_attention": DECODE_ATTENTIONS,
           "cuda_graphs": CUDA_GRAPHS,
           "prefill_mode": tuple(m.value for m in PrefillMode)}
SERVER_ENV = {"host": "MINSERVE_HOST", "port": "MINSERVE_PORT", "api_key": "MINSERVE_API_KEY",
              "api_keys_file": "MINSERVE_API_KEYS_FILE"}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def engine_knobs() -> list[tuple[str, type, Any]]:
    """(field name, base type, default) for every EngineConfig field. `int | None` -> int."""
    hints = typing.get_type_hints(EngineConfig)
    knobs = []
    for f in dataclasses.fields(EngineConfig):
        kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
        knobs.append((f.name, kinds[0] if kinds else hints[f.name], f.default))
    return knobs


def add_threads_argument(p: argparse.ArgumentParser, default: str = "torch's, one per core"
                         ) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch intra-op threads (env MINSERVE_THREADS; default: {default}). "
                        "On a machine other programs keep busy, 1 is often much "
                        "faster: see docs/benchmarks.md, 'On a busy machine'")


def serving_threads() -> int:
    """The server's default intra-op threads: every core it may use but one. The spare
    core runs the HTTP side (uvicorn, tokenizing, streaming) while the model computes,
    instead of both fighting over every core; vLLM's CPU build does the same (it
    reserves one core for its front end and runs the model on the rest)."""
    return max(1, len(os.sched_getaffinity(0)) - 1) if hasattr(os, "sched_getaffinity") \
        else max(1, (os.cpu_count() or 1) - 1)


def apply_threads(args: argparse.Namespace, env: dict[str, str] | None = None) -> int | None:
    """Set torch's intra-op threads from --threads / MINSERVE_THREADS; returns what it set."""
    env = dict(os.environ if env is None else env)
    n = args.threads if getattr(args, "threads", None) is not None else env.get("MINSERVE_THREADS")
    if n in (None, ""):
        return None
    try:
        n = int(n)
        if n < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"threads={n!r}; use an int >= 1 (MINSERVE_THREADS, --threads)") from None
    import torch

    torch.set_num_threads(n)
    return n


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    srv = p.add_argument_group("server")
    add_threads_argument(srv, "every core but one, left to the HTTP side")
    srv.add_argument("--host", default=None,
                     help="bind address (env MINSERVE_HOST; default 127.0.0.1, loopback only)")
    srv.add_argument("--port", type=int, default=None,
                     help="TCP port (env MINSERVE_PORT; default 8000)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health "
                          "(env MINSERVE_API_KEY; default: no key)")
    srv.add_argument("--api-keys-file", default=None,
                     help="a JSON file mapping each API key to its tenant and grants, "
                          '{"KEY": {"tenant": "NAME", "may_set_priority": false, '
                          '"may_read_all_stats": false}} (docs/security.md); env '
                          "MINSERVE_API_KEYS_FILE; default: none, no keys (or --api-key's one)")
    srv.add_argument("--forwarded-allow-ips", default=None,
                     help="the reverse proxies whose X-Forwarded-For names the client (comma-"
                          "separated addresses or networks, or *; uvicorn's flag). Default: "
                          "none, the socket's address is the client's (docs/security.md)")
    srv.add_argument("--loopback-addresses-apart", action="store_true",
                     help="count each loopback address (127.0.0.2, 127.0.0.3, ...) as a client "
                          "address of its own for the per-address limits (default: all of "
                          "127.0.0.0/8 and ::1 count as one address, the server's own machine)")
    srv.add_argument("--allow-priority", action="store_true",
                     help="without --api-keys-file: let any client set 'priority' (default: "
                          "priority is a grant of a key in --api-keys-file)")
    srv.add_argument("--default-max-tokens", type=int, default=256,
                     help="chat requests that omit max_tokens get this many (completions "
                          "keep OpenAI's 16); capped by the context left (default: 256)")
    srv.add_argument("--retry-after", type=float, default=1.0,
                     help="seconds sent in Retry-After on 429 refusals (default: 1.0)")
    srv.add_argument("--model-alias", action="append", default=[],
                     help="another name a request's 'model' may use (repeatable; default: "
                          "none, only the model's own name)")
    srv.add_argument("--log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug"],
                     help="uvicorn's and the server's log level (default: info)")
    srv.add_argument("--session-stats", action="store_true",
                     help="show every session's counters on /scheduler/stats to any caller "
                          "(default: only with --api-key, or the caller's own session)")
    lim = p.add_argument_group("limits (ServerLimits; see docs/http_api.md)")
    for f in dataclasses.fields(ServerLimits):
        lim.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                         help=f"default: {f.default!r}")
    add_engine_arguments(p, SERVING_DEFAULTS)


def env_name(knob: str) -> str:
    """The environment variable of an EngineConfig field: `max_queue_size` ->
    `MINSERVE_MAX_QUEUE_SIZE`."""
    return "MINSERVE_" + knob.upper()


# What an EngineConfig field's None (or "") does, for --help: "default None" says nothing
# (config.py's comments, in a line each).
UNSET_MEANS = {
    "model": "the embedded SmolLM2",
    "max_model_len": "the model's max_position_embeddings",
    "max_rows_per_session": "no cap",
    "kv_budget_tokens": "num_blocks x block_size",
    "num_blocks": "derived from max_batch_size x max_model_len",
    "prefill_mode": "derived from --prefill-chunk-size (0: monolithic, else chunked)",
    "max_prefill_tokens": "no budget beyond each prefilling row's chunk",
    "prefill_worker_threads": "half the cores, at least 1",
}


def default_words(name: str, default: Any) -> str:
    """A knob's default as --help shows it: the value, or what leaving it unset does."""
    if default is None or default == "":
        return UNSET_MEANS[name]
    if isinstance(default, bool):
        return "on" if default else "off"
    return repr(default) if isinstance(default, str) and name != "model" else str(default)


def add_engine_arguments(p: argparse.ArgumentParser, defaults: dict[str, Any] | None = None
                         ) -> None:
    """A flag per EngineConfig field (`minserve serve`, `python app.py`); `defaults`: a
    front end's own defaults, shown in --help (in words where a value would not say it)."""
    eng = p.add_argument_group("engine (EngineConfig; each also read from the environment)")
    for name, kind, default in engine_knobs():
        default = (defaults or {}).get(name, default)
        flag = "--" + name.replace("_", "-")
        help_ = f"env {env_name(name)}; default: {default_words(name, default)}"
        if kind is bool:
            eng.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            eng.add_argument(flag, type=kind, default=None, choices=CHOICES.get(name),
                             help=help_)


def _from_env(name: str, kind: type, env: dict[str, str]) -> Any:
    var = env_name(name)
    raw = env.get(var, "")
    if raw == "":
        return None
    if kind is bool:
        if raw.lower() not in TRUE + FALSE:
            raise ValueError(f"{var}={raw!r}; use one of {TRUE + FALSE}")
        return raw.lower() in TRUE
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not a valid {kind.__name__}") from None


def port_problem(host: str, port: int, flag: str, env: str) -> str | None:
    """None if `host:port` can be bound now; else one line saying how to pick another
    (checked before the model loads, so the answer comes in a second, not after it)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve host {host!r}: {e}"
    family, *_, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            return (f"cannot listen on {host}:{port} ({e.strerror or e}); is another server "
                    f"running there? Choose another port with {flag} N or {env}=N")
    return None


def engine_config_from_args(args: argparse.Namespace, env: dict[str, str] | None = None,
                            defaults: dict[str, Any] | None = None) -> EngineConfig:
    """Flags over environment over a front end's `defaults` over EngineConfig's ->
    a validated EngineConfig (ValueError if bad)."""
    env = dict(os.environ if env is None else env)
    values = {}
    for name, kind, _ in engine_knobs():
        flag = getattr(args, name, None)
        value = flag if flag is not None else _from_env(name, kind, env)
        if value is None:
            value = (defaults or {}).get(name)
        if value is not None:
            values[name] = value
    whole = values.get("prefill_mode") == "monolithic"
    if whole and values.get("max_prefill_tokens") == (defaults or {}).get("max_prefill_tokens") \
            and getattr(args, "max_prefill_tokens", None) is None \
            and not env.get(env_name("max_prefill_tokens")):
        # a front end's per-tick budget cuts prompts into pieces; a mode that computes each
        # prompt whole (asked for by name) drops it rather than refuse to start
        values.pop("max_prefill_tokens", None)
    return EngineConfig(**values)


def server_settings(args: argparse.Namespace, env: dict[str, str] | None = None) -> dict:
    env = dict(os.environ if env is None else env)
    host = args.host or env.get(SERVER_ENV["host"]) or "127.0.0.1"
    port = args.port if args.port is not None else int(env.get(SERVER_ENV["port"]) or 8000)
    api_key = args.api_key or env.get(SERVER_ENV["api_key"]) or None
    keys_file = (getattr(args, "api_keys_file", None) or env.get(SERVER_ENV["api_keys_file"])
                 or None)
    if api_key and keys_file:
        raise ValueError("give --api-key (one tenant) or --api-keys-file (tenants), not both")
    return {"host": host, "port": port, "api_key": api_key, "api_keys_file": keys_file}


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)
             if getattr(args, f.name, None) is not None}
    return ServerLimits(**given)


def serve(args: argparse.Namespace) -> int:
    """The `serve` subcommand: build the engine, then run uvicorn until Ctrl-C / SIGTERM."""
    from .lifecycle import EarlyHangup

    early_hangup = EarlyHangup().install()  # a SIGHUP while the model loads: deferred
    try:
        config = engine_config_from_args(args, defaults=SERVING_DEFAULTS)
        settings = server_settings(args)
        limits = limits_from_args(args)
        if apply_threads(args) is None:
            import torch

            torch.set_num_threads(serving_threads())
        api_keys = None
        if settings["api_keys_file"]:
            from .keys import load_api_keys

            api_keys = load_api_keys(settings["api_keys_file"])
        from .guard import parse_trusted

        parse_trusted(args.forwarded_allow_ips)  # a typo fails now, not after the model loads
    except ValueError as e:
        print(f"minserve serve: error: {e}", file=sys.stderr)
        return 2
    problem = port_problem(settings["host"], settings["port"], "--port", SERVER_ENV["port"])
    if problem:
        print(f"minserve serve: error: {problem}", file=sys.stderr)
        return 2
    from ..engine import Engine
    from .api import create_app
    from .lifecycle import MinserveServer, uvicorn_config

    print(f"loading {config.model or 'the embedded SmolLM2-135M-Instruct'} ...", file=sys.stderr)
    try:
        engine = Engine(config)
    except ValueError as e:  # a device this machine lacks, a bad model path, ...
        print(f"minserve serve: error: {e}", file=sys.stderr)
        return 2
    if (settings["host"] not in ("127.0.0.1", "localhost", "::1") and not settings["api_key"]
            and not api_keys):
        print(f"warning: serving on {settings['host']} without --api-key: anyone who can reach "
              "this port can use the model", file=sys.stderr)
    print(engine_line(engine), file=sys.stderr)
    print(tenancy_line(api_keys, settings["api_key"], args.allow_priority), file=sys.stderr)
    print(fairness_line(config, api_keys), file=sys.stderr)
    app = create_app(engine, api_key=settings["api_key"], retry_after_s=args.retry_after,
                     default_max_tokens=args.default_max_tokens,
                     model_aliases=tuple(args.model_alias), limits=limits,
                     session_stats=args.session_stats, api_keys=api_keys,
                     allow_priority=args.allow_priority, keys_file=settings["api_keys_file"],
                     trusted_proxies=args.forwarded_allow_ips,
                     loopback_apart=args.loopback_addresses_apart)
    try:
        MinserveServer(uvicorn_config(app, settings["host"], settings["port"], limits,
                                      args.log_level), early_hangup).run()
    except KeyboardInterrupt:  # a second Ctrl-C during the drain: as uvicorn.run does
        pass
    return 0


def engine_line(engine) -> str:
    """What the engine runs on, in one line: what a benchmark or a bug report needs."""
    import torch

    c = engine.config
    backend = engine.scheduler.backend
    runner = "HF model" if getattr(backend, "runner", None) is None else "compact forward"
    return (f"engine: {c.backend} backend, {runner}, {c.prefill_mode} prefill "
            f"(chunks of {c.prefill_chunk_size or 'whole prompts'}), up to {c.max_batch_size} "
            f"rows, {engine.num_blocks} KV blocks of {c.block_size}, "
            f"{torch.get_num_threads()} torch thread(s)"
            + (f", decode attention in {'C' if backend.kernel else 'PyTorch'}"
               if c.backend == "paged" else "")
            + (f"; prompts on a prefill worker process (pid {remote.proc.pid}, "
               f"{remote.threads} torch thread(s))"
               if (remote := engine.scheduler.remote) is not None and remote.proc else ""))


def tenancy_line(api_keys, api_key, allow_priority: bool) -> str:
    """What `serve` says at start-up about who shares what (H5)."""
    if api_keys:
        names = sorted({t.name for t in api_keys.values()})
        granted = sorted({t.name for t in api_keys.values() if t.may_set_priority})
        return (f"tenants: {len(names)} ({', '.join(names[:8])}{', ...' if len(names) > 8 else ''})"
                f" from {len(api_keys)} keys; each has its own sessions, fair counter, stats, "
                f"explain, request ids and prefix cache; priority granted to: "
                f"{', '.join(granted) or 'nobody'}")
    who = "one --api-key" if api_key else "no key"
    return (f"one tenant ({who}): every client shares the sessions' names, the fair counters "
            "and the prefix cache; give each user a key with --api-keys-file to separate "
            f"them. priority: {'any client may set it (--allow-priority)' if allow_priority else 'fixed at 0'}")


def fairness_line(config: EngineConfig, api_keys) -> str:
    """What `serve` says at start-up about what is fair between whom, and what is not
    (H6): the policy orders who waits, the shares bound what each holds."""
    tenants = sorted({t.name for t in api_keys.values()}) if api_keys else []
    between = (f"the {len(tenants)} tenants of the keys file, then each tenant's sessions"
               if len(tenants) > 1 else
               f"the sessions of the one tenant {tenants[0]!r}" if tenants else
               "sessions (the request's `user` or X-Session-Id; clients that send neither "
               "are all one session, 'default')")
    order = ("fair (VTC): the least-served goes first" if config.policy == "fair" else
             f"{config.policy}: waiting requests go in arrival order, whoever sent them "
             "(--policy fair orders them by who was served least)")
    held = ("rows, KV, queue places and a tick's prompt tokens are shared equally between "
            "those that want them, and lent when nobody else does (a lone client gets the "
            "whole machine)" if config.shares == "equal" else
            "shares off (--shares off): one client may hold every row and queue place "
            "(--shares equal shares them)")
    return f"sharing between {between}. order: policy {order}. holding: {held}"


class BackgroundServer:
    """uvicorn in a daemon thread on 127.0.0.1 and a free port (the OS picks it).

        with BackgroundServer(create_app(engine)) as srv:
            httpx.get(srv.url + "/health")

    The app's lifespan runs as in production: the engine starts with the server
    and stops with it.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        from .lifecycle import MinserveServer, uvicorn_config

        limits = getattr(getattr(app, "state", None), "limits", None) or ServerLimits()
        self.config = uvicorn_config(app, host, port, limits, log_level)
        self.server = MinserveServer(self.config)
        self.thread = threading.Thread(target=self.server.run, name="minserve-http", daemon=True)
        self.url = ""

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

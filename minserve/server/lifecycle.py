"""Running the app under uvicorn: the limits uvicorn enforces, and a graceful SIGTERM.

    config = uvicorn_config(app, host, port, limits)
    MinserveServer(config).run()           # what `minserve serve` does

On the first SIGTERM (or Ctrl-C) `MinserveServer` drains instead of dropping
everyone at once:

    1. stop accepting: the listening sockets close; a request that still
       reaches the app gets 503 `server_shutdown` (`app.state.draining`);
    2. let running and queued requests finish, for up to `shutdown_grace_s`;
    3. then end what is left with an error saying the server is shutting
       down (`Scheduler.abort_all`): a stream gets a final error chunk, a
       finish chunk and `[DONE]`; a non-streaming request gets a 503 in
       OpenAI's shape; everything they held is given back;
    4. hand over to uvicorn's own shutdown (connections close, the lifespan
       stops the engine).

A second signal skips the wait.

SIGHUP reloads the keys file (keys.py; before, it killed the server at once,
exit 129, cutting every stream): the new keys work at once, removed ones get 401
for new requests while the requests they already started finish, counters and
usage stay; a file that is refused leaves the old keys, and says why in the log.
A SIGHUP that comes before the server is up (while the model loads: the keys were
read before it) is deferred, not fatal: `EarlyHangup` notes it in the log, and the
keys file is read again once the server is up.

The access log is minserve's own (accesslog.py: the tenant, never the key or the
query string), so uvicorn's is off; and uvicorn believes `X-Forwarded-For` only
from the proxies `--forwarded-allow-ips` names (by default it trusted any loopback
client, which could then write any address into the log).
"""

from __future__ import annotations

import asyncio
import copy
import signal
import sys
import threading
import time

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from .limits import SHUTTING_DOWN, ServerLimits, timed_h11_protocol


def log_config(log_level: str) -> dict:
    """uvicorn's logging, plus the `minserve` loggers (access log, guard, reloads) on stderr."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["minserve"] = {"handlers": ["default"], "level": log_level.upper(),
                                     "propagate": False}
    return config


def uvicorn_config(app, host: str, port: int, limits: ServerLimits,
                   log_level: str = "info") -> uvicorn.Config:
    state = _app_state(app)
    trusted = getattr(state, "trusted_proxies", None)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          http=timed_h11_protocol(limits.header_timeout_s,
                                                  limits.max_connections,
                                                  getattr(state, "guard", None)),
                          timeout_keep_alive=limits.keep_alive_s,
                          # not uvicorn's limit_concurrency: its 503 is plain text, and
                          # it would refuse /health too (limits.py counts instead)
                          timeout_graceful_shutdown=5,
                          access_log=False, log_config=log_config(log_level),
                          proxy_headers=trusted is not None, forwarded_allow_ips=trusted)


class EarlyHangup:
    """SIGHUP before the server is up: deferred, never fatal (it killed `minserve serve`
    during its model load, exit 129, without a word). `install()` at the start of `serve`;
    the server takes over SIGHUP once up and reloads the keys then if one came
    (`MinserveServer.startup`)."""

    def __init__(self) -> None:
        self.pending = False

    def install(self) -> EarlyHangup:
        if hasattr(signal, "SIGHUP") and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, self._noted)
        return self

    def _noted(self, signum, frame) -> None:
        self.pending = True
        print("SIGHUP while the server starts: deferred; the keys file is read again "
              "once the server is up", file=sys.stderr, flush=True)


class MinserveServer(uvicorn.Server):
    """uvicorn's server with a draining first SIGTERM (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, early_hangup: EarlyHangup | None = None) -> None:
        super().__init__(config)
        self.draining = False
        self.early_hangup = early_hangup
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        # a signal handler can be set from the main thread only (not BackgroundServer's)
        if hasattr(signal, "SIGHUP") and threading.current_thread() is threading.main_thread():
            self._loop.add_signal_handler(signal.SIGHUP, self.reload_keys)
        await super().startup(sockets)
        if self.early_hangup is not None and self.early_hangup.pending:
            self.early_hangup.pending = False
            self.reload_keys()  # the SIGHUP that came while the model loaded

    def reload_keys(self) -> None:
        """SIGHUP: read the keys file again (teacher.reload_keys logs what happened)."""
        from .teacher import reload_keys

        try:
            reload_keys(_app_state(self.config.loaded_app), "SIGHUP")
        except ValueError:
            pass  # logged; the old keys stay and the server goes on

    def handle_exit(self, sig, frame) -> None:
        """Called from the signal handler (or by a test, from any thread)."""
        if self.draining or self._loop is None:
            super().handle_exit(sig, frame)  # second signal, or not started: uvicorn's way
            return
        self.draining = True  # handled here: a drained server exits 0, not by the signal
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))

    async def drain(self) -> None:
        app = self.config.loaded_app
        state = _app_state(app)
        engine = state.engine
        grace = state.limits.shutdown_grace_s
        state.draining = True
        for server in self.servers:  # stop accepting connections; open ones carry on
            server.close()
        deadline = time.monotonic() + grace
        while engine.scheduler.has_work() and time.monotonic() < deadline \
                and not self.should_exit:
            await asyncio.sleep(0.05)
        if engine.scheduler.has_work():
            await asyncio.to_thread(engine.scheduler.abort_all, SHUTTING_DOWN)
        await asyncio.sleep(0.3)  # the streams write their last chunks and [DONE]
        self.should_exit = True


def _app_state(app):
    """The FastAPI app's `state`, under uvicorn's wrappers (proxy headers, ...)."""
    while not hasattr(app, "state") and hasattr(app, "app"):
        app = app.app
    return getattr(app, "state", None)

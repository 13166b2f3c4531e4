"""The access log: one line per request, naming the client's address and its tenant (SPEC H7).

    INFO:     127.0.0.1 alice "POST /v1/completions" 200 41 ms
    INFO:     127.0.0.2 - "GET /v1/models" 401 1 ms

uvicorn's own access log is off (lifecycle.py): it knew no tenant, wrote the query
string (a key sent as `?api_key=` landed in the log in clear text) and took the
address from `X-Forwarded-For` of any loopback client. This one is a pure-ASGI
middleware outside everything else, so it sees every answer, the 401s included:

* the tenant is the name `BearerAuth` found (never the key); `-` without one;
* the address is the socket's peer, or the client a trusted proxy names
  (`--forwarded-allow-ips`; uvicorn's proxy middleware rewrites the scope only then);
* the path is written without its query string (`?…` marks that there was one);
* refusals of an address already throttled get no line each: `ClientGuard` writes one
  line per address every few seconds instead (2,000 guesses were 2,000 lines);
* every error answer is handed to the usage ledger (`UsageLedger.response`), which
  counts the refusals per tenant, or per address before authentication.

A streamed response is logged when it ends, with its whole duration.
"""

from __future__ import annotations

import logging
import time

from .usage import UsageLedger

LOG = logging.getLogger("minserve.access")
QUIET_CODES = ("too_many_auth_failures",)  # summarised by ClientGuard instead


def client_address(scope) -> str:
    client = scope.get("client")
    return client[0] if client else "-"


class AccessLog:
    def __init__(self, app, ledger: UsageLedger, open_tenant: str | None = None) -> None:
        # open_tenant: the one tenant of a server without keys (no BearerAuth names one)
        self.app, self.ledger, self.open_tenant = app, ledger, open_tenant

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # shared with BearerAuth and the error responses
        status, t0 = 0, time.perf_counter()

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            tenant = state.get("minserve_tenant")
            code = state.get("minserve_error_code")
            name = tenant.name if tenant is not None else self.open_tenant
            address = client_address(scope)
            self.ledger.response(name, address, scope["path"], status, code)
            if code not in QUIET_CODES:
                LOG.info('%s %s "%s %s%s" %s %.0f ms', address, name or "-", scope["method"],
                         scope["path"], "?…" if scope.get("query_string") else "",
                         status or "-", (time.perf_counter() - t0) * 1000)

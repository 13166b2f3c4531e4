"""Before authentication: what one client address may hold and try (SPEC H7).

Until a request shows a valid key it is anonymous, so the only name a limit can
use is the client's address. Without these limits one address could take every
connection slot with half-sent request lines (the server answered 503 to everyone,
`/health` included, and logged nothing), and guess keys as fast as the loop answers
(2,000 in 2.2 s):

    what                          limit (ServerLimits)            answer
    open connections              max_connections_per_address    429 + Retry-After, closed
    requests without a valid key  auth_failures_burst at once,   429 too_many_auth_failures
    (401s, a key in the URL,      then auth_failures_per_s       + Retry-After, before the
    a header that never ends)                                    key is even compared

While an address is throttled its requests are refused *before* the key is compared:
otherwise a guess that happens to be right would still answer 200 and the guessing
would go on at full speed. The cost: clients behind the same NAT as a guesser wait
with it (raise the limits for a class behind one address; docs/security.md).

The address is the socket's peer. Behind a reverse proxy the operator names the proxy
(`--forwarded-allow-ips`, uvicorn's convention): uvicorn then takes the client from
`X-Forwarded-For` for the request-level limits, and the proxy's own connections are
not capped per address (they carry everyone's). Without that flag `X-Forwarded-For`
is ignored: a client cannot pick the address it is counted (or logged) under.
IPv6 addresses are counted per /64, the block one host usually holds. State is bounded
(`MAX_ADDRESSES`, least recently seen forgotten first): a flood of addresses costs
memory once.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

LOG = logging.getLogger("minserve.guard")
SUMMARY_EVERY_S = 10.0  # a throttled address gets one log line per this, not one per request


@dataclass
class _Bucket:
    tokens: float
    stamp: float
    refused: int = 0  # requests refused while throttled, since the last log line
    logged_at: float = -math.inf


class ClientGuard:
    """Per-address counts and throttles, shared by the HTTP protocol (connections, header
    timeouts) and `BearerAuth` (failed authentications). One event loop touches it."""

    MAX_ADDRESSES = 10_000

    def __init__(self, limits, trusted_proxies: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self.limits, self.clock = limits, clock
        self.trusted = parse_trusted(trusted_proxies)
        self.on_refused = on_refused  # (address, reason): the usage ledger's anonymous rows
        self.open: dict[str, int] = {}
        self._failures: OrderedDict[str, _Bucket] = OrderedDict()
        self._warned: OrderedDict[str, float] = OrderedDict()

    # ---------------------------------------------------------------- addresses
    def is_trusted_proxy(self, host: str) -> bool:
        if self.trusted == "*":
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self.trusted)

    @staticmethod
    def key(host: str) -> str:
        """What an address is counted under: itself, or its /64 for IPv6."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host
        if ip.version == 6:
            if ip.ipv4_mapped is not None:  # ::ffff:1.2.3.4 is 1.2.3.4
                return str(ip.ipv4_mapped)
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
        return str(ip)

    # ---------------------------------------------------------------- connections
    def connection_opened(self, host: str) -> bool:
        """False: this address already holds its cap of open connections (refuse it)."""
        if self.is_trusted_proxy(host):
            return True
        k = self.key(host)
        if self.open.get(k, 0) >= self.limits.max_connections_per_address:
            self._warn_once(k, f"{k}: {self.open[k]} connections open, the cap per address "
                               "(--max-connections-per-address); refusing more from it")
            if self.on_refused:
                self.on_refused(k, "connections")
            return False
        self.open[k] = self.open.get(k, 0) + 1
        return True

    def connection_closed(self, host: str) -> None:
        if self.is_trusted_proxy(host):
            return
        k = self.key(host)
        n = self.open.get(k, 0) - 1
        if n > 0:
            self.open[k] = n
        else:
            self.open.pop(k, None)

    # ---------------------------------------------------------------- unauthenticated
    def _bucket(self, k: str) -> _Bucket:
        now, cap = self.clock(), float(self.limits.auth_failures_burst)
        b = self._failures.get(k)
        if b is None:
            b = self._failures[k] = _Bucket(cap, now)
            while len(self._failures) > self.MAX_ADDRESSES:
                self._failures.popitem(last=False)
        b.tokens = min(cap, b.tokens + (now - b.stamp) * self.limits.auth_failures_per_s)
        b.stamp = now
        self._failures.move_to_end(k)
        return b

    def retry_after(self, host: str) -> float | None:
        """Seconds until this address may try again without a valid key; None: now."""
        k = self.key(host)  # behind a trusted proxy: the client X-Forwarded-For names
        if k not in self._failures:
            return None
        b = self._bucket(k)
        if b.tokens >= 1:
            return None
        b.refused += 1
        now = self.clock()
        if now - b.logged_at >= SUMMARY_EVERY_S:
            LOG.warning("%s: %d request(s) without a valid API key refused (429) since the "
                        "last line; it may try again in %.1f s", k, b.refused,
                        (1 - b.tokens) / self.limits.auth_failures_per_s)
            b.refused, b.logged_at = 0, now
        return (1 - b.tokens) / self.limits.auth_failures_per_s

    def failed(self, host: str) -> None:
        """A request from `host` without a valid key (or a header that never ended)."""
        k = self.key(host)
        b = self._bucket(k)
        b.tokens -= 1
        if b.tokens < 1:
            now = self.clock()
            if now - b.logged_at >= SUMMARY_EVERY_S:
                LOG.warning("%s: %d requests without a valid API key; its next ones get 429 "
                            "(one more try per %.1f s)", k, self.limits.auth_failures_burst,
                            1 / self.limits.auth_failures_per_s)
                b.logged_at = now

    def _warn_once(self, k: str, message: str) -> None:
        now = self.clock()
        if now - self._warned.get(k, -math.inf) >= SUMMARY_EVERY_S:
            LOG.warning(message)
            self._warned[k] = now
            self._warned.move_to_end(k)
            while len(self._warned) > self.MAX_ADDRESSES:
                self._warned.popitem(last=False)


def parse_trusted(spec: str | None):
    """`--forwarded-allow-ips`: "*", or comma-separated addresses and networks."""
    if spec is None or not spec.strip():
        return ()
    if spec.strip() == "*":
        return "*"
    nets = []
    for part in spec.split(","):
        try:
            nets.append(ipaddress.ip_network(part.strip(), strict=False))
        except ValueError:
            raise ValueError(f"--forwarded-allow-ips: {part.strip()!r} is not an address or "
                             "network; use e.g. 127.0.0.1,10.0.0.0/8 (or *)") from None
    return tuple(nets)


def retry_after_header(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}

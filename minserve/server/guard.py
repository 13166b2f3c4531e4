"""Who a connection counts against: its address until it shows a valid key, then its
tenant (SPEC H7).

Until a request shows a valid key it is anonymous, so the only name a limit can
use is the client's address. Without these limits one address could take every
connection slot with half-sent request lines (the server answered 503 to everyone,
`/health` included, and logged nothing), and guess keys as fast as the loop answers
(2,000 in 2.2 s):

    what                          limit (ServerLimits)            answer
    open connections that have    max_connections_per_address    beyond it: 2 s to show a
    not shown a valid key                                        valid key, else 429 +
                                                                 Retry-After (read, answered,
                                                                 closed); beyond twice it:
                                                                 429 at accept
    connections that have shown   max_tenant_connection_share    429 too_many_connections_for
    a tenant's valid key          of max_connections (a quarter) _tenant + Retry-After, closed
    requests without a valid key  auth_failures_burst at once,   429 too_many_auth_failures
    (401s, a key in the URL,      then auth_failures_per_s       + Retry-After, before the
    a header that never ends)                                    key is even compared

Counted by key once a key is shown. A connection is counted against its address when
it opens; the first request on it that shows a valid key of a tenant moves it to that
tenant (`request_seen`): a class behind one NAT (or notebooks on the server's own
machine) needs no flag, and a keyed flooder is capped as a tenant, whatever its
addresses. The connection is named by its socket's (address, port), which the ASGI
scope carries as `client`. A connection over its address's cap is not cut at accept
(its client would see a transport error, not an answer an SDK reads): it gets the short
header deadline of the health reserve (2 s), and its request is answered, 429 unless
it shows a valid key.

Loopback is one address. 127.0.0.0/8 and ::1 all reach the same machine: a student on
the server's machine could otherwise bind 127.0.0.2, 127.0.0.3, ... and get a cap per
alias. `loopback_apart=True` (`minserve serve --loopback-addresses-apart`) counts each
alias apart, for tests that play several machines on one.

While an address is throttled its requests are refused *before* the key is compared:
otherwise a guess that happens to be right would still answer 200 and the guessing
would go on at full speed. One exception keeps a class behind one NAT working while
one of them loops on a wrong key: a key that authenticated from this address in the
last `GOOD_KEY_TTL_S` is compared (`known_good`). A guesser on that address could test
guesses against those few keys at full speed, but a key is 192 random bits (`keys new`)
or at least 16 characters of 8 kinds: the throttle slows guessing; the key's length is
what defeats it. So a valid key waits at most for the throttle of its first request.

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

import hashlib
import hmac
import ipaddress
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

LOG = logging.getLogger("minserve.guard")
SUMMARY_EVERY_S = 10.0  # a throttled address gets one log line per this, not one per request
GOOD_KEY_TTL_S = 3600.0  # a key that authenticated from an address is compared there this long
LOOPBACK = "loopback"  # what 127.0.0.0/8 and ::1 count as, unless loopback_apart
OK, OVER, REFUSE = "ok", "over", "refuse"  # what `connection_opened` answers


@dataclass
class _Bucket:
    tokens: float
    stamp: float
    refused: int = 0  # requests refused while throttled, since the last log line
    logged_at: float = -math.inf


class ClientGuard:
    """Per-address and per-tenant counts and throttles, shared by the HTTP protocol
    (connections, header timeouts) and `BearerAuth` (keys shown, failed
    authentications). One event loop touches it."""

    MAX_ADDRESSES = 10_000

    def __init__(self, limits, trusted_proxies: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_refused: Callable[[str, str], None] | None = None,
                 loopback_apart: bool = False) -> None:
        self.limits, self.clock = limits, clock
        self.trusted = parse_trusted(trusted_proxies)
        self.loopback_apart = loopback_apart
        self.on_refused = on_refused  # (address, reason): the usage ledger's anonymous rows
        self.open: dict[str, int] = {}  # address -> open connections without a valid key
        self.over: dict[str, int] = {}  # address -> of those, beyond its cap (2 s to key)
        self.keyed: dict[str, int] = {}  # tenant -> open connections that showed its key
        self.conns: dict[tuple, tuple[str, str]] = {}  # (host, port) -> ("address"|"over"|"tenant", name)
        self._failures: OrderedDict[str, _Bucket] = OrderedDict()
        self._warned: OrderedDict[str, float] = OrderedDict()
        self._good: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._salt = secrets.token_bytes(16)  # keys are remembered as salted digests only

    # ---------------------------------------------------------------- addresses
    def is_trusted_proxy(self, host: str) -> bool:
        if self.trusted == "*":
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self.trusted)

    def key(self, host: str) -> str:
        """What an address is counted under: itself, its /64 for IPv6, and every loopback
        alias as one (`LOOPBACK`) unless `loopback_apart`."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host
        if ip.version == 6 and ip.ipv4_mapped is not None:  # ::ffff:1.2.3.4 is 1.2.3.4
            ip = ip.ipv4_mapped
        if ip.is_loopback and not self.loopback_apart:
            return LOOPBACK
        if ip.version == 6:
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
        return str(ip)

    @property
    def tenant_cap(self) -> int:
        """Connections one tenant's keys may hold open: its share of max_connections."""
        return max(1, int(self.limits.max_tenant_connection_share * self.limits.max_connections))

    # ---------------------------------------------------------------- connections
    def connection_opened(self, peer: tuple) -> str:
        """At accept. OK: counted against its address. OVER: its address already holds its
        cap of connections without a valid key; it may show one within 2 s (the protocol
        gives it the health reserve's header deadline), else its request gets 429. REFUSE:
        twice the cap: answered 429 at once."""
        host = peer[0]
        if self.is_trusted_proxy(host):
            return OK
        k, cap = self.key(host), self.limits.max_connections_per_address
        n = self.open.get(k, 0)
        if n >= 2 * cap:
            self._warn_once(k, f"{k}: {n} connections open without a valid key, twice the "
                               "cap per address (--max-connections-per-address); refusing "
                               "more from it at accept")
            if self.on_refused:
                self.on_refused(k, "connections")
            return REFUSE
        self.open[k] = n + 1
        state = OVER if n >= cap else OK
        if state is OVER:
            self.over[k] = self.over.get(k, 0) + 1
        self.conns[tuple(peer)] = ("over" if state is OVER else "address", k)
        return state

    def request_seen(self, peer: tuple | None, tenant: str | None,
                     capped: bool = True) -> str | None:
        """A request on connection `peer` passed authentication, for `tenant` (None: no
        valid key was needed, a server without keys). Move the connection to the tenant's
        count (`capped`: against its share; the one tenant of `--api-key` has none but
        max_connections). Returns a refusal code, or None: "address" (an over-cap
        connection with no key to show), "tenant" (the tenant holds its share)."""
        where = self.conns.get(tuple(peer)) if peer else None
        if where is None:  # behind a trusted proxy, or the socket was not counted
            return None
        kind, name = where
        if tenant is None:
            return "address" if kind == "over" else None
        if kind == "tenant" and name == tenant:
            return None
        if capped and self.keyed.get(tenant, 0) >= self.tenant_cap:
            self._warn_once(f"tenant {tenant}", f"tenant {tenant}: {self.keyed[tenant]} "
                            "connections open, its share (--max-tenant-connection-share); "
                            "refusing more of its requests (429)")
            return "tenant"
        self._uncount(where)
        self.keyed[tenant] = self.keyed.get(tenant, 0) + 1
        self.conns[tuple(peer)] = ("tenant", tenant)
        return None

    def still_over(self, peer: tuple) -> bool:
        """The connection is beyond its address's cap and has shown no valid key: after
        one answer it is closed."""
        return self.conns.get(tuple(peer), ("",))[0] == "over"

    def connection_closed(self, peer: tuple) -> None:
        where = self.conns.pop(tuple(peer), None)
        if where is not None:
            self._uncount(where)

    def _uncount(self, where: tuple[str, str]) -> None:
        kind, name = where
        table = self.keyed if kind == "tenant" else self.open
        for t in (table, self.over) if kind == "over" else (table,):
            n = t.get(name, 0) - 1
            if n > 0:
                t[name] = n
            else:
                t.pop(name, None)

    # ---------------------------------------------------------------- keys that worked here
    def _digest(self, token: bytes) -> bytes:
        return hmac.new(self._salt, token, hashlib.sha256).digest()

    def known_good(self, host: str, token: bytes) -> bool:
        """`token` authenticated from this address within GOOD_KEY_TTL_S: it is compared
        even while the address is throttled (see the module docstring)."""
        k = (self.key(host), self._digest(token))
        until = self._good.get(k)
        if until is None or until < self.clock():
            self._good.pop(k, None)
            return False
        return True

    def good(self, host: str, token: bytes) -> None:
        """`token` just authenticated from `host`."""
        k = (self.key(host), self._digest(token))
        self._good[k] = self.clock() + GOOD_KEY_TTL_S
        self._good.move_to_end(k)
        while len(self._good) > self.MAX_ADDRESSES:
            self._good.popitem(last=False)

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

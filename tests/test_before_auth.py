"""Before authentication, one client address cannot take the server's slots or guess keys at
speed (SPEC H7, minserve/server/guard.py). Real sockets; a client that must look like another
machine binds another loopback address (Linux routes all of 127/8 to the loopback device)."""

from __future__ import annotations

import logging
import socket
import time
from contextlib import contextmanager

import httpx
import pytest

from minserve import Engine, EngineConfig
from minserve.server.api import create_app
from minserve.server.cli import BackgroundServer
from minserve.server.limits import HEALTH_RESERVE, ServerLimits

from .test_server import SMALL, tiny_chat

ALICE, TEACHER = "key-alice-000001", "key-teacher-0001"
KEYS = {ALICE: {"tenant": "alice"},
        TEACHER: {"tenant": "teacher", "may_read_all_stats": True}}
LIMITS = ServerLimits(max_connections=8, max_connections_per_address=3, auth_failures_burst=3,
                      auth_failures_per_s=0.01, header_timeout_s=3)


@contextmanager
def serving(limits=LIMITS, **app_kw):
    model, tokenizer = tiny_chat()
    engine = Engine(EngineConfig(**SMALL), model=model, tokenizer=tokenizer)
    with BackgroundServer(create_app(engine, api_keys=KEYS, limits=limits, **app_kw)) as srv:
        yield srv


@pytest.fixture(scope="module")
def srv():
    with serving() as s:
        yield s


def connect(url, address):
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5, source_address=(address, 0))


def client(address):
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=10)


def get(c, url, key=None, **headers):
    return c.get(url + "/v1/models", headers={**headers, **(
        {"Authorization": f"Bearer {key}"} if key else {})})


def first_line(s, seconds=3.0):
    s.settimeout(seconds)
    try:
        return s.recv(4096).split(b"\r\n")[0].decode()
    except TimeoutError:
        return None


def test_one_address_holds_its_cap_of_connections_and_everyone_else_gets_in(srv):
    n = LIMITS.max_connections + HEALTH_RESERVE
    held = [connect(srv.url, "127.0.0.2") for _ in range(n)]
    for s in held:
        s.sendall(b"GET /v1/mod")  # half a request line, no key
    answers = [first_line(s, 0.5) for s in held]
    refused = [a for a in answers if a and " 429 " in a]
    assert len(refused) == n - LIMITS.max_connections_per_address  # before: none, all held
    with client("127.0.0.1") as c:
        assert c.get(srv.url + "/health").status_code == 200  # before: 503
        assert get(c, srv.url, ALICE).status_code == 200  # before: 503
        usage = c.get(srv.url + "/scheduler/stats",
                      headers={"Authorization": f"Bearer {TEACHER}"}).json()["usage"]
    assert usage["unauthenticated"]["127.0.0.2"]["connections"] == len(refused)
    for s in held:
        s.close()


def test_wrong_keys_are_throttled_per_address_before_any_key_is_compared(srv):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("minserve.guard").addHandler(handler)
    try:
        with client("127.0.0.3") as c:
            statuses = [get(c, srv.url, f"guess-{i:012d}", **{"X-Forwarded-For": "10.0.0.9"})
                        .status_code for i in range(LIMITS.auth_failures_burst)]
            assert statuses == [401] * LIMITS.auth_failures_burst
            throttled = [get(c, srv.url, f"guess-again-{i:06d}") for i in range(20)]
            assert {r.status_code for r in throttled} == {429}  # before: 401 each, at speed
            err = throttled[0].json()["error"]
            assert err["code"] == "too_many_auth_failures"
            assert int(throttled[0].headers["retry-after"]) >= 1
            assert get(c, srv.url, ALICE).status_code == 429  # never compared, so no oracle
        with client("127.0.0.1") as c:  # another address: untouched
            assert get(c, srv.url, ALICE).status_code == 200
            assert get(c, srv.url, "guess-000000000001").status_code == 401
            usage = c.get(srv.url + "/scheduler/stats",
                          headers={"Authorization": f"Bearer {TEACHER}"}).json()["usage"]
    finally:
        logging.getLogger("minserve.guard").removeHandler(handler)
    # X-Forwarded-For from an untrusted client is ignored: the socket's address is counted
    assert usage["unauthenticated"]["127.0.0.3"] == {"auth": 3, "rate": 21}
    assert "10.0.0.9" not in usage["unauthenticated"]
    assert 1 <= len(records) <= 2  # one line for the address, not one per refusal


def test_a_header_that_never_ends_counts_against_its_address(srv):
    silent = [connect(srv.url, "127.0.0.4") for _ in range(LIMITS.auth_failures_burst)]
    for s in silent:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # ... and the headers never end
    for s in silent:
        assert first_line(s, LIMITS.header_timeout_s + 5) == ""  # closed by the deadline
        s.close()
    time.sleep(0.2)
    with client("127.0.0.4") as c:
        assert get(c, srv.url, ALICE).status_code == 429  # before: 200


def test_the_health_reserve_answers_health_checks_only(srv):
    addresses = [f"127.0.1.{i}" for i in range(1, 4)]
    busy = [connect(srv.url, addresses[i % 3]) for i in range(LIMITS.max_connections)]
    time.sleep(0.2)
    extra = connect(srv.url, "127.0.0.1")  # beyond max_connections: in the reserve
    extra.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}"
                  "\r\n\r\n".encode())
    assert " 503 " in first_line(extra)  # before: 200, the reserve was anyone's
    health = connect(srv.url, "127.0.0.1")
    health.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert " 200 " in first_line(health)
    idle = connect(srv.url, "127.0.0.1")
    t0 = time.monotonic()
    assert first_line(idle, 6) == ""  # closed after HEALTH_HEADER_S, not header_timeout_s
    assert time.monotonic() - t0 < LIMITS.header_timeout_s
    for s in (*busy, extra, health, idle):
        s.close()


def test_behind_a_trusted_proxy_the_forwarded_client_is_throttled_not_the_proxy():
    with serving(trusted_proxies="127.0.0.1") as srv, client("127.0.0.1") as c:
        for i in range(LIMITS.auth_failures_burst):
            assert get(c, srv.url, f"guess-{i:012d}", **{"X-Forwarded-For": "10.0.0.7"}
                       ).status_code == 401
        assert get(c, srv.url, "guess-000000000099",
                   **{"X-Forwarded-For": "10.0.0.7"}).status_code == 429
        assert get(c, srv.url, ALICE, **{"X-Forwarded-For": "10.0.0.8"}).status_code == 200

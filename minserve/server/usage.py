"""Who used what: the usage ledger, per tenant, in real tokens (SPEC H7).

The fair policy's counters are virtual time (a tenant served 472 tokens showed
78,069), and the default policy keeps none; refusals were counted per gate, for
nobody. A teacher needs, at the end of a lab, per student:

    prompt_tokens, cached_prompt_tokens, output_tokens   what the engine served (the
                                                         numbers in each response's usage);
                                                         a prompt only if it was computed
                                                         (or cached), a token only if it
                                                         reached the client
    output_tokens_not_delivered                          generated, but the client had hung
                                                         up (not billed, shown apart)
    requests_finished, finish_reasons                    stop / length / cancelled / error:
                                                         a cancel is one event (the 499 of a
                                                         client gone is no refusal)
    refused: gate, size, auth, rate, invalid             what each refusal was for
    preemptions, recomputed_tokens                       work the engine did twice for it
    tokenizer_s                                          CPU time spent tokenizing its prompts

Refusals before a request has a tenant (no key, a wrong key, a throttled address)
are counted per client address instead (`unauthenticated`, teacher only).

The ledger lives in the server layer, fed at two moments: when a request's handle
finishes (`served`: its RequestOutput, which carries the engine's per-request counts)
and when a response is an error (`response`, from the access log middleware). The
engine keeps no per-tenant books: it needs none to schedule, and the server is where
a tenant is known. Everything is updated on the event loop; `/scheduler/stats` reads
it from a worker thread, hence the lock.

What reached the client is the response's to say (`Delivery`): a stream counts the
tokens whose text it has handed to the socket (a token whose character is not complete
yet counts with the one that completes it), a JSON answer all or nothing, a client gone
before its answer (499) nothing. The engine only stops generating at the tick after the
hang-up is noticed; those tokens are `output_tokens_not_delivered`.
"""

from __future__ import annotations

import asyncio
import csv
import io
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

REASONS = ("gate", "size", "auth", "rate", "invalid")
SIZE_CODES = {"request_too_large", "prompt_too_long", "context_length_exceeded",
              "body_too_large"}
RATE_CODES = {"tokenizer_budget", "too_many_auth_failures", "too_many_connections_from_address"}
METERED_PATHS = ("/v1/completions", "/v1/chat/completions")
CSV_COLUMNS = ("tenant", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
               "requests_finished", *(f"refused_{r}" for r in REASONS), "preemptions",
               "recomputed_tokens", "tokenizer_s", "output_tokens_not_delivered")
CLIENT_GONE = 499  # nginx's "client closed request": a cancel, booked once as such


@dataclass
class Delivery:
    """What of one request's output reached its client: `tokens` (None: all of them),
    set by the response as it goes (api.py) and read when the request is booked."""

    tokens: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the response is over


@dataclass
class TenantUsage:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    requests_finished: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    preemptions: int = 0
    recomputed_tokens: int = 0
    tokenizer_s: float = 0.0
    output_tokens_not_delivered: int = 0


def refusal_reason(status: int, code: str | None) -> str | None:
    """The ledger's reason for an error response (None: not a refusal; a client that
    went away, 499, cancelled its own request: booked once, as a cancel)."""
    if status < 400 or status >= 500 or status == CLIENT_GONE:
        return None
    if code in RATE_CODES:
        return "rate"
    if status == 429:
        return "gate"  # a gate's Rejection (G1, G2, G3), named by its own reason code
    if status in (401, 403):
        return "auth"
    if code in SIZE_CODES or status == 413:
        return "size"
    return "invalid"


class UsageLedger:
    """Usage per tenant (and refusals per address before authentication)."""

    MAX_ADDRESSES = 1000  # anonymous rows kept, least recently refused forgotten first

    def __init__(self) -> None:
        self.since = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._tenants: dict[str, TenantUsage] = {}
        self._anonymous: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    def _row(self, tenant: str) -> TenantUsage:
        return self._tenants.setdefault(tenant, TenantUsage())

    # ---------------------------------------------------------------- fed by the server
    def served(self, tenant: str, out, delivered: int | None = None) -> None:
        """A request that ran or was cancelled (any end but a gate's refusal): its
        RequestOutput, and how many of its tokens reached the client (None: all)."""
        made = len(out.token_ids)
        got = made if delivered is None else min(made, delivered)
        with self._lock:
            row = self._row(tenant)
            row.prompt_tokens += getattr(out, "num_prompt_tokens_processed",
                                         len(out.prompt_token_ids))
            row.cached_prompt_tokens += out.num_cached_tokens
            row.output_tokens += got
            row.output_tokens_not_delivered += made - got
            row.requests_finished += 1
            reason = out.finish_reason or "unknown"
            row.finish_reasons[reason] = row.finish_reasons.get(reason, 0) + 1
            row.preemptions += getattr(out, "num_preemptions", 0)
            row.recomputed_tokens += getattr(out, "num_recomputed_tokens", 0)

    def tokenized(self, tenant: str, seconds: float) -> None:
        with self._lock:
            self._row(tenant).tokenizer_s += seconds

    def refused(self, tenant: str, reason: str) -> None:
        with self._lock:
            self._row(tenant).refused[reason] += 1

    def refused_anonymous(self, address: str, reason: str) -> None:
        with self._lock:
            row = self._anonymous.setdefault(address, {})
            row[reason] = row.get(reason, 0) + 1
            self._anonymous.move_to_end(address)
            while len(self._anonymous) > self.MAX_ADDRESSES:
                self._anonymous.popitem(last=False)

    def response(self, tenant: str | None, address: str, path: str, status: int,
                 code: str | None) -> None:
        """An answer the access log saw: counted if it refused a generation request (or
        refused anyone for want of a key or a grant)."""
        reason = refusal_reason(status, code)
        if reason is None:
            return
        if tenant is None:
            if reason in ("auth", "rate"):
                self.refused_anonymous(address, reason)
        elif path in METERED_PATHS or reason == "auth":
            self.refused(tenant, reason)

    # ---------------------------------------------------------------- read by the teacher
    def view(self, tenants: list[str], anonymous: bool) -> dict[str, Any]:
        """`tenants`' rows (zeros for one that never called) and, for the teacher, the
        refusals by address."""
        with self._lock:
            rows = {t: asdict(self._tenants.get(t) or TenantUsage()) for t in tenants}
            out: dict[str, Any] = {"since": self.since, "tenants": rows}
            if anonymous:
                out["unauthenticated"] = {a: dict(r) for a, r in self._anonymous.items()}
        for r in rows.values():
            r["tokenizer_s"] = round(r["tokenizer_s"], 4)
        return out

    def known_tenants(self) -> set[str]:
        with self._lock:
            return set(self._tenants)

    def csv(self, tenants: list[str]) -> str:
        """One row per tenant, for a lab's report (`GET /scheduler/usage.csv`)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(CSV_COLUMNS)
        for name, r in sorted(self.view(tenants, anonymous=False)["tenants"].items()):
            w.writerow([name, r["prompt_tokens"], r["cached_prompt_tokens"], r["output_tokens"],
                        r["requests_finished"], *(r["refused"][x] for x in REASONS),
                        r["preemptions"], r["recomputed_tokens"], r["tokenizer_s"],
                        r["output_tokens_not_delivered"]])
        return buf.getvalue()

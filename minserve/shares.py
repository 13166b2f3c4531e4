"""Shares: what each tenant may hold of what is contended, lent and taken back (SPEC H6).

A server a class shares has four things its users contend for: batch rows, the KV
budget (G2), places in the pending queue (G1) and the prompt tokens of one tick (C1).
With `EngineConfig(shares="equal")` (what `minserve serve` sets) each is shared out the
same way, max-min fair (Bertsekas and Gallager, *Data Networks*, 6.5.2; the
allocation weighted fair queueing and VTC converge to):

    who        the tenants with a request waiting or running now (without keys, the
               sessions): the "contenders"; inside a tenant, its sessions again
    how much   an equal part: 64 rows between 2 tenants, 32 each; a tenant's 32 split
               again between its sessions that want rows (at least one row each)
    lent       a share nobody else wants is lent: one client alone fills the batch
    held back  a unit (tenant, or a session inside one) beyond its share admits nothing
               new while a sibling that is owed a row waits (`holds`)
    taken back a waiting unit that is owed a row (`Book.owed`: one more row of its
               request still fits its share) and is held by a gate takes the row
               back: the borrowers' rows beyond their share (`borrowed`) are preempted,
               newest first, until its request fits (`to_take_back`,
               `Admission.reclaim`, in T1; recompute: the row goes back to pending and
               recomputes its prompt and tokens on re-admission, its stream going on)

    rows  alice ██████████████████████████████████████████ 40, share 32: borrowing 8
          bob   ░                                          0, waiting, owed a row
          -> T1 preempts alice's newest row and admits bob's request, in the same tick

Why shares and not fixed caps (`max_rows_per_session`, `max_tenant_kv_share`): a cap
holds a lone client to 4 rows of 64 while 60 sit empty, and a tenant that invents
sessions walks past a per-session cap; a share depends on who is there now.

What is borrowed. A unit's running rows in the order they were admitted: the first
ones, while they fit its share of rows (at least one) and of KV, are its own; the rest
are borrowed, and so is a row that alone reserves more KV than the share (a request
beyond a tenant's share runs only on what is lent, so legal requests lock nobody out).
Only borrowed rows are ever taken back, and only for a unit that is owed a row: what a
borrower gives back is its own over-share, never a row within anyone's share.

The bound a waiting unit gets (docs/security.md, docs/gates.md). When its request is
the one T1 chooses (the first, in the policy's order, that no share holds back) and a
gate holds it, T1 takes back borrowed rows at once, in that tick, if that makes it fit
(never a row that has finished: T3 evicts those after T1, and when they make the room it
waits that one tick): it is admitted in the first tick after it arrived (the second at
most), and streams its first token when
its prefill is done (a short prompt: in that tick; in all, ceil(P / c) ticks, c its
part of the tick's prompt tokens). If nothing is borrowed (every unit holds at most its
share; e.g. more tenants than rows), it waits for a row to end, as before: at most one
row's lifetime,

    L = ceil(P / chunk) + M ticks      P, M: the largest prompt and max_tokens a row may
                                       have (max_request_kv_share bounds P + M)

because nothing else is admitted before it (G4: the gates soft-hold it and T1 stops
there) and a request that could never fit alone was refused (hard) at submit or admit.
Under the fair policy a newcomer's counter is lifted to the least waiting one (P4),
so its request is the first of a unit under its share from its arrival unless another
such unit's request ties with it and arrived earlier (it then takes back its rows in
the same T1).

Invariant (liveness): when nothing runs, every unit holds nothing; a request that fits
its share (at each level) is then held by nobody, and one that does not is held only
while such a request waits, so something is always admitted. Taking back never loops:
a unit owed a row, once admitted, holds no borrowed row, and a row taken back in a
tick is not admitted again in that tick (`Scheduler.admit_pending`).
Pure functions of the queues they are given, like the gates: nothing here changes the
scheduler; `Book` is counted afresh for each decision.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .request import Rejection, Request

Node = tuple  # (tenant-or-session,) or (tenant, session): a unit, at its level


def unit(req: Request) -> str:
    """Who a share belongs to: the request's tenant when the server names one, else its
    session (as the fair policy's counters, `FairPolicy.unit`)."""
    return req.session_id if req.tenant is None else req.tenant


def path(req: Request) -> list[Node]:
    """The units `req` belongs to, outermost first: its tenant, then its session in it."""
    top = (unit(req),)
    return [top] if req.tenant is None else [top, (req.tenant, req.session_id)]


@dataclass
class Book:
    """Who holds what now and who waits, counted once per decision.

    rows[n], kv[n]      batch rows and KV reserved (R1: what rows hold now, so under
                        preempt what they grew since admission too) by unit `n`
    running[n]          those rows, in the order they were admitted
    siblings[parent]    the contending units under `parent` (() for the top level)
    first[n]            the first waiting request of `n` in the policy's order
    """

    rows_total: int
    kv_total: int
    rows: Counter = field(default_factory=Counter)
    kv: Counter = field(default_factory=Counter)
    running: dict[Node, list[Request]] = field(default_factory=dict)
    siblings: dict[Node, list[Node]] = field(default_factory=dict)
    first: dict[Node, Request] = field(default_factory=dict)

    @classmethod
    def count(cls, running: list[Request], waiting: list[Request], rows_total: int,
              kv_total: int) -> Book:
        b = cls(rows_total, kv_total)
        for r in sorted(running, key=admitted_order):
            for n in path(r):
                b.rows[n] += 1
                b.kv[n] += r.reserved_tokens
                b.running.setdefault(n, []).append(r)
                b._contend(n)
        for r in waiting:  # in the policy's order
            for n in path(r):
                b.first.setdefault(n, r)
                b._contend(n)
        return b

    def _contend(self, n: Node) -> None:
        sibs = self.siblings.setdefault(n[:-1], [])
        if n not in sibs:
            sibs.append(n)

    def part(self, n: Node) -> float:
        """The fraction of the whole that unit `n` may hold now: 1 / contenders at each
        level down to it."""
        f = 1.0
        for depth in range(1, len(n) + 1):
            f /= max(1, len(self.siblings.get(n[:depth - 1], ())))
        return f

    def share(self, n: Node) -> tuple[float, float]:
        """(rows, KV tokens) unit `n` may hold now without borrowing."""
        p = self.part(n)
        return p * self.rows_total, p * self.kv_total

    def owed(self, n: Node, need: int) -> bool:
        """One more row of `need` KV tokens still fits `n`'s share: its rows + 1 within
        its share of rows (at least one row: with more tenants than rows each may run
        one) and its KV + `need` within its share of KV. A unit owed a row goes before
        those beyond their share, and may take back what they borrowed."""
        rows, kv = self.share(n)
        return self.rows[n] + 1 <= max(1.0, rows) and self.kv[n] + need <= kv

    def borrowed(self, n: Node) -> list[Request]:
        """`n`'s rows beyond its share, newest first: in the order they were admitted,
        the rows after the first max(1, share of rows), and every row from the one that
        takes its KV past its share of KV on."""
        rows, kv = self.share(n)
        out, held = [], 0
        for i, r in enumerate(self.running.get(n, ()), 1):
            held += r.reserved_tokens
            if i > max(1.0, rows) or held > kv:
                out.append(r)
        return out[::-1]


def admitted_order(req: Request) -> tuple[float, int]:
    """The order rows were admitted in (the stamp T1 gives; a row preempted and admitted
    again counts from its new admission)."""
    return (req.timing.admitted or 0.0, req.arrival_seq)


def holds(book: Book, req: Request, need_of) -> Rejection | None:
    """A share holds `req` back (soft) when one more row of it does not fit one of its
    units' share (`Book.owed`) while a sibling unit that is owed a row waits (its first
    waiting request fits its share). `need_of(r)`: the KV tokens admitting `r` reserves
    (`Admission.need`). Outermost level first: tenants, then sessions inside one."""
    for n in path(req):
        if book.owed(n, need_of(req)):
            continue
        for sib in book.siblings.get(n[:-1], ()):
            w = book.first.get(sib)
            if sib != n and w is not None and book.owed(sib, need_of(w)):
                rows, kv = book.share(n)
                level = "tenant" if len(n) == 1 and req.tenant is not None else "session"
                return Rejection(
                    gate="share", reason="over_share", hard=False,
                    message=(f"its {level} holds {book.rows[n]} batch rows and "
                             f"{book.kv[n]} KV tokens; its share now is {rows:g} rows and "
                             f"{kv:g} KV tokens ({len(book.siblings[n[:-1]])} {level}s want "
                             f"them), and a {level} under its share waits: it goes first"),
                    numbers={"level": level, "rows": book.rows[n], "share_rows": round(rows, 2),
                             "kv": book.kv[n], "share_kv": round(kv, 2), "need": need_of(req),
                             "contenders": len(book.siblings[n[:-1]])})
    return None


def to_take_back(book: Book, req: Request, need_of) -> list[Request]:
    """The rows a waiting `req` may take back, in the order to take them: at the
    outermost level where its unit is owed a row (`Book.owed`), the borrowed rows of its
    sibling units (`Book.borrowed`), newest first. Never a row of its own unit, never a
    row within its unit's share: only over-share (SPEC H6)."""
    for n in path(req):
        if not book.owed(n, need_of(req)):
            continue
        rows = [r for sib in book.siblings.get(n[:-1], ()) if sib != n
                for r in book.borrowed(sib)]
        if rows:
            return sorted(rows, key=admitted_order, reverse=True)
    return []


def first_victims(book: Book, running: list[Request]) -> list[Request]:
    """Under admission="preempt", the rows to preempt first when decode runs out of KV:
    those of the unit furthest above its KV share (what it holds over what it may hold),
    then of its session furthest above its own; all `running` if no unit is above its
    share."""
    pool, level = running, ()
    while True:
        units = {n[:len(level) + 1] for r in pool for n in path(r) if len(n) == len(level) + 1}
        ratio = {n: book.kv[n] / max(1e-9, book.share(n)[1]) for n in units}
        worst = max(sorted(ratio), key=lambda n: ratio[n], default=None)
        if worst is None or ratio[worst] <= 1:
            return pool
        pool, level = [r for r in pool if worst in path(r)], worst


def queue_place(waiting: list[Request], running: list[Request], req: Request,
                max_queue_size: int) -> tuple[Rejection | None, Request | None]:
    """G1 per tenant (sessions without keys): `req`'s unit may have `max_queue_size /
    contenders` requests waiting. While the queue has room, anyone may borrow places;
    when it is full, `req` is refused if its unit is at its share, else the newest
    waiting request of the unit with the most waiting (above its share, since the queue
    is full and `req`'s unit is under) is pushed out to make room ("longest queue drop"
    in fair buffer management). Returns (the refusal, for `req` or for the request
    pushed out, and the request it refuses), or (None, None)."""
    counts = Counter(unit(r) for r in waiting)
    contenders = len(set(counts) | {unit(r) for r in running} | {unit(req)})
    share = max_queue_size / contenders
    if len(waiting) < max_queue_size:
        return None, None
    most = max(sorted(counts), key=lambda u: counts[u])
    who = req if counts[unit(req)] + 1 > share else max(
        (r for r in waiting if unit(r) == most), key=lambda r: (-r.priority, r.arrival_seq))
    n = counts[unit(who)]
    return Rejection(
        gate="G1", reason="queue_share", hard=True,
        message=(f"the pending queue is full ({max_queue_size}) and its tenant has {n} "
                 f"requests waiting, its share of the queue now being {share:g} "
                 f"({max_queue_size} places / {contenders} tenants waiting or running); "
                 "retry when some of yours have started"),
        numbers={"waiting": n, "share": round(share, 2), "max_queue_size": max_queue_size,
                 "contenders": contenders}), who


def split(total: int, wants: list[int]) -> list[int]:
    """Max-min fair: `total` tokens split so that each gets min(its want, an equal
    part), what someone does not use re-split among the rest (water-filling)."""
    give, left = [0] * len(wants), total
    open_ = [i for i, w in enumerate(wants) if w > 0]
    while left > 0 and open_:
        part = max(1, left // len(open_))
        for i in list(open_):
            g = min(part, wants[i] - give[i], left)
            give[i] += g
            left -= g
            if give[i] == wants[i]:
                open_.remove(i)
            if left == 0:
                break
    return give


def split_prompt_tokens(reqs: list[Request], wants: list[int], budget: int) -> list[int]:
    """A tick's prompt-token budget (`max_prefill_tokens`) split max-min fair between
    the units whose rows prefill, then between each unit's rows. sum <= budget."""
    units = list(dict.fromkeys(unit(r) for r in reqs))
    per_unit = split(budget, [sum(w for r, w in zip(reqs, wants) if unit(r) == u)
                              for u in units])
    give = [0] * len(reqs)
    for u, tokens in zip(units, per_unit):
        idx = [i for i, r in enumerate(reqs) if unit(r) == u]
        for i, g in zip(idx, split(tokens, [wants[i] for i in idx])):
            give[i] = g
    return give


def table(book: Book, held: set[Node]) -> dict[str, dict[str, Any]]:
    """Stats (G5) and the stepper: per top-level unit, what it holds, its share now,
    how many of its rows are borrowed (beyond its share, `Book.borrowed`) and whether a
    share holds it back."""
    out = {}
    for n in book.siblings.get((), []):
        rows, kv = book.share(n)
        lent = len(book.borrowed(n))
        out[n[0]] = {"rows": book.rows[n], "share_rows": round(rows, 2), "kv": book.kv[n],
                     "share_kv": round(kv, 2), "waiting": n in book.first,
                     "borrowing": lent > 0, "borrowed_rows": lent,
                     "held_back": n in held}
    return out

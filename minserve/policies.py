"""Policies: who runs next (SPEC P).

One interface, seven hooks, called by the scheduler at fixed points:

    hook                  when                              FCFS       Fair (VTC)
    on_request_arrived    request enters `pending`          insert     insert; lift counter (P4)
    peek_next             admit inspects the head           head       head
    pick_next             admit commits to the head         pop head   pop head
    on_tokens_processed   after prefill chunks / decode     no-op      charge the session (P3)
    on_request_finished   row leaves `active`               no-op      cleanup
    on_request_preempted  a running row goes back to wait   insert     insert, counter kept
    choose_victim         preemption needs a row's KV       lowest priority, latest arrival

A policy *is* the pending queue (Q1): it holds the requests that wait and
decides their order. Peek and pick are separate because admission may
soft-hold the head (G4): peek, run the gates, and only pick if they pass, so a
held request keeps its place.

Thread-safety: the scheduler calls every hook under its queue lock.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from .request import Request


class Policy(ABC):
    name: str = "base"

    @abstractmethod
    def on_request_arrived(self, req: Request) -> None:
        """`req` joins the pending queue."""

    @abstractmethod
    def peek_next(self) -> Request | None:
        """The request admission would take next, or None when nothing waits. No change."""

    @abstractmethod
    def pick_next(self) -> Request:
        """Remove and return what `peek_next` returned. Only called after a peek."""

    @abstractmethod
    def remove(self, req: Request) -> None:
        """Take a waiting request out (cancelled, or refused by a gate)."""

    def pick(self, req: Request) -> Request:
        """Admit a waiting request that is not the head: admission skipped a head whose
        session already holds its share of the batch (`max_rows_per_session`)."""
        self.remove(req)
        return req

    def on_tokens_processed(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        """`req` just had `prompt_tokens` computed in prefill / `output_tokens` decoded."""

    def on_request_finished(self, req: Request) -> None:
        """`req` left the engine (finished, cancelled or evicted)."""

    def on_request_preempted(self, req: Request) -> None:
        """`req` was running and goes back to `pending` (admission="preempt", P6): its
        KV was dropped and will be recomputed when it is admitted again. By default it
        re-enters like an arrival, by its own key, so under FCFS it keeps its place:
        ahead of everything that arrived after it."""
        self.on_request_arrived(req)

    def choose_victim(self, running: list[Request]) -> Request:
        """Which running row to preempt when decode would run out of KV (P6).

        The lowest priority, then the latest arrival (vLLM's rule too). Why: a
        higher-priority row is never sacrificed for a lower one; among equals the
        latest arrival has usually done the least work (least to recompute), and it
        is the one this policy would have admitted last, so preempting it undoes
        the newest decision instead of reordering old ones."""
        return min(running, key=lambda r: (r.priority, -r.arrival_seq))

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Waiting requests in the order they would be admitted (for stats and viz)."""

    @abstractmethod
    def __len__(self) -> int: ...

    def stats(self) -> dict[str, Any]:
        return {"name": self.name}


class FCFSPolicy(Policy):
    """P1: first come, first served within priority tiers.

    Key `(-priority, arrival_seq)`: a higher priority goes first, then the
    earlier arrival. Cheap and predictable; but one heavy user who sends many
    requests at the same priority fills the queue ahead of everyone else.
    """

    name = "fcfs"

    def __init__(self) -> None:
        # Kept sorted by key; a plain list is the clearest structure for the
        # queue sizes a teaching engine sees (bisect insert is O(n), fine here).
        self._keys: list[tuple[int, int]] = []
        self._reqs: list[Request] = []

    @staticmethod
    def key(req: Request) -> tuple[int, int]:
        return (-req.priority, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        k = self.key(req)
        i = bisect.bisect(self._keys, k)
        self._keys.insert(i, k)
        self._reqs.insert(i, req)

    def peek_next(self) -> Request | None:
        return self._reqs[0] if self._reqs else None

    def pick_next(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, req: Request) -> None:
        i = self._reqs.index(req)
        del self._keys[i], self._reqs[i]

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._reqs))

    def __len__(self) -> int:
        return len(self._reqs)

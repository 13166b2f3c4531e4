# correct: one queue per session (its head is its best request), the lift written with a helper
class VTCLab(Policy):
    """VTC within one priority tier at a time, one queue per session."""

    name = "vtc-lab"

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0):
        self.w_in, self.w_out = w_in, w_out
        self.counters: dict[str, float] = {}
        self.queues: dict[str, list[Request]] = {}
        self.last_left: str | None = None

    def key(self, req: Request):
        return (-req.priority, self.counters.get(req.session_id, 0.0), req.arrival_seq)

    def _clock(self) -> float | None:
        busy = [s for s, q in self.queues.items() if q]
        if busy:
            return min(self.counters[s] for s in busy)
        return self.counters[self.last_left] if self.last_left is not None else None

    def on_request_arrived(self, req: Request) -> None:
        s = req.session_id
        if not self.queues.get(s):
            clock = self._clock()
            self.counters[s] = max(self.counters.get(s, 0.0), clock if clock is not None else 0.0)
        q = self.queues.setdefault(s, [])
        q.append(req)
        q.sort(key=lambda r: (-r.priority, r.arrival_seq))

    def on_tokens_processed(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        s = req.session_id
        self.counters[s] = self.counters.get(s, 0.0) + (self.w_in * prompt_tokens
                                                        + self.w_out * output_tokens)

    def peek_next(self) -> Request | None:
        heads = [q[0] for q in self.queues.values() if q]
        return min(heads, key=self.key) if heads else None

    def pick_next(self) -> Request:
        req = self.peek_next()
        self.remove(req)
        return req

    def remove(self, req: Request) -> None:
        q = self.queues.get(req.session_id, [])
        self.queues[req.session_id] = [r for r in q if r is not req]
        if not len(self):
            self.last_left = req.session_id

    def __iter__(self):
        return iter(sorted((r for q in self.queues.values() for r in q), key=self.key))

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

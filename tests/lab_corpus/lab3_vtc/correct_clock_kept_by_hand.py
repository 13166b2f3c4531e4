# correct: the waiting sessions kept in a dict of counts (no scan of the list at each arrival); the clock read from it
class VTCLab(Policy):
    """VTC within one priority tier at a time (minserve/fair.py keeps a clock per tier)."""

    name = "vtc-lab"

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0):
        self.w_in, self.w_out = w_in, w_out
        self.counters: dict[str, float] = {}
        self.waiting: list[Request] = []
        self.last_left: str | None = None
        self.queued: dict[str, int] = {}  # session -> requests waiting

    def key(self, req: Request):
        return -req.priority, self.counters.get(req.session_id, 0.0), req.arrival_seq

    def on_request_arrived(self, req: Request) -> None:
        s = req.session_id
        own = self.counters.get(s, 0.0)
        if not self.queued.get(s):
            if self.queued:
                own = max(own, min(self.counters[t] for t in self.queued))
            elif self.last_left is not None:
                own = max(own, self.counters[self.last_left])
        self.counters[s] = own
        self.queued[s] = self.queued.get(s, 0) + 1
        self.waiting.append(req)

    def on_tokens_processed(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        s = req.session_id
        self.counters[s] = self.counters.get(s, 0.0) + self.w_in * prompt_tokens
        self.counters[s] += self.w_out * output_tokens

    def peek_next(self) -> Request | None:
        return min(self.waiting, key=self.key) if self.waiting else None

    def pick_next(self) -> Request:
        req = self.peek_next()
        self.remove(req)
        return req

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]
        self.queued[req.session_id] -= 1
        if not self.queued[req.session_id]:
            del self.queued[req.session_id]
        if not self.waiting:
            self.last_left = req.session_id

    def __iter__(self):
        return iter(sorted(self.waiting, key=self.key))

    def __len__(self) -> int:
        return len(self.waiting)

# mistake: the lift runs even when the session still has requests waiting
# expect: where to look: VTCLab
# expect: if its session has nothing waiting
class VTCLab(Policy):
    """VTC within one priority tier at a time (minserve/fair.py keeps a clock per tier)."""

    name = "vtc-lab"

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0):
        self.w_in, self.w_out = w_in, w_out
        self.counters: dict[str, float] = {}
        self.waiting: list[Request] = []
        self.last_left: str | None = None

    def key(self, req: Request):
        return (-req.priority, self.counters.get(req.session_id, 0.0), req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        s = req.session_id
        self.counters.setdefault(s, 0.0)
        rivals = {r.session_id for r in self.waiting if r.session_id != s}
        if True:
            if rivals:
                clock = min(self.counters[r] for r in rivals)
            elif self.last_left is not None:
                clock = self.counters[self.last_left]
            else:
                clock = None
            if clock is not None:
                self.counters[s] = max(self.counters[s], clock)
        self.waiting.append(req)

    def on_tokens_processed(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        s = req.session_id
        self.counters[s] = (self.counters.get(s, 0.0) + self.w_in * prompt_tokens
                            + self.w_out * output_tokens)

    # --- given -------------------------------------------------------------------------
    def peek_next(self) -> Request | None:
        return min(self.waiting, key=self.key) if self.waiting else None

    def pick_next(self) -> Request:
        req = self.peek_next()
        self.remove(req)
        return req

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]
        if not self.waiting:
            self.last_left = req.session_id

    def __iter__(self):
        return iter(sorted(self.waiting, key=self.key))

    def __len__(self) -> int:
        return len(self.waiting)

# mistake: aging counts only the admissions of *other* sessions, so a long request whose own session keeps sending short ones never ages: it starves behind them
# (the first property it breaks depends on the draw: the wait bound, or __iter__'s order, which its key, aged by other sessions' admissions, does not keep)
# expect: where to look: MyPolicy.
class MyPolicy(Policy):
    name = "mine"

    def __init__(self):
        self.waiting: list[Request] = []
        self.admitted: dict[str, int] = {}  # admissions per session

    def key(self, req: Request):
        others = sum(n for s, n in self.admitted.items() if s != req.session_id)
        age = others - req._others_at
        return (-req.priority, req.prompt_len + req.max_tokens - 4 * age, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        req._others_at = sum(n for s, n in self.admitted.items() if s != req.session_id)
        self.waiting.append(req)

    def peek_next(self) -> Request | None:
        return min(self.waiting, key=self.key) if self.waiting else None

    def pick_next(self) -> Request:
        req = self.peek_next()
        self.remove(req)
        self.admitted[req.session_id] = self.admitted.get(req.session_id, 0) + 1
        return req

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]

    def __iter__(self):
        return iter(sorted(self.waiting, key=self.key))

    def __len__(self) -> int:
        return len(self.waiting)

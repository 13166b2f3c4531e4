# correct: a fair share of admissions between sessions with per-request aging, so a long request in a busy session still goes; __iter__ simulates the picks
class MyPolicy(Policy):
    name = "mine"

    def __init__(self):
        self.waiting: list[Request] = []
        self.turns: dict[str, int] = {}
        self.admitted = 0

    def _key(self, req: Request, turns: dict, admitted: int):
        age = admitted - req._arrived_at
        return (-req.priority, turns.get(req.session_id, 0) - age // 8, req.arrival_seq)

    def key(self, req: Request):
        return self._key(req, self.turns, self.admitted)

    def on_request_arrived(self, req: Request) -> None:
        # a session with nothing waiting starts level with the least-served one waiting
        # (as VTC's lift): never a burst as long as the others' history
        waiting = {r.session_id for r in self.waiting}
        if req.session_id not in waiting and waiting:
            level = min(self.turns.get(s, 0) for s in waiting)
            self.turns[req.session_id] = max(self.turns.get(req.session_id, 0), level)
        req._arrived_at = self.admitted
        self.waiting.append(req)

    def peek_next(self) -> Request | None:
        return min(self.waiting, key=self.key) if self.waiting else None

    def pick_next(self) -> Request:
        req = self.peek_next()
        self.remove(req)
        self.turns[req.session_id] = self.turns.get(req.session_id, 0) + 1
        self.admitted += 1
        return req

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]

    def __iter__(self):
        turns, admitted, left, order = dict(self.turns), self.admitted, list(self.waiting), []
        while left:
            head = min(left, key=lambda r: self._key(r, turns, admitted))
            order.append(head)
            left.remove(head)
            turns[head.session_id] = turns.get(head.session_id, 0) + 1
            admitted += 1
        return iter(order)

    def __len__(self) -> int:
        return len(self.waiting)

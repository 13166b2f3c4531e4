# correct: round robin over sessions (the session admitted least goes next), priority tiers first: a goal of its own, not FCFS's
class MyPolicy(Policy):
    name = "mine"

    def __init__(self):
        self.waiting: list[Request] = []
        self.turns: dict[str, int] = {}  # admissions per session so far

    def key(self, req: Request):
        # each session in turn: the one admitted least goes first, then the earlier arrival
        return (-req.priority, self.turns.get(req.session_id, 0), req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        self.waiting.append(req)

    def peek_next(self) -> Request | None:
        return min(self.waiting, key=self.key) if self.waiting else None

    def pick_next(self) -> Request:
        req = self.peek_next()
        self.remove(req)
        self.turns[req.session_id] = self.turns.get(req.session_id, 0) + 1
        return req

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]

    def __iter__(self):
        # the order the picks would take: each pick gives its session one more turn
        turns, left, order = dict(self.turns), list(self.waiting), []
        while left:
            head = min(left, key=lambda r: (-r.priority, turns.get(r.session_id, 0), r.arrival_seq))
            order.append(head)
            left.remove(head)
            turns[head.session_id] = turns.get(head.session_id, 0) + 1
        return iter(order)

    def __len__(self) -> int:
        return len(self.waiting)

# mistake: priority used as a flag (priority > 0): 2 and 1 tie, -1 ranks with 0
# expect: where to look: MyPolicy.key
# expect: for any two priorities
class MyPolicy(Policy):
    name = "mine"

    def __init__(self):
        self.waiting: list[Request] = []
        self.admitted = 0  # admissions so far: the aging clock

    def key(self, req: Request):
        age = self.admitted - req._arrived_at
        urgent = req.priority > 0
        return (not urgent, req.prompt_len + req.max_tokens - 4 * age, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        req._arrived_at = self.admitted
        self.waiting.append(req)

    def peek_next(self) -> Request | None:
        return min(self.waiting, key=self.key) if self.waiting else None

    def pick_next(self) -> Request:
        req = self.peek_next()
        self.remove(req)
        self.admitted += 1
        return req

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]

    def __iter__(self):
        return iter(sorted(self.waiting, key=self.key))

    def __len__(self) -> int:
        return len(self.waiting)

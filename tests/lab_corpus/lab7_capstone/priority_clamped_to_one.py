# mistake: priority clamped to 0 or 1 (min(max(priority, 0), 1)) "because the workloads only use 0 and 1"
# expect: where to look: MyPolicy.key
# expect: for any two priorities
class MyPolicy(Policy):
    name = "mine"

    def __init__(self):
        self.waiting: list[Request] = []
        self.admitted = 0  # admissions so far: the aging clock

    def key(self, req: Request):
        age = self.admitted - req._arrived_at
        tier = min(max(req.priority, 0), 1)
        return (-tier, req.prompt_len + req.max_tokens - 4 * age, req.arrival_seq)

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

# mistake: peek_next caches the head, cleared on an arrival and a pick but not on remove: after the head is cancelled, peek still returns it
# expect: where to look: MyPolicy.peek_next
# expect: every arrival, pick and remove counts at the next peek
class MyPolicy(Policy):
    name = "mine"

    def __init__(self):
        self.waiting: list[Request] = []
        self.admitted = 0  # admissions so far: the aging clock
        self.head = None

    def key(self, req: Request):
        age = self.admitted - req._arrived_at
        return (-req.priority, req.prompt_len + req.max_tokens - 4 * age, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        req._arrived_at = self.admitted
        self.waiting.append(req)
        self.head = None

    def peek_next(self) -> Request | None:
        if self.head is None and self.waiting:
            self.head = min(self.waiting, key=self.key)
        return self.head

    def pick_next(self) -> Request:
        req = self.peek_next()
        self.remove(req)
        self.admitted += 1
        self.head = None
        return req

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]

    def __iter__(self):
        return iter(sorted(self.waiting, key=self.key))

    def __len__(self) -> int:
        return len(self.waiting)

# mistake: peek_next keeps the head's index into the waiting list; remove shifts the list, so the next peek returns another request than the head (or one that no longer waits)
# expect: where to look: MyPolicy.peek_next
class MyPolicy(Policy):
    name = "mine"

    def __init__(self):
        self.waiting: list[Request] = []
        self.admitted = 0  # admissions so far: the aging clock
        self.at = None  # index of the head in self.waiting

    def key(self, req: Request):
        age = self.admitted - req._arrived_at
        return (-req.priority, req.prompt_len + req.max_tokens - 4 * age, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        req._arrived_at = self.admitted
        self.waiting.append(req)
        self.at = None

    def peek_next(self) -> Request | None:
        if not self.waiting:
            return None
        if self.at is None or self.at >= len(self.waiting):
            self.at = min(range(len(self.waiting)), key=lambda i: self.key(self.waiting[i]))
        return self.waiting[self.at]

    def pick_next(self) -> Request:
        req = self.peek_next()
        del self.waiting[self.at]
        self.at = None
        self.admitted += 1
        return req

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]

    def __iter__(self):
        return iter(sorted(self.waiting, key=self.key))

    def __len__(self) -> int:
        return len(self.waiting)

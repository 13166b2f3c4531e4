# mistake: __iter__ yields the head first, then the rest in arrival order: right for its head only, while the queue figures read the whole order
# expect: where to look: MyPolicy.__iter__
# expect: in the order pick_next() would take them
class MyPolicy(Policy):
    name = "mine"

    def __init__(self):
        self.waiting: list[Request] = []
        self.admitted = 0  # admissions so far: the aging clock

    def key(self, req: Request):
        age = self.admitted - req._arrived_at
        return (-req.priority, req.prompt_len + req.max_tokens - 4 * age, req.arrival_seq)

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
        head = self.peek_next()
        if head is None:
            return iter([])
        return iter([head] + [r for r in self.waiting if r is not head])

    def __len__(self) -> int:
        return len(self.waiting)

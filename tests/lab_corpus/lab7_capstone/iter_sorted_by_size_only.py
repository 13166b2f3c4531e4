# mistake: __iter__ sorts by size alone (shortest first): its head is right while the tiers hold one priority, but it forgets the tiers and the aging the picks use
# expect: where to look: MyPolicy.__iter__
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
        return iter(sorted(self.waiting, key=lambda r: (r.prompt_len + r.max_tokens, r.arrival_seq)))

    def __len__(self) -> int:
        return len(self.waiting)

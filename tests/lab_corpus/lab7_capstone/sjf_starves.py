# mistake: shortest job first without aging: a long request starves while short ones keep arriving
# expect: where to look: MyPolicy.key
# expect: bounded wait
class MyPolicy(Policy):
    name = "mine"

    def __init__(self):
        self.waiting: list[Request] = []
        self.admitted = 0  # admissions so far: the aging clock

    def key(self, req: Request):
        return (-req.priority, req.prompt_len + req.max_tokens, req.arrival_seq)

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

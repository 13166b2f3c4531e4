# mistake: peek_next indexes the list without checking it, so a peek on an empty queue raises instead of returning None
# expect: p.peek_next()
# expect: peek_next() on the empty queue
# expect: None when nothing waits
class FCFSLab(Policy):
    """P1: first come, first served within priority tiers."""

    name = "fcfs-lab"

    def __init__(self):
        self.waiting: list[Request] = []  # keep it sorted by key

    @staticmethod
    def key(req: Request) -> tuple[int, int]:
        return (-req.priority, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        self.waiting.append(req)
        self.waiting.sort(key=self.key)

    def peek_next(self) -> Request | None:
        return self.waiting[0]

    def pick_next(self) -> Request:
        return self.waiting.pop(0)

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]

    def __iter__(self):
        return iter(list(self.waiting))

    def __len__(self) -> int:
        return len(self.waiting)

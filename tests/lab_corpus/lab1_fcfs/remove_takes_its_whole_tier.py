# mistake: remove drops every request of the removed one's priority, not just that one
# expect: remove took out
# expect: it must take out exactly the request it is given
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
        return self.waiting[0] if self.waiting else None

    def pick_next(self) -> Request:
        return self.waiting.pop(0)

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r.priority != req.priority]

    def __iter__(self):
        return iter(list(self.waiting))

    def __len__(self) -> int:
        return len(self.waiting)

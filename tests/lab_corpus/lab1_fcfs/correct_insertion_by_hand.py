# correct: insertion by a scan from the back (no sort, no bisect), priority tiers as the outer order
class FCFSLab(Policy):
    """P1: first come, first served within priority tiers."""

    name = "fcfs-lab"

    def __init__(self):
        self.waiting: list[Request] = []  # keep it sorted by key

    @staticmethod
    def key(req: Request) -> tuple[int, int]:
        return (-req.priority, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        i = len(self.waiting)
        while i > 0 and self.key(self.waiting[i - 1]) > self.key(req):
            i -= 1
        self.waiting.insert(i, req)

    def peek_next(self) -> Request | None:
        if not self.waiting:
            return None
        return self.waiting[0]

    def pick_next(self) -> Request:
        head = self.waiting[0]
        del self.waiting[0]
        return head

    def remove(self, req: Request) -> None:
        for i, r in enumerate(self.waiting):
            if r is req:
                del self.waiting[i]
                return

    def __iter__(self):
        return iter(list(self.waiting))

    def __len__(self) -> int:
        return len(self.waiting)

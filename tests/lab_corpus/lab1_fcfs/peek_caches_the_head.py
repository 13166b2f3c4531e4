# mistake: peek_next remembers the head it found and returns it until a pick, so a higher-priority arrival after a held head is not seen
# expect: where to look: FCFSLab.peek_next
# expect: every arrival counts at the next peek
class FCFSLab(Policy):
    """P1: first come, first served within priority tiers."""

    name = "fcfs-lab"

    def __init__(self):
        self.waiting: list[Request] = []  # keep it sorted by key
        self.head = None  # the head the last peek found

    @staticmethod
    def key(req: Request) -> tuple[int, int]:
        return (-req.priority, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        self.waiting.append(req)
        self.waiting.sort(key=self.key)

    def peek_next(self) -> Request | None:
        if self.head is None and self.waiting:
            self.head = self.waiting[0]
        return self.head

    def pick_next(self) -> Request:
        self.head = None
        return self.waiting.pop(0)

    def remove(self, req: Request) -> None:
        if req is self.head:
            self.head = None
        self.waiting = [r for r in self.waiting if r is not req]

    def __iter__(self):
        return iter(list(self.waiting))

    def __len__(self) -> int:
        return len(self.waiting)

# mistake: a soft-held head is kept in a field "so it keeps its place", so whatever arrives after it waits even with a higher priority
# expect: where to look: FCFSLab.peek_next
# expect: every arrival counts at the next peek
import bisect


class FCFSLab(Policy):
    """P1: first come, first served within priority tiers."""

    name = "fcfs-lab"

    def __init__(self):
        self.waiting: list[Request] = []  # keep it sorted by key
        self.held: Request | None = None  # G4: a held head keeps its place

    @staticmethod
    def key(req: Request) -> tuple[int, int]:
        return (-req.priority, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        keys = [self.key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, self.key(req)), req)

    def peek_next(self) -> Request | None:
        if self.held is not None and any(r is self.held for r in self.waiting):
            return self.held
        self.held = self.waiting[0] if self.waiting else None
        return self.held

    def pick_next(self) -> Request:
        req = self.peek_next()
        self.waiting = [r for r in self.waiting if r is not req]
        self.held = None
        return req

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]

    def __iter__(self):
        return iter(list(self.waiting))

    def __len__(self) -> int:
        return len(self.waiting)

# mistake: pick_next returns the head without removing it (made otter run loop forever)
# expect: pick must remove the head
class FCFSLab(Policy):
    name = "fcfs-lab"

    def __init__(self):
        self.waiting: list[Request] = []

    @staticmethod
    def key(req: Request) -> tuple[int, int]:
        return (-req.priority, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        self.waiting.append(req)
        self.waiting.sort(key=self.key)

    def peek_next(self) -> Request | None:
        return self.waiting[0] if self.waiting else None

    def pick_next(self) -> Request:
        return self.waiting[0]

    def remove(self, req: Request) -> None:
        self.waiting = [r for r in self.waiting if r is not req]

    def __iter__(self):
        return iter(list(self.waiting))

    def __len__(self) -> int:
        return len(self.waiting)

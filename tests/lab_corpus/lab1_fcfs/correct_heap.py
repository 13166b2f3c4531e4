# correct: a heap of (key, request) instead of a sorted list; the key as a negated pair
import heapq


class FCFSLab(Policy):
    """P1: first come, first served within priority tiers."""

    name = "fcfs-lab"

    def __init__(self):
        self.heap: list = []

    @staticmethod
    def key(req: Request) -> tuple[int, int]:
        return (-req.priority, req.arrival_seq)

    def on_request_arrived(self, req: Request) -> None:
        heapq.heappush(self.heap, (self.key(req), req.request_id, req))

    def peek_next(self) -> Request | None:
        return self.heap[0][2] if self.heap else None

    def pick_next(self) -> Request:
        return heapq.heappop(self.heap)[2]

    def remove(self, req: Request) -> None:
        self.heap = [e for e in self.heap if e[2] is not req]
        heapq.heapify(self.heap)

    def __iter__(self):
        return iter([e[2] for e in sorted(self.heap, key=lambda e: e[0])])

    def __len__(self) -> int:
        return len(self.heap)

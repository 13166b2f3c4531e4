# mistake: FCFSLab delegates every hook to a FCFSPolicy it holds
# expect: the graded cell was not run
# expect: `from minserve.policies import FCFSPolicy`: the engine's own code is not allowed
from minserve.policies import FCFSPolicy


class FCFSLab(Policy):
    name = "fcfs-lab"

    def __init__(self):
        self.inner = FCFSPolicy()

    @staticmethod
    def key(req: Request) -> tuple[int, int]:
        return FCFSPolicy.key(req)

    def on_request_arrived(self, req: Request) -> None:
        self.inner.on_request_arrived(req)

    def peek_next(self) -> Request | None:
        return self.inner.peek_next()

    def pick_next(self) -> Request:
        return self.inner.pick_next()

    def remove(self, req: Request) -> None:
        self.inner.remove(req)

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

# attempt: MyPolicy.__new__ returns minserve's own FairPolicy, so every hook is the engine's
# expect: the graded cell was not run
# expect: defining `__new__` is not allowed
class MyPolicy(Policy):
    name = "mine"

    def __new__(cls):
        from minserve.fair import FairPolicy
        return FairPolicy()

    def key(self, req: Request):
        return 0

    def on_request_arrived(self, req: Request) -> None:
        pass

    def peek_next(self) -> Request | None:
        return None

    def pick_next(self) -> Request:
        return None

    def remove(self, req: Request) -> None:
        pass

    def __iter__(self):
        return iter([])

    def __len__(self) -> int:
        return 0

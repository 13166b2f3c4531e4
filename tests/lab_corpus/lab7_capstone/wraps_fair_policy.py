# mistake: MyPolicy hands everything to minserve's own FairPolicy
# expect: the graded cell was not run
# expect: `from minserve.fair import FairPolicy`: the engine's own code is not allowed
from minserve.fair import FairPolicy


class MyPolicy(Policy):
    name = "mine"

    def __init__(self):
        self.inner = FairPolicy()

    def key(self, req: Request):
        return self.inner.key(req)

    def on_request_arrived(self, req: Request) -> None:
        self.inner.on_request_arrived(req)

    def on_tokens_processed(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        self.inner.on_tokens_processed(req, prompt_tokens, output_tokens)

    def on_request_finished(self, req: Request) -> None:
        self.inner.on_request_finished(req)

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

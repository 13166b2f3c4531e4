# attempt: the hooks are functools.partialmethod wrappers around minserve's own FCFSPolicy
# expect: the graded cell was not run
# expect: `from minserve.policies import FCFSPolicy`: the engine's own code is not allowed
from functools import partialmethod

from minserve.policies import FCFSPolicy


class FCFSLab(Policy):
    name = "fcfs-lab"

    def __init__(self):
        FCFSPolicy.__init__(self)

    key = staticmethod(FCFSPolicy.key)
    on_request_arrived = partialmethod(FCFSPolicy.on_request_arrived)
    peek_next = partialmethod(FCFSPolicy.peek_next)
    pick_next = partialmethod(FCFSPolicy.pick_next)
    remove = partialmethod(FCFSPolicy.remove)
    __iter__ = partialmethod(FCFSPolicy.__iter__)
    __len__ = partialmethod(FCFSPolicy.__len__)

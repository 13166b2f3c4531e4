# correct: minserve's own FCFSPolicy copied out of the installed wheel with its names changed: it behaves, so it passes; the similarity report flags it for a person
# flagged: a renamed copy of FCFSPolicy
import bisect


class FCFSLab(Policy):
    name = "fcfs-lab"

    def __init__(self):
        self.ks = []
        self.rs = []

    @staticmethod
    def key(r):
        return (-r.priority, r.arrival_seq)

    def on_request_arrived(self, r):
        k = self.key(r)
        j = bisect.bisect(self.ks, k)
        self.ks.insert(j, k)
        self.rs.insert(j, r)

    def peek_next(self):
        return self.rs[0] if self.rs else None

    def pick_next(self):
        self.ks.pop(0)
        return self.rs.pop(0)

    def remove(self, r):
        j = self.rs.index(r)
        del self.ks[j], self.rs[j]

    def __iter__(self):
        return iter(list(self.rs))

    def __len__(self):
        return len(self.rs)

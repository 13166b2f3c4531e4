# mistake: FCFSLab subclasses minserve's own FCFSPolicy: nothing of it is the student's
# expect: the graded cell was not run
# expect: `from minserve.policies import FCFSPolicy`: the engine's own code is not allowed
from minserve.policies import FCFSPolicy


class FCFSLab(FCFSPolicy):
    name = "fcfs-lab"

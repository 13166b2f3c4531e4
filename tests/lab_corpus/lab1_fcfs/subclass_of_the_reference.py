# mistake: FCFSLab subclasses minserve's own FCFSPolicy: nothing of it is the student's
# expect: subclasses minserve's own FCFSPolicy
from minserve.policies import FCFSPolicy


class FCFSLab(FCFSPolicy):
    name = "fcfs-lab"

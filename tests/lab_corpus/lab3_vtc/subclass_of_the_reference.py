# mistake: VTCLab subclasses minserve's own FairPolicy
# expect: the graded cell was not run
# expect: `from minserve.fair import FairPolicy`: the engine's own code is not allowed
from minserve.fair import FairPolicy


class VTCLab(FairPolicy):
    name = "vtc-lab"

# mistake: VTCLab subclasses minserve's own FairPolicy
# expect: subclasses minserve's own FairPolicy
from minserve.fair import FairPolicy


class VTCLab(FairPolicy):
    name = "vtc-lab"

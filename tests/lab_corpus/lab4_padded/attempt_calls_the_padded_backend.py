# attempt: splice_in and remove call minserve's own PaddedBackend.promote / remove_row on a stand-in object and read its mask back
# expect: the graded cell was not run
# expect: `from minserve.backends.padded import PaddedBackend`: the engine's own code is not allowed
from minserve.backends.padded import PaddedBackend


class _StandIn:
    def __init__(self, mask):
        self.mask, self.row_ids, self.staging, self.trim_on_remove = mask, [], {}, False


def splice_in(mask: torch.Tensor, n: int, kv_length: int):
    """mask (B, L) + a new row of n real tokens -> (mask (B+1, max(L, n)), grow, row_pad)."""
    b = _StandIn(mask)
    PaddedBackend.promote(b, n)
    return b.mask, b.mask.shape[1] - mask.shape[1], b.mask.shape[1] - n


def remove(mask: torch.Tensor, i: int, trim: bool):
    """Drop row i -> (mask (B-1, L'), kept row indices, first column kept)."""
    b = _StandIn(mask)
    PaddedBackend.remove_row(b, i)
    return b.mask, [j for j in range(mask.shape[0]) if j != i], mask.shape[1] - b.mask.shape[1]


def next_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, 1): the position id of each row's next token."""
    return mask.sum(dim=1, keepdim=True)

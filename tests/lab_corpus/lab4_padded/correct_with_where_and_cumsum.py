# correct: the new row built with torch.where over the column indices, trim found with cumsum, positions as a count of ones
def splice_in(mask: torch.Tensor, n: int, kv_length: int):
    """mask (B, L) + a new row of n real tokens -> (mask (B+1, max(L, n)), grow, row_pad)."""
    width = max(mask.shape[1], n)
    grow, row_pad = width - mask.shape[1], width - n
    cols = torch.arange(width)
    row = torch.where(cols >= row_pad, 1, 0).to(mask.dtype).unsqueeze(0)
    return torch.cat([F.pad(mask, (grow, 0)), row]), grow, row_pad


def remove(mask: torch.Tensor, i: int, trim: bool):
    """Drop row i -> (mask (B-1, L'), kept row indices, first column kept)."""
    keep = [j for j in range(mask.shape[0]) if j != i]
    kept = mask[torch.tensor(keep)]
    first = int((kept.sum(dim=0).cumsum(dim=0) == 0).sum()) if trim else 0
    return kept[:, first:], keep, first


def next_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, 1): the position id of each row's next token."""
    return (mask != 0).sum(dim=1).unsqueeze(1)

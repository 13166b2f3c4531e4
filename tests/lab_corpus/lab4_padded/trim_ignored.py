# mistake: remove never trims the leading all-padding columns
# expect: trim drops the leading columns
def splice_in(mask: torch.Tensor, n: int, kv_length: int):
    """mask (B, L) + a new row of n real tokens -> (mask (B+1, max(L, n)), grow, row_pad)."""
    width = mask.shape[1]  # R3: the mask's own width, never kv_length
    grow, row_pad = max(0, n - width), max(0, width - n)
    new_row = F.pad(torch.ones(1, n, dtype=mask.dtype, device=mask.device), (row_pad, 0))
    return torch.cat([F.pad(mask, (grow, 0)), new_row]), grow, row_pad


def remove(mask: torch.Tensor, i: int, trim: bool):
    """Drop row i -> (mask (B-1, L'), kept row indices, first column kept)."""
    keep = [j for j in range(mask.shape[0]) if j != i]
    mask = mask[keep]
    first = 0
    if False:
        real = mask.sum(dim=0).nonzero()
        first = int(real[0]) if len(real) else mask.shape[1]
    return mask[:, first:], keep, first


def next_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, 1): the position id of each row's next token."""
    return mask.sum(dim=1, keepdim=True)

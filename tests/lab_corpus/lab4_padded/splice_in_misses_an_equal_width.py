# mistake: splice_in handles a row longer than the batch and one shorter, but not one exactly as wide: its padding is never set and the call crashes
# expect: where to look: splice_in
# expect: n=
def splice_in(mask: torch.Tensor, n: int, kv_length: int):
    """mask (B, L) + a new row of n real tokens -> (mask (B+1, max(L, n)), grow, row_pad)."""
    width = mask.shape[1]
    if n > width:
        grow, row_pad = n - width, 0
    elif n < width:
        grow, row_pad = 0, width - n
    new_row = F.pad(torch.ones(1, n, dtype=mask.dtype), (row_pad, 0))
    return torch.cat([F.pad(mask, (grow, 0)), new_row]), grow, row_pad


def remove(mask: torch.Tensor, i: int, trim: bool):
    """Drop row i -> (mask (B-1, L'), kept row indices, first column kept)."""
    keep = [j for j in range(mask.shape[0]) if j != i]
    mask = mask[keep]
    first = 0
    if trim:
        real = mask.sum(dim=0).nonzero()
        first = int(real[0]) if len(real) else mask.shape[1]
    return mask[:, first:], keep, first


def next_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, 1): the position id of each row's next token."""
    return mask.sum(dim=1, keepdim=True)

# mistake: splice_in builds the new row's padding with zeros(1, width - n) only when the row is shorter, and otherwise concatenates the wider row with the batch: a row exactly as wide gets an empty piece of the wrong shape
# expect: where to look: splice_in
# expect: n=
def splice_in(mask: torch.Tensor, n: int, kv_length: int):
    """mask (B, L) + a new row of n real tokens -> (mask (B+1, max(L, n)), grow, row_pad)."""
    width = mask.shape[1]
    row = torch.ones(1, n, dtype=mask.dtype)
    if n < width:
        row = torch.cat([torch.zeros(1, width - n, dtype=mask.dtype), row], dim=1)
        return torch.cat([mask, row]), 0, width - n
    if n > width:
        grown = torch.cat([torch.zeros(mask.shape[0], n - width, dtype=mask.dtype), mask], dim=1)
        return torch.cat([grown, row]), n - width, 0
    return torch.cat([mask, row[:, 1:]]), 0, 0


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

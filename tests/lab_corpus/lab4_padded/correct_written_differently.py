# correct: splice-in by writing into a zero mask, removal with a boolean row mask, positions by cumsum
def splice_in(mask: torch.Tensor, n: int, kv_length: int):
    """mask (B, L) + a new row of n real tokens -> (mask (B+1, max(L, n)), grow, row_pad)."""
    rows, width = mask.shape
    new_width = max(width, n)
    out = torch.zeros(rows + 1, new_width, dtype=mask.dtype, device=mask.device)
    out[:rows, new_width - width:] = mask
    out[rows, new_width - n:] = 1
    return out, new_width - width, new_width - n


def remove(mask: torch.Tensor, i: int, trim: bool):
    """Drop row i -> (mask (B-1, L'), kept row indices, first column kept)."""
    keep_rows = torch.ones(mask.shape[0], dtype=torch.bool)
    keep_rows[i] = False
    kept = [j for j in range(mask.shape[0]) if keep_rows[j]]
    mask = mask[keep_rows]
    first = 0
    if trim:
        used = (mask != 0).any(dim=0).tolist()
        first = used.index(True) if True in used else mask.shape[1]
    return mask[:, first:], kept, first


def next_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, 1): the position id of each row's next token."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], 1, dtype=mask.dtype, device=mask.device)
    return mask.cumsum(dim=1)[:, -1:]

"""The padded backend: one Hugging Face `DynamicCache` for the whole decode batch.

This is continuous batching the way you would first build it with plain
`transformers` (Orca, Yu et al., OSDI 2022, iteration-level scheduling): every
active request is a row of one batched KV cache. Rows have different lengths,
so they are *left*-padded to a common width L, and an attention mask says
which columns are real:

    per layer: keys, values (B, H_kv, L, D)        mask (B, L)       next position
    row 0 "a"  [ . . . k k k k k ]                 0 0 0 1 1 1 1 1   5
    row 1 "b"  [ k k k k k k k k ]                 1 1 1 1 1 1 1 1   8
    row 2 "c"  [ . . . . . . k k ]                 0 0 0 0 0 0 1 1   2
                 └ padding: computed over, masked out, wasted

Left padding keeps every row's newest token in the last column, so one decode
step appends one column for everyone. Position ids come from the mask (a row's
next position is its count of real tokens), never from the column index.

Splice-in (SPEC C3): a freshly prefilled row (its own batch-1 cache of n
tokens) joins by left-padding whichever side is shorter, then concatenating
along the batch dimension. Removal selects the remaining rows and (with
`trim_on_remove`, the default) trims leading columns that became padding in
every row.

R3: the mask's own width is the truth for its shape. We assert it equals the
cache's width after every change; we never size the mask from a backend
metric. `kv_length` is such a metric: the longest row's real KV, the same
meaning as in the paged backend. The two differ whenever leading columns are
padding in every row, e.g. with `trim_on_remove=False` after the longest row
left:

    before: a 8 tokens, b 3, c 5          after a leaves (no trim)
    a [ k k k k k k k k ]                 b [ . . . . . k k k ]   mask width 8
    b [ . . . . . k k k ]                 c [ . . . k k k k k ]   kv_length  5
    c [ . . . k k k k k ]

A new row spliced in with a width taken from kv_length (5) would be
concatenated against an 8-column batch: `torch.cat` fails and, on the
worker thread, kills every stream. That is the mixed-workload crash R3
records; `tests/test_padded_backend.py` rebuilds it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from ..request import Request
from .base import Backend, model_forward_kwargs


class PaddedBackend(Backend):
    name = "padded"
    supports_batched_prefill = True

    def __init__(self, model: torch.nn.Module, storage=None, trim_on_remove: bool = True,
                 decode_layer: type | None = None) -> None:
        from transformers import DynamicCache

        self._DynamicCache = DynamicCache
        self.model = model
        self.device = next(model.parameters()).device
        self.cache_arg = model_forward_kwargs(model)  # "cache" (transformers 5.x) or "past_key_values"
        self.storage = storage  # KVBlockStorage for prefix-cache reuse (None: no reuse)
        self.block_manager = None  # set by the scheduler when prefix caching is on
        self.staging: dict[str, Any] = {}  # request_id -> batch-1 DynamicCache being prefilled
        self.row_ids: list[str] = []  # decode batch order: row i is request row_ids[i]
        self.cache = None  # batched DynamicCache, (B, H_kv, L, D) per layer
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # (B, L)
        # Drop the leading columns that are padding in every row when a row leaves. Off,
        # the batch keeps its width until it empties: more padding computed over (watch
        # it in notebook 02), and mask width > kv_length, the situation R3 is about.
        self.trim_on_remove = trim_on_remove
        # What the decode batch's cache layers are: None, HF's own (each step's
        # `DynamicLayer.update` concatenates one column onto the whole batch's KV), or a
        # subclass with `from_layer(layer)` that computes the same faster: the engine
        # gives `fast.in_place_cache.InPlaceLayer`, which writes the column in place.
        self.decode_layer = decode_layer
        self.attention_backends = attention_backends(self.device)  # SDPA's kernels (GPU)

    # --- prefill side --------------------------------------------------------------------
    def begin_prefill(self, req: Request) -> None:
        cache = self._DynamicCache(config=self.model.config)
        if req.num_cached_tokens:
            # Prefix-cache hit (K2): copy the cached blocks' KV into this row's cache,
            # so prefill starts at token num_cached_tokens instead of 0.
            table = self.block_manager.block_table(req.request_id)
            for layer, (k, v) in enumerate(self.storage.load_tokens(table, req.num_cached_tokens)):
                cache.update(k, v, layer)  # k, v: (1, H_kv, n_cached, D)
        self.staging[req.request_id] = cache

    @torch.inference_mode()
    def prefill_chunk(self, req: Request, start: int, end: int) -> torch.Tensor:
        cache = self.staging[req.request_id]
        assert cache.get_seq_length() == start, (cache.get_seq_length(), start)
        ids = torch.tensor([req.prefill_token_ids[start:end]], device=self.device)  # (1, T)
        pos = torch.arange(start, end, device=self.device).unsqueeze(0)  # (1, T)
        with self.attention_backends():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1,
                             **{self.cache_arg: cache})
        if end == req.prefill_len and self.storage is not None and self.block_manager is not None:
            self._store_prompt_blocks(req, cache)
        return out.logits[0, -1].float()  # (V,)

    @torch.inference_mode()
    def prefill_together(self, pieces: list[tuple[Request, int, int]]) -> list:
        """Several staging rows' pieces in ONE forward, left-padded side by side, the way
        the decode batch is. Row i has s_i tokens of KV already and pushes t_i new ones:

            columns      past (W = max s_i)    new (T = max t_i)
            row "a"      [ . . k k k ]         [ . . . n n ]     s=3, t=2
            row "b"      [ k k k k k ]         [ n n n n n ]     s=5, t=5
            row "c"      [ . . . . . ]         [ . n n n n ]     s=0, t=4
            mask         0 where ".", 1 where k or n; positions s_i .. s_i + t_i - 1

        Every row's last token sits in the last column, so one `logits_to_keep=1` gives
        each row's next-token logits. Afterwards each row's staging cache is its own
        real columns again (batch 1, s_i + t_i tokens), as if it had run alone.
        Returns per piece its (V,) logits if it was the prompt's final piece, else None.
        """
        B = len(pieces)
        starts = [start for _, start, _ in pieces]
        lens = [end - start for _, start, end in pieces]
        W, T = max(starts), max(lens)
        ids = torch.zeros(B, T, dtype=torch.long, device=self.device)  # pad id: any, masked
        pos = torch.zeros(B, T, dtype=torch.long, device=self.device)
        mask = torch.zeros(B, W + T, dtype=torch.long, device=self.device)
        for i, (req, start, end) in enumerate(pieces):
            assert self.staging[req.request_id].get_seq_length() == start
            ids[i, T - lens[i]:] = torch.tensor(req.prefill_token_ids[start:end])
            pos[i, T - lens[i]:] = torch.arange(start, end)
            mask[i, W - start:W] = 1
            mask[i, W + T - lens[i]:] = 1
        batch = self._DynamicCache(config=self.model.config)
        if W:  # the rows' past KV, left-padded to W columns: (B, H_kv, W, D) per layer
            rows = [self.staging[req.request_id].layers for req, _, _ in pieces]
            for layer in range(len(rows[0])):
                k = torch.cat([F.pad(r[layer].keys, (0, 0, W - s, 0)) if s else
                               self._empty_past(rows, layer, W) for r, s in zip(rows, starts)])
                v = torch.cat([F.pad(r[layer].values, (0, 0, W - s, 0)) if s else
                               self._empty_past(rows, layer, W) for r, s in zip(rows, starts)])
                batch.update(k, v, layer)
        with self.attention_backends():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                             logits_to_keep=1, **{self.cache_arg: batch})
        logits = out.logits[:, -1].float()  # (B, V)
        results = []
        for i, (req, _, end) in enumerate(pieces):
            real = mask[i].nonzero().squeeze(1)  # this row's s_i + t_i real columns
            row = self._DynamicCache(config=self.model.config)
            for layer, big in enumerate(batch.layers):
                row.update(big.keys[i:i + 1, :, real], big.values[i:i + 1, :, real], layer)
            self.staging[req.request_id] = row
            final = end == req.prefill_len
            if final and self.storage is not None and self.block_manager is not None:
                self._store_prompt_blocks(req, row)
            results.append(logits[i] if final else None)
        return results

    @staticmethod
    def _empty_past(rows, layer: int, width: int) -> torch.Tensor:
        """W columns of padding for a row with no past yet (its cache layer is empty)."""
        ref = next(r[layer].keys for r in rows if r[layer].keys is not None
                   and r[layer].keys.numel())
        return ref.new_zeros(1, ref.shape[1], width, ref.shape[3])

    def _store_prompt_blocks(self, req: Request, cache) -> None:
        """Copy the newly computed prompt KV into the shared block storage (K1), so a
        later request with the same prefix can load it instead of recomputing."""
        table = self.block_manager.block_table(req.request_id)
        start = req.num_cached_tokens  # blocks before this were loaded from storage already
        per_layer = [(layer.keys[0, :, start:].transpose(0, 1),  # (T, H_kv, D)
                      layer.values[0, :, start:].transpose(0, 1)) for layer in cache.layers]
        self.storage.store_tokens(table, start, per_layer)

    def promote(self, req: Request) -> None:
        """Splice the staged row into the batch (the C3 seam's backend half)."""
        row = self.staging.pop(req.request_id)
        n = row.get_seq_length()
        if self.cache is None or not self.row_ids:
            self.cache, self.row_ids = row, [req.request_id]
            if self.decode_layer is not None:  # e.g. grows in place, no torch.cat per step
                row.layers = [self.decode_layer.from_layer(layer) for layer in row.layers]
            self.mask = torch.ones(1, n, dtype=torch.long, device=self.device)
            return
        width = self.mask.shape[1]  # R3: the mask's own width, not kv_length
        grow = max(0, n - width)  # columns to add on the left of the existing batch
        row_pad = max(0, width - n)  # columns to add on the left of the new row
        # Build every new tensor first, assign after: a failure half-way changes nothing.
        grown = [(torch.cat([F.pad(big.keys, (0, 0, grow, 0)), F.pad(small.keys, (0, 0, row_pad, 0))]),
                  torch.cat([F.pad(big.values, (0, 0, grow, 0)),
                             F.pad(small.values, (0, 0, row_pad, 0))]))
                 for big, small in zip(self.cache.layers, row.layers)]
        new_mask_row = F.pad(torch.ones(1, n, dtype=torch.long, device=self.device), (row_pad, 0))
        mask = torch.cat([F.pad(self.mask, (grow, 0)), new_mask_row])  # (B+1, max(L, n))
        for big, (k, v) in zip(self.cache.layers, grown):
            big.keys, big.values = k, v
        self.mask = mask
        self.row_ids.append(req.request_id)
        self.check_invariants()

    # --- decode side ---------------------------------------------------------------------
    @torch.inference_mode()
    def decode_step_batched(self, reqs: list[Request], token_ids: list[int]) -> torch.Tensor:
        """All rows of the batch, in any order: feed one token each, return (B, V) logits."""
        order = {rid: i for i, rid in enumerate(self.row_ids)}
        assert sorted(order[r.request_id] for r in reqs) == list(range(len(self.row_ids))), \
            "the padded backend decodes the whole batch at once"
        fed = [0] * len(reqs)
        for r, t in zip(reqs, token_ids):
            fed[order[r.request_id]] = t
        col = torch.tensor(fed, device=self.device).unsqueeze(1)  # (B, 1), one copy to the device
        pos = self.mask.sum(dim=1, keepdim=True)  # (B, 1): a row's count of real tokens
        # All or nothing: the forward widens the mask and, layer by layer, the cache. If it
        # raises half-way (layer 0 grew to L+1 columns, layer 1 did not), put back the mask
        # and every layer's (B, H_kv, L, D) view as they were, so R3 holds again and the
        # scheduler can remove the failed rows one by one (SPEC H5: once, the widened mask made
        # `remove_row`'s R3 check fail inside the error path and killed the worker).
        saved = (self.mask, [(layer.keys, layer.values) for layer in self.cache.layers])
        try:
            self.mask = torch.cat([self.mask, torch.ones_like(col)], dim=1)  # (B, L+1)
            with self.attention_backends():
                out = self.model(input_ids=col, attention_mask=self.mask, position_ids=pos,
                                 use_cache=True, **{self.cache_arg: self.cache})
            logits = out.logits[:, -1].float()  # (B, V) in batch order
            self.check_invariants()
        except BaseException:
            self._restore(saved)
            raise
        return logits[torch.tensor([order[r.request_id] for r in reqs], device=self.device)]

    def _restore(self, saved) -> None:
        """Put back the mask and the layers' keys/values saved before a forward. HF's layers
        made new tensors, and a layer that grows in place (`decode_layer`) only ever wrote
        *past* the saved views' last column, so the saved views still hold exactly the KV
        they held."""
        self.mask, layers = saved
        for layer, (k, v) in zip(self.cache.layers, layers):
            layer.keys, layer.values = k, v

    def remove_row(self, req: Request) -> None:
        if self.staging.pop(req.request_id, None) is not None or req.request_id not in self.row_ids:
            return
        i = self.row_ids.index(req.request_id)
        keep = [j for j in range(len(self.row_ids)) if j != i]
        self.row_ids.pop(i)
        if not keep:
            self.cache, self.mask = None, self.mask[:0, :0]
            return
        idx = torch.tensor(keep, device=self.device)
        self.mask = self.mask[idx]
        # Columns that are padding in every remaining row hold nothing: trim them
        # (e.g. the longest row just left). Width comes from the mask itself (R3).
        first = 0
        if self.trim_on_remove:
            real_cols = self.mask.sum(dim=0).nonzero()
            first = int(real_cols[0]) if len(real_cols) else self.mask.shape[1]
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]
        self.check_invariants()

    def reset(self) -> None:
        """Forget every row, staging and batch, without checking anything: the last resort
        of `Scheduler.fail_all` when the bookkeeping itself may be what broke."""
        self.staging.clear()
        self.row_ids, self.cache = [], None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)

    # --- metrics and checks ----------------------------------------------------------------
    @property
    def kv_length(self) -> int:
        """The longest row's real KV, in tokens: a metric (R3), <= the mask's width."""
        return int(self.mask.sum(dim=1).max()) if self.mask.numel() else 0

    @property
    def width(self) -> int:
        """Columns of the batched KV and of the mask (real + padding), (B, H_kv, L, D)."""
        return self.mask.shape[1]

    @property
    def num_rows(self) -> int:
        return len(self.row_ids)

    def row_lengths(self) -> dict[str, int]:
        return {rid: int(n) for rid, n in zip(self.row_ids, self.mask.sum(dim=1).tolist())}

    def snapshot(self) -> dict[str, Any]:
        """Plain lists for figures: the mask and the next position id of every row."""
        mask = self.mask.tolist()
        return {"name": self.name, "kv_length": self.kv_length, "width": self.width,
                "num_rows": self.num_rows,
                "row_ids": list(self.row_ids), "attention_mask": mask,
                # a real column's position = real columns up to it - 1; padding -> 0.
                # (cumsum in torch: the Python double loop was O(B * L^2) every tick)
                "position_ids": ((self.mask.cumsum(1) - 1).clamp(min=0) * self.mask).tolist(),
                "padding_tokens": int(self.mask.numel() - self.mask.sum()),
                "staging": {rid: c.get_seq_length() for rid, c in self.staging.items()}}

    def check_invariants(self) -> None:
        """R3: mask rows == batch rows, mask width == cache width, no all-zero row."""
        if self.cache is None or not self.row_ids:
            assert self.mask.numel() == 0
            return
        B, L = self.mask.shape
        assert B == len(self.row_ids), (B, self.row_ids)
        for layer in self.cache.layers:
            assert layer.keys.shape[0] == B and layer.keys.shape[2] == L, (layer.keys.shape, B, L)
        assert bool((self.mask.sum(dim=1) > 0).all()), "a row with no real tokens"
        # left padding: once a row is real, it stays real to the right
        assert bool((self.mask.diff(dim=1) >= 0).all()), "padding must be on the left"


def attention_backends(device: torch.device):
    """What SDPA may run on the padded batch: a context manager factory. On CUDA,
    PyTorch's memory-efficient kernel (it takes the batch's padding mask as it is) or the
    math fallback, not cuDNN's attention: cuDNN builds an execution plan for each new
    (shape, mask) it meets, and the padded batch changes shape every tick (its width grows
    by one column; rows join and leave), so every call paid for planning (2.75 ms of CPU
    per call measured on an H200, 16 layers: 44 ms a tick). FlashAttention takes no
    arbitrary mask. Elsewhere (CPU, MPS): PyTorch's own choice, unchanged."""
    if device.type != "cuda":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return lambda: sdpa_kernel(backends)

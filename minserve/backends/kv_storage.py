"""KVBlockStorage: the physical KV pool that block tables point into (SPEC B1, K1).

`minserve/kv_cache.py` (the BlockManager) decides *which* block ids a sequence
owns; this file holds the *tensors* those ids index. Both follow PagedAttention
(Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023): KV lives in fixed-size blocks of one preallocated
pool, so a sequence grows one block at a time, never needs a contiguous region,
and equal prefixes can share blocks.

Layout: per layer, one key tensor and one value tensor, allocated once. Readers
index it token-major:

    key_cache[layer]   (num_blocks, block_size, H_kv, D)       value_cache: same
                        ─────┬──── ─────┬────
                        block id    slot in block

    block_size = 16, block_table("r7") == [12, 3, 0]
    block 12: slots 0..15 = tokens  0..15 of r7
    block  3: slots 0..15 = tokens 16..31 of r7
    block  0: slots 0..4  = tokens 32..36 of r7  (slots 5..15 not written yet)

    token `pos` of a row  ->  flat slot  table[pos // 16] * 16 + pos % 16

In memory the KV head comes first: `key_cache[layer]` is a permuted *view* of a
(H_kv, num_blocks * block_size, D) tensor, `flat(layer)`. Why: attention runs per
KV head, so one `index_select` over the flat slots returns every row's history
already as (H_kv, B, L, D), contiguous, ready for a batched matmul per head with
no transposing copy. On a 2-core CPU that copy cost as much as the gather itself
(`minserve bench kv-cache`, docs/benchmarks.md). Writing a token is one
`flat[:, slot] = kv` and reading tokens one `flat[:, slots]` (spelled `index_copy_` /
`index_select`): plain indexing, which is what a reader should see first. Attention
reads whole blocks (`read_blocks`): a block of one head is S*D contiguous floats. A fused
CUDA kernel (vLLM's layout is (block, H, D/x, slot, x)) reads blocks in place
instead of gathering them; on CPU the gather is the clearest equivalent.

The storage is shared: the paged backend attends over it directly, and the
padded backend (which keeps its own DynamicCache) uses `store_tokens` /
`load_tokens` to park a prompt's KV here and reload it on a prefix-cache hit.
"""

from __future__ import annotations

from typing import Any

import torch

KV = tuple[torch.Tensor, torch.Tensor]  # (keys, values) of one layer


def model_kv_geometry(model: torch.nn.Module) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from a Hugging Face causal LM's config."""
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    num_heads = cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads  # no GQA -> H_kv == H
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return cfg.num_hidden_layers, num_kv_heads, head_dim


class KVBlockStorage:
    """Preallocated per-layer K and V pools of `num_blocks` blocks x `block_size` slots.

    `spare_blocks`: blocks past `num_blocks` that no block table names (the block manager
    hands out 0..num_blocks-1): where the padding rows of a captured decode step write
    their K/V (fast/cuda_graphs.py). 0 unless asked for."""

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", spare_blocks: int = 0) -> None:
        if min(num_blocks, block_size, num_layers, num_kv_heads, head_dim) < 1 or spare_blocks < 0:
            raise ValueError("KVBlockStorage: every size must be >= 1 (spare_blocks >= 0)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.spare_blocks = spare_blocks
        self._blocks = num_blocks + spare_blocks  # in memory
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_kv_heads, self._blocks * block_size, head_dim)  # (H_kv, N*S, D) in memory
        # Zeros, not empty: a slot nobody wrote is never read, but if a bug ever reads one
        # it shows up as a wrong number in a parity test, not as NaN garbage.
        self._k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        # The token-major views readers index: (N, S, H_kv, D); writing through them
        # writes the pool.
        self.key_cache = [self._token_major(t) for t in self._k]
        self.value_cache = [self._token_major(t) for t in self._v]
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # read_blocks(reuse=True)

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_blocks: int, block_size: int,
                  spare_blocks: int = 0) -> KVBlockStorage:
        """A pool shaped for `model`: its layer count, KV heads, head dim, dtype and device."""
        num_layers, num_kv_heads, head_dim = model_kv_geometry(model)
        p = next(model.parameters())
        return cls(num_blocks, block_size, num_layers, num_kv_heads, head_dim, p.dtype, p.device,
                   spare_blocks)

    def _token_major(self, t: torch.Tensor) -> torch.Tensor:
        """(H_kv, N*S, D) -> a (N, S, H_kv, D) view of the same memory."""
        return t.view(self.num_kv_heads, self._blocks, self.block_size,
                      self.head_dim).permute(1, 2, 0, 3)

    # --- sizes ---------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Bytes one token's KV takes across all layers: 2 (K and V) * L * H_kv * D * itemsize."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def nbytes(self) -> int:
        return self.bytes_per_token() * self.num_blocks * self.block_size

    # --- addressing ----------------------------------------------------------------------
    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Flat slots of tokens start..end-1 of the row owning `block_table`, as host ints.

        slot = block_table[pos // block_size] * block_size + pos % block_size

        Computed on the host: a forward's rows are gathered into ONE tensor sent to the
        device once (`PagedForward.build_rows`), not one small copy per row (SPEC D5).
        """
        if not 0 <= start <= end <= len(block_table) * self.block_size:
            raise ValueError(f"tokens {start}..{end} do not fit a table of {len(block_table)} "
                             f"blocks x {self.block_size} slots (was append_slots called?)")
        S = self.block_size
        return [block_table[pos // S] * S + pos % S for pos in range(start, end)]

    def slot_mapping(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """`slots` as a (end - start,) tensor on the pool's device."""
        return torch.tensor(self.slots(block_table, start, end), dtype=torch.long,
                            device=self.device)

    def flat(self, layer: int) -> KV:
        """One layer's pool as it lies in memory, a flat array of slots per KV head:
        K and V, each (H_kv, num_blocks * block_size, D)."""
        return self._k[layer], self._v[layer]

    # --- one layer -----------------------------------------------------------------------
    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter T tokens' K and V, each (T, H_kv, D), into the slots `slot_mapping` (T,)."""
        k_flat, v_flat = self.flat(layer)
        # token t of k -> slot slot_mapping[t], in every head's row of the pool
        k_flat.index_copy_(1, slot_mapping, k.to(self.dtype).transpose(0, 1))  # (H_kv, T, D)
        v_flat.index_copy_(1, slot_mapping, v.to(self.dtype).transpose(0, 1))

    def read(self, layer: int, slots: torch.Tensor) -> KV:
        """K and V of the tokens in `slots` (any shape S): each (H_kv, *S, D), contiguous
        copies. Slots (B, L) give (H_kv, B, L, D): every row's history, head-major.
        One token at a time (`index_select` of D-float rows): for a few tokens, or one
        row; attention over many rows reads whole blocks (`read_blocks`)."""
        k_flat, v_flat = self.flat(layer)
        idx = slots.reshape(-1)
        shape = (self.num_kv_heads, *slots.shape, self.head_dim)
        return (k_flat.index_select(1, idx).view(shape),  # (H_kv, *S, D)
                v_flat.index_select(1, idx).view(shape))

    def read_blocks(self, layer: int, blocks: torch.Tensor, reuse: bool = False) -> KV:
        """K and V of whole blocks: `blocks` (B, M) block ids -> each (H_kv, B, M*S, D),
        row b's tokens 0..M*S-1 in order (a row's table, padded to M blocks with any
        block id; the caller masks what lies past a row's end).

            pool, per KV head:   (num_blocks, S*D)   one block = S*D contiguous floats
            row b:               blocks[b] = [12, 3, 0]  ->  block 12 | block 3 | block 0

        Why blocks, not tokens: one copy of S*D floats per block instead of S copies of
        D floats. Over a decode batch's whole history that gather was the paged
        backend's largest cost after the matmuls; by blocks it is several times faster
        (`minserve bench kv-cache`). It is still a copy: a fused PagedAttention kernel
        reads the blocks where they lie.

        `reuse=True` writes into this storage's scratch buffers instead of new tensors,
        so the result is only valid until the next `read_blocks(..., reuse=True)`: what
        the paged attention does, layer after layer. Allocating a fresh (H_kv, B, L, D)
        tensor twice per layer cost more than the copy itself on CPU (each large
        allocation is new pages for the kernel to fault in).
        """
        k_flat, v_flat = self.flat(layer)
        H, S, D = self.num_kv_heads, self.block_size, self.head_dim
        B, M = blocks.shape
        idx = blocks.reshape(-1)  # (B*M,)
        numel = H * B * M * S * D
        if reuse:  # 1-D buffers, so that the first `numel` elements view as contiguous
            if self._scratch is None or self._scratch[0].numel() < numel:
                size = max(numel, 2 * (self._scratch[0].numel() if self._scratch else 0))
                self._scratch = (k_flat.new_empty(size), k_flat.new_empty(size))
            k_out, v_out = (buf[:numel].view(H, B * M, S * D) for buf in self._scratch)
        else:
            k_out, v_out = (k_flat.new_empty(H, B * M, S * D) for _ in range(2))
        # (H, N*S, D) viewed as (H, N, S*D): a block is one row; select B*M rows per head
        torch.index_select(k_flat.view(H, self._blocks, S * D), 1, idx, out=k_out)
        torch.index_select(v_flat.view(H, self._blocks, S * D), 1, idx, out=v_out)
        return k_out.view(H, B, M * S, D), v_out.view(H, B, M * S, D)  # (H_kv, B, M*S, D)

    def read_shared(self, layer: int, blocks: torch.Tensor) -> KV:
        """K and V of the blocks `blocks` (P,), one after the other: each (H_kv, P*S, D).
        A prefix that many rows share, read once for all of them."""
        k_flat, v_flat = self.flat(layer)
        H, S, D = self.num_kv_heads, self.block_size, self.head_dim
        return tuple(f.view(H, self._blocks, S * D).index_select(1, blocks).view(H, -1, D)
                     for f in (k_flat, v_flat))

    # --- whole blocks between pools (prefill_mode="disaggregated", disagg/) ----------------
    def share_memory_(self) -> KVBlockStorage:
        """Move the pool to memory another process can map (torch.multiprocessing): on the
        CPU, shared memory; a CUDA tensor is shared through CUDA IPC as it is."""
        for t in self._k + self._v:
            if t.device.type == "cpu":
                t.share_memory_()
        return self

    def copy_blocks(self, src: KVBlockStorage, src_blocks: list[int], dst_blocks: list[int]) -> int:
        """Copy whole blocks of `src` into blocks of this pool, every layer, K and V:
        src block src_blocks[i] -> this pool's block dst_blocks[i]. Returns the bytes moved.

            per layer and KV head:  (num_blocks, S*D) rows  ->  dst[:, dst_blocks] = src[:, src_blocks]

        What a KV connector does between a prefill and a decode instance (vLLM's copy
        into the blocks the decode side allocated), here between two pools of one machine."""
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
        if (src.block_size, src.num_layers, src.num_kv_heads, src.head_dim) != (
                self.block_size, self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError("the two pools hold KV of different shapes")
        H, S, D = self.num_kv_heads, self.block_size, self.head_dim
        s_idx = torch.tensor(src_blocks, dtype=torch.long, device=src.device)
        d_idx = torch.tensor(dst_blocks, dtype=torch.long, device=self.device)
        for layer in range(self.num_layers):
            for dst, s_flat in zip(self.flat(layer), src.flat(layer)):  # K, then V
                blocks = s_flat.view(H, src._blocks, S * D).index_select(1, s_idx)  # (H, n, S*D)
                dst.view(H, self._blocks, S * D).index_copy_(1, d_idx, blocks.to(self.device, self.dtype))
        return len(dst_blocks) * S * self.bytes_per_token()

    # --- all layers at once (what the padded backend uses for prefix caching) ---------------
    def store_tokens(self, block_table: list[int], start: int, per_layer_kv: list[KV]) -> None:
        """Write the KV of tokens start..start+T-1 of a row, for every layer.

        `per_layer_kv[layer] = (k, v)`, each either (T, H_kv, D) or Hugging Face's
        DynamicCache layout (1, H_kv, T, D). A full prompt's KV, say, after its prefill:
            storage.store_tokens(table, 0, [(l.keys, l.values) for l in cache.layers])
        """
        if len(per_layer_kv) != self.num_layers:
            raise ValueError(f"got KV for {len(per_layer_kv)} layers, the pool has {self.num_layers}")
        for layer, (k, v) in enumerate(per_layer_kv):
            if k.dim() == 4:  # (1, H_kv, T, D) -> (T, H_kv, D)
                assert k.shape[0] == 1, "store_tokens takes one row at a time"
                k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)
            slots = self.slot_mapping(block_table, start, start + k.shape[0])  # (T,)
            self.write(layer, slots, k, v)

    def load_tokens(self, block_table: list[int], num_tokens: int) -> list[KV]:
        """Tokens 0..num_tokens-1 of a row for every layer, as DynamicCache layers hold them.

        Returns `[(k, v)] * num_layers`, each (1, H_kv, num_tokens, D), fresh tensors:
            cache = DynamicCache(config=model.config)
            for layer, (k, v) in enumerate(storage.load_tokens(table, n)):
                cache.update(k, v, layer)
        """
        slots = self.slot_mapping(block_table, 0, num_tokens)  # (T,)
        out = []
        for layer in range(self.num_layers):
            k, v = self.read(layer, slots)  # (H_kv, T, D): the DynamicCache layout already
            out.append((k.unsqueeze(0), v.unsqueeze(0)))  # (1, H_kv, T, D)
        return out

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers for stats and figures."""
        return {"num_blocks": self.num_blocks, "block_size": self.block_size,
                "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": str(self.dtype).removeprefix("torch."),
                "bytes_per_token": self.bytes_per_token(), "nbytes": self.nbytes()}

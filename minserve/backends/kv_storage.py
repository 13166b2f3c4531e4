"""KVBlockStorage: the physical KV pool that block tables point into (SPEC B1, K1).

`minserve/kv_cache.py` (the BlockManager) decides *which* block ids a sequence
owns; this file holds the *tensors* those ids index. Both follow PagedAttention
(Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023): KV lives in fixed-size blocks of one preallocated
pool, so a sequence grows one block at a time, never needs a contiguous region,
and equal prefixes can share blocks.

Layout: per layer, one key tensor and one value tensor, allocated once:

    key_cache[layer]   (num_blocks, block_size, H_kv, D)       value_cache: same
                        ─────┬──── ─────┬────
                        block id    slot in block

    block_size = 16, block_table("r7") == [12, 3, 0]
    block 12: slots 0..15 = tokens  0..15 of r7
    block  3: slots 0..15 = tokens 16..31 of r7
    block  0: slots 0..4  = tokens 32..36 of r7  (slots 5..15 not written yet)

    token `pos` of a row  ->  flat slot  table[pos // 16] * 16 + pos % 16

Why token-major inside a block ((block, slot, H, D) rather than vLLM's
kernel-friendly (block, H, D/x, slot, x)): a `view(-1, H_kv, D)` of the pool is
then a flat array of *slots*, one token each, so writing a token is one
`flat[slot] = kv` and reading a row is one `flat[slots]` (spelled `index_copy_` /
`index_select`): plain indexing, which is what a reader should see first. A fused
CUDA kernel would read blocks in place instead of gathering them; on CPU the
gather is the clearest equivalent.

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
    """Preallocated per-layer K and V pools of `num_blocks` blocks x `block_size` slots."""

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if min(num_blocks, block_size, num_layers, num_kv_heads, head_dim) < 1:
            raise ValueError("KVBlockStorage: every size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)  # (N, S, H_kv, D)
        # Zeros, not empty: a slot nobody wrote is never read, but if a bug ever reads one
        # it shows up as a wrong number in a parity test, not as NaN garbage.
        self.key_cache = [torch.zeros(shape, dtype=dtype, device=self.device)
                          for _ in range(num_layers)]
        self.value_cache = [torch.zeros(shape, dtype=dtype, device=self.device)
                            for _ in range(num_layers)]

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_blocks: int, block_size: int) -> KVBlockStorage:
        """A pool shaped for `model`: its layer count, KV heads, head dim, dtype and device."""
        num_layers, num_kv_heads, head_dim = model_kv_geometry(model)
        p = next(model.parameters())
        return cls(num_blocks, block_size, num_layers, num_kv_heads, head_dim, p.dtype, p.device)

    # --- sizes ---------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Bytes one token's KV takes across all layers: 2 (K and V) * L * H_kv * D * itemsize."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def nbytes(self) -> int:
        return self.bytes_per_token() * self.num_blocks * self.block_size

    # --- addressing ----------------------------------------------------------------------
    def slot_mapping(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slots of tokens start..end-1 of the row owning `block_table`, (end - start,).

        slot = block_table[pos // block_size] * block_size + pos % block_size
        """
        if not 0 <= start <= end <= len(block_table) * self.block_size:
            raise ValueError(f"tokens {start}..{end} do not fit a table of {len(block_table)} "
                             f"blocks x {self.block_size} slots (was append_slots called?)")
        pos = torch.arange(start, end, device=self.device)  # (T,)
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)  # (num_table_blocks,)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size  # (T,)

    def flat(self, layer: int) -> KV:
        """Views of one layer's pool as a flat array of slots: (num_blocks * block_size, H_kv, D)."""
        k = self.key_cache[layer].view(-1, self.num_kv_heads, self.head_dim)  # (N*S, H_kv, D)
        v = self.value_cache[layer].view(-1, self.num_kv_heads, self.head_dim)  # (N*S, H_kv, D)
        return k, v

    # --- one layer -----------------------------------------------------------------------
    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter T tokens' K and V, each (T, H_kv, D), into the slots `slot_mapping` (T,)."""
        k_flat, v_flat = self.flat(layer)
        k_flat.index_copy_(0, slot_mapping, k.to(self.dtype))  # row t of k -> slot slot_mapping[t]
        v_flat.index_copy_(0, slot_mapping, v.to(self.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> KV:
        """K and V of the tokens in `slots` (any shape S): each (*S, H_kv, D), copies.

        `index_select` rather than `flat[slots]`: the same result, but on CPU advanced
        indexing with a 2-D index took ~10 ms here where index_select takes microseconds.
        """
        k_flat, v_flat = self.flat(layer)
        shape = (*slots.shape, self.num_kv_heads, self.head_dim)
        return (k_flat.index_select(0, slots.reshape(-1)).view(shape),  # (*S, H_kv, D)
                v_flat.index_select(0, slots.reshape(-1)).view(shape))

    def gather(self, layer: int, block_table: list[int], length: int) -> KV:
        """Tokens 0..length-1 of one row, in order: K and V each (length, H_kv, D), copies."""
        return self.read(layer, self.slot_mapping(block_table, 0, length))  # (length, H_kv, D)

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
            k, v = self.read(layer, slots)  # (T, H_kv, D)
            out.append((k.transpose(0, 1).unsqueeze(0).contiguous(),  # (1, H_kv, T, D)
                        v.transpose(0, 1).unsqueeze(0).contiguous()))
        return out

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers for stats and figures."""
        return {"num_blocks": self.num_blocks, "block_size": self.block_size,
                "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": str(self.dtype).removeprefix("torch."),
                "bytes_per_token": self.bytes_per_token(), "nbytes": self.nbytes()}

"""The paged backend: KV in blocks of a shared pool, attention over block tables (SPEC B1).

PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023), in plain PyTorch. Every row's KV lives in
the blocks its block table names (`kv_cache.BlockManager` hands the ids out,
`kv_storage.KVBlockStorage` holds the tensors), so rows of different lengths sit
side by side with no padding in storage, and a prompt whose prefix is cached
starts with the shared blocks already in its table: nothing to copy.

    decode batch       block tables       pool (block_size 4)
    row a, 6 tokens    [7, 2]             block 7: a0 a1 a2 a3   block 2: a4 a5 __ __
    row b, 3 tokens    [5]                block 5: b0 b1 b2 __
    kv_length = 6 (the longest row; drops when that row leaves: R3)

How it plugs into the real Hugging Face model, with no forked model code:
every attention layer of a transformers model calls
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, **kwargs)`
and passes the forward's extra keyword arguments down to it. So:

1. `install_paged_attention(model)` registers `paged_attention_forward` under the
   name "minserve_paged" (in transformers' process-wide AttentionInterface) and
   switches the model to it. Its mask entry is HF's own `sdpa_mask`, so forwards
   that are not ours still get their padding masks; ours ignore HF's mask (it comes
   out None anyway: no HF cache, no padding) and build their own (`PagedForward`).
2. Each forward of this backend passes `minserve_paged=PagedForward(...)`: the
   slots where the new tokens' K/V go, and the slots of every row's whole history.
   `use_cache=False`, so HF builds no DynamicCache of its own.
3. The function writes K/V into the pool, gathers each row's tokens, and attends.
   A forward WITHOUT that argument (`model.generate`, the padded backend, a plain
   `model(ids)` in a notebook) is routed to HF's sdpa attention with HF's sdpa
   masks: the model object keeps working for everybody else. Two engines sharing
   one model share nothing else: each forward carries its own context.

What changes on the model object: `model.config._attn_implementation` reads
"minserve_paged" until `close()` (a model loaded with "eager" then runs sdpa for
non-paged forwards: the same math up to float rounding). If someone switches the
model to another implementation, this backend switches it back before its next
forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..kv_cache import BlockManager
from ..request import Request
from .base import Backend, refuse_unsupported
from .kv_storage import KVBlockStorage

PAGED_ATTN_IMPL = "minserve_paged"  # the name in transformers' AttentionInterface
CONTEXT_KWARG = "minserve_paged"  # the forward kwarg that carries a PagedForward


@dataclass
class RowGroup:
    """Rows of one forward that have the same number T of new tokens: attended together.

    Their tokens are consecutive in the forward's flat token order, row after row,
    from `offset`: B rows x T tokens.
    """

    offset: int  # first token of the group in the forward's flat token order
    B: int
    T: int
    read_blocks: torch.Tensor  # (B, M) block ids of each row's tokens P*S..(P+M)*S-1 (padded)
    attn_mask: torch.Tensor  # (B, 1, T, M*S) bool: may query t of row b see key P*S + l?
    shared_blocks: torch.Tensor | None = None  # (P,) the blocks every row's table starts with
    # decode (T = 1): the same mask as numbers to add to the scores, 0 (visible) or -inf,
    # one row per (KV head, row): (H_kv * B, 1, M*S). Built once per forward, used by
    # every layer's `baddbmm` (see `_attend`).
    decode_bias: torch.Tensor | None = None
    # decode with the C kernel (fast/decode_kernel.py): tokens each row holds after this
    # forward, (B,) int64; `read_blocks` is then each row's whole table (no shared prefix
    # split: the kernel reads a shared block from the CPU's cache for every row)
    lengths: torch.Tensor | None = None


@dataclass
class PagedForward:
    """What one forward pass tells every attention layer: where to write, what to read.

    The forward's new tokens are one flat sequence: a plain batch (B rows of T tokens:
    a prefill chunk, B = 1; a decode step, T = 1) or, in `mixed_batch` prefill, every
    decode row's token and every prefilling row's chunk side by side (Version B). Rows
    with equal T form a `RowGroup` and are attended as one batch; a decode step is one
    group, a mixed forward one group of decode rows plus one per chunk length.
    Computed once per forward, used by all layers.
    """

    storage: KVBlockStorage
    write_slots: torch.Tensor  # (N,) pool slot of each new token, in flat token order
    groups: list[RowGroup]
    kernel: Any = None  # a fast.decode_kernel.DecodeKernel: decode groups attend in C
    # gather K/V into the storage's reused scratch (eager); False inside a captured CUDA
    # graph, whose buffers must be its own (fast/cuda_graphs.py)
    reuse_scratch: bool = True

    @classmethod
    def build(cls, storage: KVBlockStorage, block_tables: list[list[int]],
              positions: torch.Tensor, kernel: Any = None) -> PagedForward:
        """A plain batch: `positions` (B, T), the token index in its row of every new token."""
        starts = positions[:, 0].tolist()
        T = positions.shape[1]
        return cls.build_rows(storage, [(table, s, T) for table, s in zip(block_tables, starts)],
                              kernel)

    @classmethod
    def build_rows(cls, storage: KVBlockStorage, rows: list[tuple[list[int], int, int]],
                   kernel: Any = None) -> PagedForward:
        """`rows`: (block table, first new position, T new tokens) per row, in flat token
        order; rows with the same T must be consecutive (they form one group). `kernel`:
        decode groups attend with it (fast/decode_kernel.py) instead of `_attend`'s PyTorch."""
        write: list[int] = []  # every new token's slot, on the host: one copy to the device
        for table, s, T in rows:
            write += storage.slots(table, s, s + T)
        groups, offset, i = [], 0, 0
        while i < len(rows):
            j = i
            while j < len(rows) and rows[j][2] == rows[i][2]:
                j += 1
            groups.append(cls._group(storage, rows[i:j], offset, kernel is not None))
            offset += (j - i) * rows[i][2]
            i = j
        return cls(storage, torch.tensor(write, dtype=torch.long, device=storage.device),
                   groups, kernel)

    @staticmethod
    def _group(storage: KVBlockStorage, rows: list[tuple[list[int], int, int]],
               offset: int, kernel: bool = False) -> RowGroup:
        B, T = len(rows), rows[0][2]
        ends = [s + T for _, s, _ in rows]  # tokens each row holds after this forward
        for b, ((table, _, _), n) in enumerate(zip(rows, ends)):
            if n > len(table) * storage.block_size:
                raise ValueError(f"row {b} needs {n} tokens; its table has {len(table)} blocks")
        S = storage.block_size
        in_c = kernel and T == 1  # decode_kernel.c attends: it reads whole tables in place
        P = _shared_prefix_blocks(rows, S) if B > 1 and T == 1 and not in_c else 0
        # Every row's block table past the shared prefix in one padded tensor (B, need);
        # past a row's last block, block 0: real memory, masked below. Built on the host
        # and sent once, as the positions are (no per-row copy to the device, SPEC D5).
        need = -(-max(ends) // S) - P  # blocks covering the longest row, after the prefix
        tables = torch.tensor([table[P:P + need] + [0] * (need - len(table[P:P + need]))
                               for table, _, _ in rows], dtype=torch.long)  # (B, need)
        positions = torch.tensor([[s + t for t in range(T)] for _, s, _ in rows])  # (B, T)
        bias = lengths = None
        if in_c:  # the kernel reads raw pool addresses: no id may point outside the pool
            if not 0 <= int(tables.min()) <= int(tables.max()) < storage.num_blocks:
                raise ValueError(f"a block table names a block outside 0..{storage.num_blocks - 1}")
            lengths = torch.tensor(ends, dtype=torch.long)
        dev = storage.device
        tables, positions = tables.to(dev), positions.to(dev)
        # Keys are read a whole block at a time (`read_blocks`): L_pad = need * S columns,
        # row b's tokens in its own blocks, then whatever sits in the rest of its last
        # block and in the padding blocks (block 0). All masked below.
        key_pos = torch.arange(P * S, (P + need) * S, device=dev)  # (L_pad,) the keys' positions
        # One comparison does both jobs: key l is visible to a query at position p iff
        # l <= p. That is causality inside a prefill chunk AND it hides the padding of
        # shorter rows in the gathered (B, L_pad) batch (l >= n > p for every query of b).
        mask = key_pos[None, None, :] <= positions[:, :, None]  # (B, T, L_pad)
        shared = torch.tensor(rows[0][0][:P], dtype=torch.long, device=dev) if P else None
        if T == 1 and not in_c:  # (B, 1, L_pad) -> (H_kv, B, 1, L_pad) -> (H_kv * B, 1, L_pad)
            bias = torch.zeros(mask.shape, dtype=storage.dtype, device=dev).masked_fill_(
                ~mask, float("-inf"))  # head-major, as `_attend` stacks the (KV head, row) pairs
            bias = bias.expand(storage.num_kv_heads, *bias.shape).reshape(-1, 1, bias.shape[-1])
        return RowGroup(offset, B, T, tables, mask.unsqueeze(1), shared, bias, lengths)


def _shared_prefix_blocks(rows: list[tuple[list[int], int, int]], block_size: int) -> int:
    """How many leading blocks every row's table has in common, whole blocks that every
    query of every row sees: P with tables[b][:P] equal for all b and P*S <= each row's
    first new position. With prefix caching, rows that start with the same system prompt
    hold the very same blocks for it (K1), so their decode attention can read those keys
    ONCE for all rows instead of once per row (see `_attend`)."""
    first, limit = rows[0][0], min(s for _, s, _ in rows) // block_size
    P = 0
    while P < min(limit, len(first)) and all(t[P] == first[P] for t, _, _ in rows):
        P += 1
    return P


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature; q (B, H, T, D), k/v (B, H_kv, T, D).

    Returns (out, None) with out (B, T, H, D), as HF's own sdpa function does.
    The K/V given here are only this forward's new tokens (already rotated by RoPE).
    """
    ctx: PagedForward | None = kwargs.pop(CONTEXT_KWARG, None)
    if ctx is None:  # not one of ours: behave exactly like attn_implementation="sdpa"
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    # A sliding window reaches here only when it is at least the context (checked at
    # construction by `base.refuse_unsupported`): then it hides nothing and plain causal
    # attention is exact. Soft-capping never reaches here (refused there too).
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return paged_attention(ctx, module.layer_idx, query, key, value, scale), None


def paged_attention(ctx: PagedForward, layer: int, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, scale: float) -> torch.Tensor:
    """One layer's paged attention: q (B, H, T, D), this forward's new k/v (B, H_kv, T, D)
    -> out (B, T, H, D). Called by the HF hook above and by `fast.compact.CompactLlama`."""
    B, H, T, D = query.shape
    H_kv = key.shape[1]
    # 1. Write: this forward's new K/V into their slots. Done first, so the gather
    #    below sees each query's own token (a token attends to itself).
    new_k = key.transpose(1, 2).reshape(B * T, H_kv, D)  # (N, H_kv, D), N = B*T flat tokens
    new_v = value.transpose(1, 2).reshape(B * T, H_kv, D)  # (N, H_kv, D)
    ctx.storage.write(layer, ctx.write_slots, new_k, new_v)
    flat_q = query.transpose(1, 2).reshape(B * T, H, D)  # (N, H, D) in flat token order
    g = ctx.groups[0]
    if len(ctx.groups) == 1 and (g.B, g.T) == (B, T):  # a plain batch: q is (B, H, T, D)
        return _attend(ctx, layer, ctx.groups[0], query, H_kv, scale)  # (B, T, H, D)
    out = torch.empty_like(flat_q)  # (N, H, D)
    for g in ctx.groups:  # mixed forward: decode rows together, each chunk length apart
        n = g.B * g.T
        q = flat_q[g.offset:g.offset + n].view(g.B, g.T, H, D).transpose(1, 2)  # (B_g, H, T_g, D)
        out[g.offset:g.offset + n] = _attend(ctx, layer, g, q, H_kv, scale).reshape(n, H, D)
    return out.view(B, T, H, D)  # (1, N, H, D)


def _attend(ctx: PagedForward, layer: int, g: RowGroup, query: torch.Tensor, H_kv: int,
            scale: float) -> torch.Tensor:
    """One group's attention over its rows' histories: q (B, H, T, D) -> (B, T, H, D)."""
    B, H, T, D = query.shape
    if g.lengths is not None:  # decode in C (decode_kernel.c): the blocks read in place
        k_pool, v_pool = ctx.storage.flat(layer)  # (H_kv, num_blocks * S, D) each
        out = ctx.kernel.attend(query.reshape(B, H, D), k_pool, v_pool, g.read_blocks,
                                g.lengths, scale, ctx.storage.block_size)  # (B, H, D)
        return out.view(B, 1, H, D)
    # 2. Gather: every row's whole history, block by block, padded to L_pad = M*S in
    #    this temporary only (the pool has no padding). A fused PagedAttention kernel
    #    reads the blocks in place; one gather per layer + one batched attention is
    #    the readable CPU equivalent.
    k, v = ctx.storage.read_blocks(layer, g.read_blocks, ctx.reuse_scratch)  # (H_kv, B, L_pad, D)
    if T > 1:  # prompt chunks: PyTorch's fused CPU attention, which never materialises
        # the (T, L) scores per head (a 256-token chunk over 6,000 tokens of history is
        # 4.6 M floats per head); it takes the mask and the GQA grouping as they are.
        out = F.scaled_dot_product_attention(
            query, k.transpose(0, 1), v.transpose(0, 1), attn_mask=g.attn_mask,
            scale=scale, enable_gqa=H != H_kv)  # (B, H, T, D)
        return out.transpose(1, 2)  # (B, T, H, D)
    # 3. GQA without copying K/V G = H / H_kv times (what HF's repeat_kv does): query
    #    head h reads KV head h // G, so the G query heads of one KV head are stacked as
    #    G rows of one matmul against that head's keys. Decode has T = 1 here.
    G, L = H // H_kv, k.shape[2]
    q = query.reshape(B, H_kv, G, D).transpose(0, 1).reshape(H_kv * B, G, D)  # h = kv*G + g
    k, v = k.view(H_kv * B, L, D), v.view(H_kv * B, L, D)  # (H_kv*B, L, D): views
    # 4. Decode: attention written out (HF's eager path), one batched matmul per product
    #    over the (KV head, row) pairs; it beat F.sdpa, whose CPU kernel is tuned for long
    #    queries. The scale and the mask ride in the first matmul: baddbmm computes
    #    bias + scale * (q @ k^T), with bias 0 where a key is visible and -inf where it is
    #    padding (`RowGroup.decode_bias`), one operator instead of three.
    scores = torch.baddbmm(g.decode_bias, q, k.transpose(1, 2), alpha=scale)  # (H_kv*B, G, L)
    if g.shared_blocks is None:
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)  # (H_kv*B, G, L)
        out = torch.bmm(probs, v)  # (H_kv*B, G, L) @ (H_kv*B, L, D) -> (H_kv*B, G, D)
    else:
        # 5. A shared prefix (P blocks every row starts with, `_shared_prefix_blocks`):
        #    its keys are read once, and ALL rows' queries meet them in one matmul, as
        #    in cascade / shared-prefix attention (Hydragen, Juravsky et al. 2024;
        #    FlashInfer's cascade inference). Softmax runs over the prefix's scores and
        #    the rows' own ones side by side, so the result is the same attention.
        #        keys of row b:  [ shared prefix, P*S | row b's own blocks, L ]
        k_s, v_s = ctx.storage.read_shared(layer, g.shared_blocks)  # (H_kv, P*S, D) each
        q_all = q.view(H_kv, B * G, D)  # every row's queries stacked, per KV head
        n_s = k_s.shape[1]
        shared = torch.bmm(q_all, k_s.transpose(1, 2)).mul_(scale)  # (H_kv, B*G, P*S)
        probs = torch.cat([shared.view(H_kv * B, G, n_s), scores], dim=-1).softmax(
            dim=-1, dtype=torch.float32).to(query.dtype)  # (H_kv*B, G, P*S + L)
        out = torch.bmm(probs[..., :n_s].reshape(H_kv, B * G, n_s), v_s).view(H_kv * B, G, D)
        out = out + torch.bmm(probs[..., n_s:], v)  # + (H_kv*B, G, L) @ (H_kv*B, L, D)
    out = out.view(H_kv, B, G, D).transpose(0, 1)  # (B, H_kv, G, D)
    return out.reshape(B, 1, H, D)  # (B, T=1, H, D), heads h = kv*G + g


@torch.inference_mode()
def run_paged(model: torch.nn.Module, runner: Any, ids: torch.Tensor, positions: torch.Tensor,
              ctx: PagedForward, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The model over ids (B, T) with the attention context `ctx`; float32 logits at the
    positions `logits_to_keep` names (HF's meaning: the last k, or indices). `runner`:
    None, the HF model with this file's attention; else its `forward` (fast/compact.py).
    The paged backend's forwards and the prefill worker's (disagg/worker.py) run here."""
    if runner is not None:  # model_runner="compact": the same math, written out
        return runner.forward(ids, positions, ctx, logits_to_keep)
    if model.config._attn_implementation != PAGED_ATTN_IMPL:
        install_paged_attention(model)  # someone switched it away: switch back
    out = model(input_ids=ids, position_ids=positions, use_cache=False,
                logits_to_keep=logits_to_keep, **{CONTEXT_KWARG: ctx})
    return out.logits.float()


def install_paged_attention(model: torch.nn.Module) -> str | None:
    """Register "minserve_paged" (idempotent) and switch `model` to it; return its old name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PAGED_ATTN_IMPL, paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTN_IMPL, sdpa_mask)  # for the non-paged route
    previous = model.config._attn_implementation
    if previous != PAGED_ATTN_IMPL:
        model.set_attn_implementation(PAGED_ATTN_IMPL)
    if model.config._attn_implementation != PAGED_ATTN_IMPL:
        raise ValueError(f"{type(model).__name__} does not take a custom attention function "
                         "(transformers' AttentionInterface); use backend='padded'")
    return previous


class PagedBackend(Backend):
    """KV in a block pool; rows addressed by the BlockManager's block tables.

    `PagedBackend(model, block_manager, storage=None)`: the pool is built from the
    block manager's `num_blocks` x `block_size` unless a `KVBlockStorage` is given
    (to share one with another backend). The scheduler allocates, grows and frees
    block tables; this backend only reads them, and tracks per row how many tokens'
    KV it has written (`row_lengths()`).

    `runner` is what computes a forward: None, the HF model itself with this file's
    attention installed (any architecture transformers has), or an object whose
    `forward(ids, positions, ctx, logits_to_keep)` does it over this pool:
    `fast.compact.CompactLlama`, the Llama family's forward written out (faster on CPU;
    `EngineConfig(model_runner="compact")` builds one).

    `kernel`: None, decode attention in PyTorch (`_attend`), or a
    `fast.decode_kernel.DecodeKernel` that decode steps attend with (`decode_attention`).

    `graphs`: None, or a `fast.cuda_graphs.DecodeGraphs` that runs a forward of decode
    rows only (`cuda_graphs`, on a GPU): the compact forward replayed from a CUDA graph.
    All three come from the outer layer `minserve/fast/`, handed in by the engine: this
    file never imports them.
    """

    name = "paged"
    supports_mixed_batch = True
    supports_batched_prefill = True
    kv_grows_in_pool = True  # decode writes into the pool's blocks (see Backend)

    def __init__(self, model: torch.nn.Module, block_manager: BlockManager,
                 storage: KVBlockStorage | None = None, max_model_len: int | None = None,
                 runner: Any = None, kernel: Any = None, graphs: Any = None) -> None:
        bm = block_manager
        refuse_unsupported(model, "paged", max_model_len)
        self.runner = runner  # None: the HF model's own forward
        self.kernel = kernel  # None: decode attention in PyTorch
        self.graphs = graphs  # None: decode steps run eagerly
        self.storage = storage or KVBlockStorage.for_model(model, bm.num_blocks, bm.block_size)
        if (self.storage.num_blocks, self.storage.block_size) != (bm.num_blocks, bm.block_size):
            raise ValueError(f"storage is {self.storage.num_blocks} x {self.storage.block_size}, "
                             f"block manager {bm.num_blocks} x {bm.block_size}: they must match")
        self.model, self.block_manager = model, bm
        self.device = self.storage.device
        self.vocab_size = model.get_output_embeddings().out_features
        # The HF route needs our attention function installed; the compact one calls it itself.
        self._previous_attn = install_paged_attention(model) if self.runner is None else None
        self.staging: dict[str, int] = {}  # request_id -> tokens with KV, rows being prefilled
        self.rows: dict[str, int] = {}  # request_id -> tokens with KV, the decode batch

    def close(self) -> None:
        """Give the model back its previous attention implementation (if still ours)."""
        if self.model.config._attn_implementation == PAGED_ATTN_IMPL and self._previous_attn:
            self.model.set_attn_implementation(self._previous_attn)

    # --- prefill side ------------------------------------------------------------------
    def begin_prefill(self, req: Request) -> None:
        """Open a staging row. Its `num_cached_tokens` tokens are already in the pool: the
        block table starts with the shared prefix blocks, so there is nothing to load."""
        rid = req.request_id
        if rid in self.staging or rid in self.rows:
            raise ValueError(f"row {rid!r} is already in the paged backend")
        if not self.block_manager.has_seq(rid):
            raise ValueError(f"row {rid!r} has no block table; allocate_prompt comes first")
        if not 0 <= req.num_cached_tokens < req.prefill_len:  # K2: the last token is computed
            raise ValueError(f"num_cached_tokens={req.num_cached_tokens} for a prompt of "
                             f"{req.prefill_len} tokens")
        self.staging[rid] = req.num_cached_tokens

    def _staged(self, req: Request) -> int:
        if req.request_id not in self.staging:
            raise ValueError(f"row {req.request_id!r} is not being prefilled (begin_prefill first)")
        return self.staging[req.request_id]

    def prefill_chunk(self, req: Request, start: int, end: int) -> torch.Tensor:
        """One row's piece, alone: `forward_mixed` with no decode rows, keeping its logits
        even when it is not the prompt's final piece (the contract: always (V,))."""
        return self.forward_mixed([], [], [(req, start, end)], every_chunk=True)[1][0]

    def prefill_together(self, pieces: list[tuple[Request, int, int]]) -> list:
        """The pieces flattened into one forward: `forward_mixed` with no decode rows."""
        return self.forward_mixed([], [], pieces)[1]

    def kv_written(self, req: Request, end: int) -> None:
        """The KV of prompt[:end] was written into this row's blocks by someone else: the
        prefill worker's, spliced in at the promotion (prefill_mode="disaggregated")."""
        self._staged(req)
        self.staging[req.request_id] = end

    def promote(self, req: Request) -> None:
        held = self._staged(req)
        if held != req.prefill_len:
            raise ValueError(f"row {req.request_id!r} holds {held} of {req.prefill_len} prompt tokens")
        self.rows[req.request_id] = self.staging.pop(req.request_id)

    # --- decode side, and the one forward every entry point runs -----------------------
    def decode_step_batched(self, reqs: list[Request], token_ids: list[int]) -> torch.Tensor:
        """The decode rows alone: `forward_mixed` with no chunks; logits (B, V)."""
        return self.forward_mixed(reqs, token_ids, [])[0]

    def forward_mixed(self, decode: list[Request], tokens: list[int],
                      chunks: list[tuple[Request, int, int]],
                      every_chunk: bool = False) -> tuple[torch.Tensor, list]:
        """ONE forward for every decode row's next token and every prefilling row's next
        chunk (Version B, `mixed_batch`; with only chunks it is prefill, with only decode
        rows a decode step), flattened into one sequence of N tokens:

            flat tokens   [ a  b  c | p0 p1 ... p6 | q0 ... q31 ]
                           decode     chunk of p     chunk of q
            positions     [ 41 17 9 | 0  1  ... 6  | 96 ... 127 ]

        Each token attends only over its own row's blocks, causally (`RowGroup`s of
        equal length are attended together). Logits come out only where a token is
        sampled: each decode row, and the last token of a prompt's final chunk (of every
        chunk, with `every_chunk`).

        Returns (decode logits (len(decode), V), per chunk its (V,) logits if it was
        kept, else None), in the order given.
        """
        if len(decode) != len(tokens) or len({r.request_id for r in decode}) != len(decode):
            raise ValueError("decode needs one token per row and each row once")
        rows, ids, positions = [], [], []  # rows: (block table, first position, T) each
        last: list[int] = []  # each row's last token, in the flat order
        wanted: list[int] = []  # the rows whose last token's logits come out
        for r, tok in zip(decode, tokens):  # one group: T = 1
            pos = r.num_tokens - 1  # the new token's index in its row
            if self.rows.get(r.request_id) != pos:
                raise ValueError(f"row {r.request_id!r} holds {self.rows.get(r.request_id)} "
                                 f"tokens in the decode batch; its next token must go at {pos}")
            wanted.append(len(rows))
            rows.append((self.block_manager.block_table(r.request_id), pos, 1))
            ids.append(tok)
            positions.append(pos)
            last.append(len(ids) - 1)
        order = sorted(range(len(chunks)), key=lambda i: chunks[i][2] - chunks[i][1])
        row_of: dict[int, int] = {}  # chunk index -> its row
        for i in order:  # equal chunk lengths side by side: one group each
            req, start, end = chunks[i]
            held = self._staged(req)
            if start != held or not start < end <= req.prefill_len:
                raise ValueError(f"row {req.request_id!r} holds {held} tokens; cannot prefill "
                                 f"{start}..{end} of a {req.prefill_len}-token prompt")
            row_of[i] = len(rows)
            if every_chunk or end == req.prefill_len:
                wanted.append(len(rows))
            rows.append((self.block_manager.block_table(req.request_id), start, end - start))
            ids.extend(req.prefill_token_ids[start:end])
            positions.extend(range(start, end))
            last.append(len(ids) - 1)
        if not rows:
            return torch.zeros(0, self.vocab_size), []
        if not chunks and self.graphs is not None and self.graphs.fits(len(rows)):
            # decode rows only: the same forward replayed from a CUDA graph (fast/)
            logits = self.graphs.run(ids, positions, [table for table, _, _ in rows])
            for r in decode:
                self.rows[r.request_id] += 1
            return logits, []
        ctx = PagedForward.build_rows(self.storage, rows, self.kernel)
        ids_t = torch.tensor([ids], device=self.device)  # (1, N)
        pos_t = torch.tensor([positions], device=self.device)  # (1, N)
        if len(ctx.groups) == 1:  # a plain batch of B rows x T tokens: run it as (B, T)
            g = ctx.groups[0]
            logits = self._run(ids_t.view(g.B, g.T), pos_t.view(g.B, g.T), ctx, 1)[:, -1]  # (B, V)
            at = {j: j for j in wanted}  # row j's logits: every row's last token came out
        else:  # flat (1, N): only the wanted rows' last tokens go through the output head
            keep = torch.tensor([last[j] for j in wanted] or [len(ids) - 1], device=self.device)
            logits = self._run(ids_t, pos_t, ctx, keep)[0]  # (len(wanted), V)
            at = {j: k for k, j in enumerate(wanted)}
        for r in decode:
            self.rows[r.request_id] += 1
        for req, _, end in chunks:
            self.staging[req.request_id] = end
        return logits[:len(decode)], [logits[at[row_of[i]]] if row_of[i] in at else None
                                      for i in range(len(chunks))]

    def remove_row(self, req: Request) -> None:
        """Forget the row. Its blocks are the block manager's to free (the scheduler does)."""
        self.staging.pop(req.request_id, None)
        self.rows.pop(req.request_id, None)

    def reset(self) -> None:
        """Forget every row (blocks are the block manager's): `Scheduler.fail_all`'s last resort."""
        self.staging.clear()
        self.rows.clear()

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, ctx: PagedForward,
             logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        return run_paged(self.model, self.runner, ids, positions, ctx, logits_to_keep)

    # --- metrics, figures, invariants --------------------------------------------------
    @property
    def kv_length(self) -> int:
        """The longest decode-batch row, in tokens. A metric only (R3): it shrinks when
        the longest row leaves, so no scheduler tensor may be sized from it."""
        return max(self.rows.values(), default=0)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def row_lengths(self) -> dict[str, int]:
        """Tokens whose KV is in the pool, per row (decode batch and staging)."""
        return {**self.rows, **self.staging}

    def snapshot(self) -> dict[str, Any]:
        bm = self.block_manager
        rows = [{"request_id": rid, "state": state, "length": n,
                 "block_table": bm.block_table(rid) if bm.has_seq(rid) else []}
                for state, group in (("active", self.rows), ("prefilling", self.staging))
                for rid, n in group.items()]
        return {**super().snapshot(), "block_size": self.storage.block_size,
                "rows": rows, "storage": self.storage.snapshot()}

    def check_invariants(self) -> None:
        """Every row fits its block table, and no row can write into a shared block."""

        def need(cond: bool, msg: str) -> None:
            if not cond:  # not `assert`: must still check under `python -O`
                raise AssertionError(msg)

        bs = self.storage.block_size
        need(not self.rows.keys() & self.staging.keys(), "a row is both staged and active")
        owners: dict[int, list[tuple[str, int]]] = {}  # block id -> (row, index in its table)
        for rid, n in self.row_lengths().items():
            need(self.block_manager.has_seq(rid), f"row {rid!r} has no block table (freed early?)")
            table = self.block_manager.block_table(rid)
            need(0 <= n <= len(table) * bs, f"row {rid!r}: {n} tokens in {len(table)} blocks")
            for i, block_id in enumerate(table):
                need(0 <= block_id < self.storage.num_blocks, f"row {rid!r}: bad block {block_id}")
                owners.setdefault(block_id, []).append((rid, i))
        # A block in two tables must hold only already-computed tokens for both: row r
        # writes its next token into table index n // bs, which must be private to r.
        lengths = self.row_lengths()
        for block_id, users in owners.items():
            if len(users) > 1:
                for rid, i in users:
                    need(i < lengths[rid] // bs,
                         f"block {block_id} is shared but row {rid!r} still writes into it")

"""The block manager: which physical KV blocks each sequence uses (SPEC K1-K3).

Pure bookkeeping, no tensors. The KV of every sequence lives in a pool of
`num_blocks` fixed-size blocks of `block_size` tokens, the way an OS pages
virtual memory (PagedAttention: Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP 2023). A sequence owns a
*block table*, the list of physical block ids holding its tokens in order; the
paged backend reads and writes the tensors, this module only hands out the ids.

    block_size = 16                   pool: [ 0 ][ 1 ][ 2 ][ 3 ] ... [12] ...
    row "r7": tokens  0..15 -> block 12          ^               ^
              tokens 16..31 -> block  3  --------'               |
              tokens 32..36 -> block  0  (5 of 16 slots used)    '-- r7's first block
    block_table("r7") == [12, 3, 0]
    token at position pos lives in block table[pos // 16], slot pos % 16,
    i.e. flat slot table[pos // 16] * 16 + pos % 16 of the pool (see `slot`).

Prefix caching (vLLM's "automatic prefix caching"). A *full* block whose KV has
been computed is named by a chained hash of its tokens and of everything before it:

    h0 = hash((ROOT, tokens[0:16]))    h1 = hash((h0, tokens[16:32]))    ...

The KV of a token depends on every token before it, so the same 16 tokens after a
different prefix must NOT match: chaining the parent hash makes the name cover the
whole prefix. A table `hash -> block id` lets a new prompt find its longest cached
prefix block by block, and share those blocks instead of recomputing them:

    "sys prompt + Q1":  [h0:blk 4][h1:blk 9][blk 2 ...]        ref_count(4) == 2
    "sys prompt + Q2":  [h0:blk 4][h1:blk 9][blk 7 ...]        ref_count(9) == 2

Rules that keep reuse correct:
* Only full blocks are shared; the partially filled last block of a sequence is
  always private (decode writes into it).
* K3: a block gets its hash only in `mark_computed`, once its KV exists. Two
  requests admitted in the same tick with the same new prefix both compute it;
  the second never reads KV that is not there yet.
* K2: at least the last prompt token is always computed, so the model produces
  logits to sample the first output token from.

Every block is in exactly one of three states:

    free     ref_count 0, no hash: never used, or its content is worthless
    used     ref_count > 0: in the block table of ref_count sequences
    cached   ref_count 0, with hash: nobody uses it, but its KV is kept in case a
             later prompt shares the prefix; evicted least-recently-used first
             when the free list is empty (the evicted block loses its hash).

A note on hashing: Python's `hash` of a tuple of ints is deterministic across
processes, but only 64 bits; a collision would silently reuse the wrong KV. vLLM
offers sha256 for that reason; a teaching engine accepts the risk.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

ROOT_HASH = 0  # the parent hash of a sequence's first block


def hash_block(parent_hash: int | None, tokens: tuple[int, ...] | list[int]) -> int:
    """Chained hash of one full block: equal only for equal tokens after an equal prefix."""
    return hash((ROOT_HASH if parent_hash is None else parent_hash, tuple(tokens)))


def root_hash(salt: str | None) -> int:
    """The parent hash of a sequence's first block. A salt (the tenant, SPEC H5; vLLM's
    per-request `cache_salt`) starts the chain somewhere else, so equal prompts of two
    tenants get different hashes at every block: a tenant can only ever hit blocks its
    own requests computed, and learns nothing (no cached_tokens, no faster first token)
    about another's prompts.

        tenant a: ROOT_a -> h(ROOT_a, t[0:16]) -> h(.., t[16:32]) ...
        tenant b: ROOT_b -> h(ROOT_b, t[0:16]) -> ...        never equal to a's
    """
    return ROOT_HASH if salt is None else hash(("cache_salt", salt))


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for. Callers gate first (SPEC G3)."""


@dataclass
class Block:
    """One physical block of `block_size` KV slots."""

    block_id: int
    ref_count: int = 0  # how many block tables contain this block
    block_hash: int | None = None  # set only once the block is FULL and its KV COMPUTED (K3)
    num_tokens: int = 0  # slots in use so far (0..block_size)
    last_used: int = 0  # logical clock for LRU (not wall time: replays are deterministic)


class BlockManager:
    """Hands out KV blocks to sequences; shares computed full blocks between equal prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got "
                             f"num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, no hash; taken from the left
        # ref 0 with hash, oldest first: the LRU order is the insertion order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}  # hash -> block id, for full computed blocks
        self._tables: dict[str, list[int]] = {}  # seq id -> block ids, in token order
        self._seq_len: dict[str, int] = {}  # seq id -> tokens its table holds
        # seq id -> chained hashes of its leading computed full blocks (the chain continues
        # even where a block stayed private because an equal block was already registered).
        self._seq_hashes: dict[str, list[int]] = {}
        self._seq_salt: dict[str, str | None] = {}  # seq id -> its tenant's salt (H5)
        self._clock = 0
        self.prefix_hit_tokens = 0  # cached tokens handed out by allocate_prompt
        self.prefix_query_tokens = 0  # prompt tokens asked for by allocate_prompt
        self.evictions = 0  # cached blocks dropped to make room

    # --- small helpers ----------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return math.ceil(num_tokens / self.block_size)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _block_tokens(self, token_ids: list[int], i: int) -> tuple[int, ...]:
        return tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _cached_blocks(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Block ids of the longest cached prefix, capped so the last token is computed (K2).
        Only blocks hashed under the same `salt` (tenant) can match."""
        if not self.enable_prefix_caching or not token_ids:
            return []
        # (len - 1) // block_size: the block holding the last token is never reused, so a
        # prompt of exactly 2 full blocks reuses at most the first one.
        max_blocks = (len(token_ids) - 1) // self.block_size
        found, parent = [], root_hash(salt)
        for i in range(max_blocks):
            h = hash_block(parent, self._block_tokens(token_ids, i))
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break  # chained: once one block misses, no later block can match
            found.append(block_id)
            parent = h
        return found

    def _hits(self, token_ids: list[int], salt: str | None) -> list[int]:
        # (lab 5's `_cached_blocks` takes only the tokens: pass a salt only when there is one)
        return (self._cached_blocks(token_ids) if salt is None
                else self._cached_blocks(token_ids, salt))

    def _take_block(self) -> Block:
        """A block with ref 0 for new content: the free list first, else evict the LRU cached."""
        if self._free:
            block = self.blocks[self._free.popleft()]
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)  # oldest first
            block = self.blocks[block_id]
            del self._hash_to_block[block.block_hash]  # its content is about to be overwritten
            block.block_hash = None
            self.evictions += 1
        else:
            raise NoFreeBlocksError("no free or evictable KV block left")
        block.ref_count, block.num_tokens, block.last_used = 1, 0, self._tick()
        return block

    # --- admit's questions (read-only) ------------------------------------------------------
    def cached_prefix_len(self, token_ids: list[int], salt: str | None = None) -> int:
        """Tokens of `token_ids` whose KV is cached and reusable: whole blocks, < len (K2)."""
        return len(self._hits(token_ids, salt)) * self.block_size

    def blocks_needed(self, token_ids: list[int], num_tokens: int | None = None,
                      salt: str | None = None) -> int:
        """How much `num_free_blocks()` would drop if this prompt were allocated (gate G3).

        That is the new blocks for the uncached part, plus the cached hits that nobody
        uses right now: reusing those takes them out of the evictable pool too. Hits
        already used by another sequence are free to share and do not count.
        `num_tokens` (default: the prompt's length) lets a caller size room for more.
        """
        n = len(token_ids) if num_tokens is None else num_tokens
        if n < 0:
            raise ValueError(f"num_tokens={n}; must be >= 0")
        hits = self._hits(token_ids, salt)[:self.num_blocks_for(n)]
        idle_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.num_blocks_for(n) - len(hits) + idle_hits

    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0: the free list plus the cached-but-evictable ones."""
        return len(self._free) + len(self._evictable)

    def can_append_slots(self, seq_id: str, num_tokens: int) -> bool:
        extra = self.num_blocks_for(num_tokens) - len(self._tables[seq_id])
        return extra <= self.num_free_blocks()

    # --- mutations ----------------------------------------------------------------------------
    def allocate_prompt(self, seq_id: str, token_ids: list[int], salt: str | None = None) -> int:
        """Give `seq_id` a block table for its whole prompt; return its cached token count.

        The cached prefix reuses blocks (ref_count += 1); the rest gets new blocks.
        Atomic: raises NoFreeBlocksError and changes nothing when the pool is too small.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks; free it first")
        if self.blocks_needed(token_ids, salt=salt) > self.num_free_blocks():
            raise NoFreeBlocksError(
                f"{seq_id!r} needs {self.blocks_needed(token_ids, salt=salt)} blocks, "
                f"{self.num_free_blocks()} free; gate G3 should have held it")
        now = self._tick()
        # Pin the hits first, so taking new blocks below can never evict them.
        table = self._hits(token_ids, salt)
        for block_id in table:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]  # cached -> used
            block.ref_count += 1
            block.last_used = now
        num_cached = len(table) * self.block_size
        self._seq_hashes[seq_id] = [self.blocks[b].block_hash for b in table]
        self._seq_salt[seq_id] = salt
        for i in range(len(table), self.num_blocks_for(len(token_ids))):
            block = self._take_block()
            block.num_tokens = min(self.block_size, len(token_ids) - i * self.block_size)
            table.append(block.block_id)
        self._tables[seq_id] = table
        self._seq_len[seq_id] = len(token_ids)
        self.prefix_hit_tokens += num_cached
        self.prefix_query_tokens += len(token_ids)
        return num_cached

    def append_slots(self, seq_id: str, num_tokens: int) -> None:
        """Grow `seq_id`'s table to hold `num_tokens` tokens in total (decode: one more).

        Fills the private last block first, then takes new blocks. Atomic on failure.
        """
        table, old = self._tables[seq_id], self._seq_len[seq_id]
        if num_tokens < old:
            raise ValueError(f"{seq_id!r} holds {old} tokens; cannot shrink to {num_tokens}")
        if not self.can_append_slots(seq_id, num_tokens):
            raise NoFreeBlocksError(f"no free block to grow {seq_id!r} to {num_tokens} tokens")
        if table and old % self.block_size:  # the partial last block: always private
            last = self.blocks[table[-1]]
            assert last.ref_count == 1 and last.block_hash is None, "partial block is shared"
            last.num_tokens = min(self.block_size, num_tokens - (len(table) - 1) * self.block_size)
        while len(table) < self.num_blocks_for(num_tokens):
            block = self._take_block()
            block.num_tokens = min(self.block_size, num_tokens - len(table) * self.block_size)
            table.append(block.block_id)
        self._seq_len[seq_id] = num_tokens

    def mark_computed(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """The KV of `token_ids[:num_computed]` now exists: publish its full blocks (K3).

        `token_ids` is the sequence so far (prompt, and output tokens if wanted). Each
        newly full, computed block gets its chained hash registered, so later prompts
        may share it. If an equal block is already registered (two requests computed
        the same prefix side by side), the existing one stays the cached copy and this
        block stays private, unhashed, and returns to the free list when freed.
        """
        if not self.enable_prefix_caching:
            return
        table, hashes = self._tables[seq_id], self._seq_hashes[seq_id]
        if num_computed > min(len(token_ids), self._seq_len[seq_id]):
            raise ValueError(f"{seq_id!r}: num_computed={num_computed} exceeds its tokens")
        parent = hashes[-1] if hashes else root_hash(self._seq_salt.get(seq_id))
        for i in range(len(hashes), num_computed // self.block_size):
            h = hash_block(parent, self._block_tokens(token_ids, i))
            hashes.append(h)
            parent = h
            block = self.blocks[table[i]]
            if block.block_hash is None and h not in self._hash_to_block:
                block.block_hash = h
                self._hash_to_block[h] = block.block_id

    def free(self, seq_id: str) -> None:
        """Drop `seq_id`: ref_count -= 1 on its blocks. Unknown ids are ignored.

        Blocks reaching 0 keep their KV if hashed (cached, newest in the LRU order),
        else go back to the free list. The table is walked back to front, so the tail
        of a chain is evicted before its head: a head without its tail still serves
        shorter prefixes, a tail without its head is unreachable.
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._seq_len[seq_id], self._seq_hashes[seq_id]
        self._seq_salt.pop(seq_id, None)
        now = self._tick()
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            block.last_used = now
            if block.ref_count > 0:
                continue
            if block.block_hash is not None:
                self._evictable[block_id] = None  # used -> cached
            else:
                block.num_tokens = 0
                self._free.append(block_id)  # used -> free

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._tables[seq_id])

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def slot(self, seq_id: str, pos: int) -> int:
        """Flat slot index of token `pos` of `seq_id` in a (num_blocks * block_size) pool."""
        block_id = self._tables[seq_id][pos // self.block_size]
        return block_id * self.block_size + pos % self.block_size

    # --- observability (SPEC G5) ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        used = self.num_blocks - len(self._free) - len(self._evictable)
        return {
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "free": len(self._free), "cached": len(self._evictable), "used": used,
            "kv_pressure": used / self.num_blocks,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_query_tokens": self.prefix_query_tokens,
            "prefix_hit_rate": self.prefix_hit_tokens / max(1, self.prefix_query_tokens),
            "evictions": self.evictions,
        }

    def snapshot(self) -> list[dict[str, Any]]:
        """One plain dict per block, in block id order: what figures draw."""
        owners: dict[int, list[str]] = {}
        for seq_id, table in self._tables.items():
            for block_id in table:
                owners.setdefault(block_id, []).append(seq_id)
        return [{
            "id": b.block_id,
            "state": "used" if b.ref_count else ("cached" if b.block_hash is not None else "free"),
            "ref_count": b.ref_count, "owners": owners.get(b.block_id, []),
            "hash": None if b.block_hash is None else f"{b.block_hash & 0xFFFFFF:06x}",
            "num_tokens": b.num_tokens, "last_used": b.last_used,
        } for b in self.blocks]

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call it after each op)."""

        def need(cond: bool, msg: str) -> None:
            if not cond:  # not `assert`: must still check under `python -O`
                raise AssertionError(msg)

        free, cached = set(self._free), set(self._evictable)
        need(len(free) == len(self._free), "a block is twice in the free list")
        need(not free & cached, f"blocks both free and cached: {sorted(free & cached)}")
        refs = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            need(len(table) == self.num_blocks_for(self._seq_len[seq_id]),
                 f"{seq_id!r}: {len(table)} blocks for {self._seq_len[seq_id]} tokens")
            need(len(set(table)) == len(table), f"{seq_id!r}: a block twice in its table")
            for block_id in table:
                refs[block_id] += 1
        for b in self.blocks:
            i = b.block_id
            need(b.ref_count == refs[i], f"block {i}: ref_count {b.ref_count} != {refs[i]} tables")
            need((i in free) + (i in cached) + (b.ref_count > 0) == 1,
                 f"block {i} is not in exactly one of free / cached / used")
            need(0 <= b.num_tokens <= self.block_size, f"block {i}: num_tokens {b.num_tokens}")
            if i in free:
                need(b.block_hash is None, f"free block {i} has a hash")
            if i in cached:
                need(b.block_hash is not None, f"cached block {i} has no hash")
            if b.block_hash is not None:
                need(b.num_tokens == self.block_size, f"hashed block {i} is not full")
                need(self._hash_to_block.get(b.block_hash) == i, f"block {i}: hash not in table")
            if b.ref_count > 1:
                need(b.block_hash is not None, f"shared block {i} has no hash (K3)")
        for h, i in self._hash_to_block.items():
            need(self.blocks[i].block_hash == h, f"hash table points at block {i} with other hash")
        stamps = [self.blocks[i].last_used for i in self._evictable]
        need(stamps == sorted(stamps), "the LRU order of cached blocks is not oldest-first")

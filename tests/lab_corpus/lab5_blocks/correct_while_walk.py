# correct: the walk as a while loop over slices, eviction through next(iter(...)), free with an early return
class BlockManagerLab(BlockManager):

    def _cached_blocks(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached prefix, at most (len - 1) // block_size blocks."""
        if not self.enable_prefix_caching:
            return []
        limit = max(0, (len(token_ids) - 1) // self.block_size)
        found: list[int] = []
        parent = None
        while len(found) < limit:
            start = len(found) * self.block_size
            h = hash_block(parent, token_ids[start:start + self.block_size])
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                return found
            found.append(block_id)
            parent = h
        return found

    def _take_block(self) -> Block:
        """A block for new content, ref_count 1: the free list first, else evict the LRU cached."""
        if not self._free and not self._evictable:
            raise NoFreeBlocksError("the pool is exhausted")
        if self._free:
            block = self.blocks[self._free.popleft()]
        else:
            oldest = next(iter(self._evictable))
            del self._evictable[oldest]
            block = self.blocks[oldest]
            self._hash_to_block.pop(block.block_hash)
            block.block_hash = None
            self.evictions += 1
        block.ref_count = 1
        block.num_tokens = 0
        block.last_used = self._tick()
        return block

    def free(self, seq_id: str) -> None:
        """Drop seq_id's table: ref_count - 1 per block, back to front; at 0 -> cached or free."""
        if seq_id not in self._tables:
            return
        table = self._tables.pop(seq_id)
        self._seq_len.pop(seq_id)
        self._seq_hashes.pop(seq_id)
        self._seq_salt.pop(seq_id, None)
        now = self._tick()
        for block_id in table[::-1]:
            block = self.blocks[block_id]
            block.ref_count -= 1
            block.last_used = now
            if block.ref_count:
                continue
            if block.block_hash is None:
                block.num_tokens = 0
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None

# correct: free counts every block down first, then sends the ones at 0 back in one pass, still back to front; the walk with a while loop
class BlockManagerLab(BlockManager):

    def _cached_blocks(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached prefix, at most (len - 1) // block_size blocks."""
        if not self.enable_prefix_caching:
            return []
        limit = max(0, (len(token_ids) - 1) // self.block_size)
        blocks, parent, i = [], None, 0
        while i < limit:
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self._hash_to_block.get(parent)
            if block_id is None:
                return blocks
            blocks.append(block_id)
            i += 1
        return blocks

    def _take_block(self) -> Block:
        """A block for new content, ref_count 1: the free list first, else evict the LRU cached."""
        if self._free:
            block = self.blocks[self._free.popleft()]
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self._hash_to_block[block.block_hash]
            block.block_hash = None
            self.evictions += 1
        else:
            raise NoFreeBlocksError("no free or evictable KV block left")
        block.ref_count, block.num_tokens, block.last_used = 1, 0, self._tick()
        return block

    def free(self, seq_id: str) -> None:
        """Drop seq_id's table: ref_count - 1 per block, back to front; at 0 -> cached or free."""
        if seq_id not in self._tables:
            return
        table = self._tables.pop(seq_id)
        for entries in (self._seq_len, self._seq_hashes, self._seq_salt):
            entries.pop(seq_id, None)
        now = self._tick()
        for block_id in table:
            self.blocks[block_id].ref_count -= 1
            self.blocks[block_id].last_used = now
        for block_id in table[::-1]:
            block = self.blocks[block_id]
            if block.ref_count:
                continue
            if block.block_hash is None:
                block.num_tokens = 0
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None

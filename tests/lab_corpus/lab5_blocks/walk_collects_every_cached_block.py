# mistake: the walk hashes every full block along the chain and keeps all that are cached
# expect: where to look: BlockManagerLab
# expect: stopping at the first miss
class BlockManagerLab(BlockManager):

    def _cached_blocks(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached prefix, at most (len - 1) // block_size blocks."""
        if not self.enable_prefix_caching or not token_ids:
            return []
        hashes, parent = [], None
        for i in range((len(token_ids) - 1) // self.block_size):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(parent)
        return [self._hash_to_block[h] for h in hashes if h in self._hash_to_block]

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
                self._evictable[block_id] = None
            else:
                block.num_tokens = 0
                self._free.append(block_id)

# correct: minserve's own BlockManager methods copied out of the installed wheel with the names changed: it behaves, so it passes; the similarity report flags it for a person
# flagged: a renamed copy of BlockManager's three methods
class BlockManagerLab(BlockManager):
    def _cached_blocks(self, toks):
        if not self.enable_prefix_caching or not toks:
            return []
        m = (len(toks) - 1) // self.block_size
        got, par = [], None
        for j in range(m):
            h = hash_block(par, self._block_tokens(toks, j))
            b = self._hash_to_block.get(h)
            if b is None:
                break
            got.append(b)
            par = h
        return got

    def _take_block(self):
        if self._free:
            blk = self.blocks[self._free.popleft()]
        elif self._evictable:
            bid, _ = self._evictable.popitem(last=False)
            blk = self.blocks[bid]
            del self._hash_to_block[blk.block_hash]
            blk.block_hash = None
            self.evictions += 1
        else:
            raise NoFreeBlocksError("none left")
        blk.ref_count, blk.num_tokens, blk.last_used = 1, 0, self._tick()
        return blk

    def free(self, sid):
        t = self._tables.pop(sid, None)
        if t is None:
            return
        del self._seq_len[sid], self._seq_hashes[sid]
        self._seq_salt.pop(sid, None)
        now = self._tick()
        for bid in reversed(t):
            blk = self.blocks[bid]
            blk.ref_count -= 1
            blk.last_used = now
            if blk.ref_count > 0:
                continue
            if blk.block_hash is not None:
                self._evictable[bid] = None
            else:
                blk.num_tokens = 0
                self._free.append(bid)

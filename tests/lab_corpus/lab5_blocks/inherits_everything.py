# mistake: BlockManagerLab inherits the three graded methods from BlockManager
# expect: does not define _cached_blocks, _take_block, free
class BlockManagerLab(BlockManager):
    pass

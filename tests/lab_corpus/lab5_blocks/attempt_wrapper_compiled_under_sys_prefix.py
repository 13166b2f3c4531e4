# attempt: _take_block is a wrapper compiled with a file name under sys.prefix, so a guard that trusts library code lets it call BlockManager's own
# expect: the graded cell was not run
# expect: `import sys` is not allowed
import sys

_src = "def _take_block(self):\n    return BlockManager._take_block(self)\n"
_ns = {"BlockManager": BlockManager}
exec(compile(_src, sys.prefix + "/lib/python3/site-packages/helpers.py", "exec"), _ns)


class BlockManagerLab(BlockManager):
    _take_block = _ns["_take_block"]

    def _cached_blocks(self, token_ids: list[int]) -> list[int]:
        return []

    def free(self, seq_id: str) -> None:
        return None

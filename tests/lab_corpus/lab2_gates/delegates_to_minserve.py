# mistake: the gates call minserve's own gate functions
# expect: the graded cell was not run
# expect: `from minserve import gates`: the engine's own code is not allowed
from minserve import gates as core


def check_queue_capacity(pending: int, max_queue_size: int) -> Rejection | None:
    return core.check_queue_capacity(pending, max_queue_size)


def check_kv_budget(need: int, reserved: int, budget: int) -> Rejection | None:
    return core.check_kv_budget(need, reserved, budget)


def check_block_pool(blocks_needed: int, free_blocks: int, prompt_blocks: int,
                     num_blocks: int) -> Rejection | None:
    return core.check_block_pool(blocks_needed, free_blocks, prompt_blocks, num_blocks)

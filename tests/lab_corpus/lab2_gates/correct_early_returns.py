# correct: one helper builds every rejection; each gate returns early on the pass, hard before soft
def _refuse(gate, reason, hard, message, **numbers):
    return Rejection(gate=gate, reason=reason, hard=hard, message=message, numbers=dict(numbers))


def check_queue_capacity(pending: int, max_queue_size: int) -> Rejection | None:
    if pending < max_queue_size:
        return None
    return _refuse("G1", "queue_full", True, "the queue is full", pending=pending,
                   max_queue_size=max_queue_size)


def check_kv_budget(need: int, reserved: int, budget: int) -> Rejection | None:
    if need > budget:
        return _refuse("G2", "kv_budget_exceeded", True, "it can never fit", need=need,
                       reserved=reserved, budget=budget)
    if reserved + need <= budget:
        return None
    return _refuse("G2", "kv_budget", False, "wait for room", need=need, reserved=reserved,
                   budget=budget)


def check_block_pool(blocks_needed: int, free_blocks: int, prompt_blocks: int,
                     num_blocks: int) -> Rejection | None:
    args = {"blocks_needed": blocks_needed, "free_blocks": free_blocks,
            "prompt_blocks": prompt_blocks, "num_blocks": num_blocks}
    if prompt_blocks > num_blocks:
        return _refuse("G3", "prompt_exceeds_block_pool", True, "bigger than the pool", **args)
    if blocks_needed <= free_blocks:
        return None
    return _refuse("G3", "block_pool", False, "wait for free blocks", **args)

# correct: the gates as one table-driven helper, rules tried in order (hard first)
def _first(gate, numbers, rules):
    for broken, reason, hard, message in rules:
        if broken:
            return Rejection(gate=gate, reason=reason, hard=hard, message=message, numbers=numbers)
    return None


def check_queue_capacity(pending: int, max_queue_size: int) -> Rejection | None:
    return _first("G1", {"pending": pending, "max_queue_size": max_queue_size},
                  [(pending >= max_queue_size, "queue_full", True, "queue full")])


def check_kv_budget(need: int, reserved: int, budget: int) -> Rejection | None:
    return _first("G2", {"need": need, "reserved": reserved, "budget": budget},
                  [(need > budget, "kv_budget_exceeded", True, "over the whole budget"),
                   (reserved + need > budget, "kv_budget", False, "wait for the budget")])


def check_block_pool(blocks_needed: int, free_blocks: int, prompt_blocks: int,
                     num_blocks: int) -> Rejection | None:
    return _first("G3", {"blocks_needed": blocks_needed, "free_blocks": free_blocks,
                         "prompt_blocks": prompt_blocks, "num_blocks": num_blocks},
                  [(prompt_blocks > num_blocks, "prompt_exceeds_block_pool", True, "too big"),
                   (blocks_needed > free_blocks, "block_pool", False, "wait for blocks")])

# mistake: G1 refuses only when pending equals the queue's size, so a queue already beyond it (preempted rows came back without passing G1) takes more
# expect: where to look: check_queue_capacity
# expect: however far beyond it pending already is
def check_queue_capacity(pending: int, max_queue_size: int) -> Rejection | None:
    if pending == max_queue_size:
        return Rejection(gate="G1", reason="queue_full", hard=True,
                         message=f"the pending queue is full ({pending}/{max_queue_size})",
                         numbers={"pending": pending, "max_queue_size": max_queue_size})
    return None


def check_kv_budget(need: int, reserved: int, budget: int) -> Rejection | None:
    numbers = {"need": need, "reserved": reserved, "budget": budget}
    if need > budget:
        return Rejection(gate="G2", reason="kv_budget_exceeded", hard=True, numbers=numbers,
                         message=f"{need} tokens exceed the whole budget of {budget}")
    if reserved + need > budget:
        return Rejection(gate="G2", reason="kv_budget", hard=False, numbers=numbers,
                         message=f"{reserved} of {budget} reserved; {need} more needed")
    return None


def check_block_pool(blocks_needed: int, free_blocks: int, prompt_blocks: int,
                     num_blocks: int) -> Rejection | None:
    numbers = {"blocks_needed": blocks_needed, "free_blocks": free_blocks,
               "prompt_blocks": prompt_blocks, "num_blocks": num_blocks}
    if prompt_blocks > num_blocks:
        return Rejection(gate="G3", reason="prompt_exceeds_block_pool", hard=True,
                         numbers=numbers, message=f"{prompt_blocks} blocks > pool of {num_blocks}")
    if blocks_needed > free_blocks:
        return Rejection(gate="G3", reason="block_pool", hard=False, numbers=numbers,
                         message=f"{blocks_needed} blocks needed, {free_blocks} free")
    return None

"""The block manager's invariants (SPEC K1-K3, G3, R2): sharing, K2 cap, K3, LRU, accounting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.kv_cache import BlockManager, NoFreeBlocksError

BS = 4  # a small block size keeps the token lists readable


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def computed(bm: BlockManager, seq_id: str, token_ids: list[int]) -> int:
    """Allocate and mark the whole prompt computed, as a finished prefill would."""
    cached = bm.allocate_prompt(seq_id, token_ids)
    bm.mark_computed(seq_id, token_ids, len(token_ids))
    bm.check_invariants()
    return cached


def test_equal_prefixes_share_blocks_and_a_different_second_block_diverges():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = toks(0, 8) + [100]
    computed(bm, "a", a)
    b = toks(0, 8) + [200, 201]  # same two full blocks
    assert bm.allocate_prompt("b", b) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]  # partial last block: private
    assert [bm.blocks[i].ref_count for i in bm.block_table("a")] == [2, 2, 1]
    c = toks(0, 4) + [9, 9, 9, 9, 1]  # first block equal, second differs
    assert bm.allocate_prompt("c", c) == 4
    assert bm.block_table("c")[0] == bm.block_table("a")[0]
    assert bm.block_table("c")[1] != bm.block_table("a")[1]
    bm.check_invariants()


def test_chained_hash_does_not_match_same_block_under_a_different_parent():
    bm = BlockManager(num_blocks=16, block_size=BS)
    computed(bm, "a", [1, 1, 1, 1] + [5, 6, 7, 8] + [0])
    # Block 2 has the same tokens as a's block 2, but after a different first block.
    assert bm.cached_prefix_len([2, 2, 2, 2] + [5, 6, 7, 8] + [0]) == 0
    assert bm.cached_prefix_len([1, 1, 1, 1] + [5, 6, 7, 8] + [0]) == 8


def test_fully_cached_prompt_still_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=16)
    prompt = toks(0, 32)  # exactly two full blocks
    computed(bm, "a", prompt)
    assert bm.cached_prefix_len(prompt) == 16  # not 32: the last token must give logits (K2)
    assert bm.cached_prefix_len(prompt + [99]) == 32
    assert bm.cached_prefix_len(prompt[:16]) == 0  # one block prompt: nothing reusable
    assert bm.allocate_prompt("b", prompt) == 16
    assert bm.block_table("b")[0] == bm.block_table("a")[0]
    assert bm.block_table("b")[1] != bm.block_table("a")[1]
    bm.check_invariants()


def test_uncomputed_prefix_is_not_reused_until_mark_computed():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = toks(0, 9)
    assert bm.allocate_prompt("first", prompt) == 0
    assert bm.allocate_prompt("second", prompt) == 0  # K3: first's KV does not exist yet
    assert set(bm.block_table("first")).isdisjoint(bm.block_table("second"))
    bm.mark_computed("first", prompt, len(prompt))
    bm.mark_computed("second", prompt, len(prompt))  # equal blocks: first's stay the cached copy
    bm.check_invariants()
    assert bm.allocate_prompt("third", prompt) == 8
    assert bm.block_table("third")[:2] == bm.block_table("first")[:2]
    bm.free("second")  # its duplicate, unhashed blocks go back to the free list
    assert bm.stats()["cached"] == 0
    bm.check_invariants()


def test_partially_computed_prompt_publishes_only_its_full_computed_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = toks(0, 13)
    bm.allocate_prompt("a", prompt)
    bm.mark_computed("a", prompt, 6)  # chunked prefill: first chunk of 6 tokens
    assert bm.cached_prefix_len(prompt) == 4
    bm.mark_computed("a", prompt, 13)
    assert bm.cached_prefix_len(prompt) == 12
    bm.check_invariants()


def test_cached_blocks_are_evicted_oldest_first_when_the_free_list_is_empty():
    bm = BlockManager(num_blocks=6, block_size=BS)
    old, new = toks(0, 9), toks(50, 9)  # 3 blocks each: 2 full (cached after free) + 1 partial
    computed(bm, "old", old)
    old_full = bm.block_table("old")[:2]
    bm.free("old")
    computed(bm, "new", new)
    new_full = bm.block_table("new")[:2]
    bm.free("new")
    assert (bm.stats()["cached"], bm.stats()["free"]) == (4, 2)
    # 4 new blocks: the 2 on the free list, then 2 evicted -- both of "old", the older.
    bm.allocate_prompt("big", toks(200, 16))
    bm.check_invariants()
    assert set(old_full) <= set(bm.block_table("big"))
    assert set(new_full).isdisjoint(bm.block_table("big"))
    s = bm.stats()
    assert s["evictions"] == 2 and s["cached"] == 2
    assert bm.cached_prefix_len(old) == 0  # its hashes left the table: it is recomputed
    assert bm.cached_prefix_len(new) == 8
    bm.free("big")
    assert computed(bm, "old again", old) == 0


def test_eviction_takes_the_tail_of_a_chain_before_its_head():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = toks(0, 13)  # 3 full blocks + 1 partial: the whole pool
    computed(bm, "a", prompt)
    bm.free("a")
    bm.allocate_prompt("b", toks(100, 5))  # 2 blocks: 1 free + 1 evicted
    assert bm.stats()["evictions"] == 1
    assert bm.cached_prefix_len(prompt) == 8  # the head survived, the tail went


def test_reused_idle_blocks_are_pinned_before_eviction_makes_room():
    bm = BlockManager(num_blocks=6, block_size=BS)
    computed(bm, "a", toks(0, 9))
    a_full = bm.block_table("a")[:2]
    bm.free("a")  # a's 2 full blocks: the oldest cached
    computed(bm, "o", toks(50, 9))
    bm.free("o")
    bm.allocate_prompt("x", toks(90, 8))  # empties the free list
    assert bm.stats()["free"] == 0
    # b hits a's blocks and needs 1 new block: it must evict o's, never the ones it reuses.
    assert bm.allocate_prompt("b", toks(0, 8) + [7]) == 8
    bm.check_invariants()
    assert bm.block_table("b")[:2] == a_full
    assert bm.stats()["evictions"] == 1 and bm.cached_prefix_len(toks(50, 9)) == 4


def test_blocks_needed_matches_what_allocate_prompt_takes():
    bm = BlockManager(num_blocks=12, block_size=BS)
    computed(bm, "a", toks(0, 9))
    bm.free("a")  # 2 cached blocks with ref 0
    computed(bm, "b", toks(30, 9))  # 2 cached blocks still used by b
    for seq_id, prompt in [("c", toks(0, 10)), ("d", toks(30, 11)), ("e", toks(0, 4))]:
        need, before = bm.blocks_needed(prompt), bm.num_free_blocks()
        bm.allocate_prompt(seq_id, prompt)
        assert before - bm.num_free_blocks() == need
        bm.check_invariants()
    # c reused idle cached blocks (they count, they leave the pool); d shared b's (they don't).
    assert bm.blocks_needed(toks(30, 9), num_tokens=20) == 5 - 2


def test_allocate_past_the_pool_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=BS)
    bm.allocate_prompt("a", toks(0, 5))
    before = bm.snapshot()
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_prompt("b", toks(10, 2))
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots("a", 9)
    assert bm.snapshot() == before and not bm.has_seq("b")
    bm.check_invariants()


def test_append_slots_fills_the_private_last_block_then_takes_a_new_one():
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.allocate_prompt("a", toks(0, 3))
    bm.append_slots("a", 4)
    assert len(bm.block_table("a")) == 1 and bm.blocks[bm.block_table("a")[0]].num_tokens == 4
    bm.append_slots("a", 5)
    table = bm.block_table("a")
    assert len(table) == 2 and bm.blocks[table[1]].num_tokens == 1
    assert bm.slot("a", 4) == table[1] * BS + 0
    bm.check_invariants()


def test_decode_produced_full_blocks_can_be_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = toks(0, 3)
    computed(bm, "a", seq)
    for t in (70, 71, 72, 73, 74):  # decode: one token at a time
        seq.append(t)
        bm.append_slots("a", len(seq))
        bm.mark_computed("a", seq, len(seq))
        bm.check_invariants()
    assert bm.cached_prefix_len(seq + [1]) == 8


def test_prefix_caching_disabled_never_shares_and_frees_to_the_free_list():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = toks(0, 9)
    assert computed(bm, "a", prompt) == 0
    assert computed(bm, "b", prompt) == 0
    assert set(bm.block_table("a")).isdisjoint(bm.block_table("b"))
    bm.free("a")
    bm.free("b")
    assert bm.stats()["free"] == 8 and bm.stats()["cached"] == 0


def test_stats_count_hits_and_pressure():
    bm = BlockManager(num_blocks=10, block_size=BS)
    computed(bm, "a", toks(0, 9))
    computed(bm, "b", toks(0, 9))
    s = bm.stats()
    assert s["prefix_query_tokens"] == 18 and s["prefix_hit_tokens"] == 8
    assert s["prefix_hit_rate"] == pytest.approx(8 / 18)
    assert s["used"] == 4 and s["kv_pressure"] == pytest.approx(0.4)
    snap = {b["id"]: b for b in bm.snapshot()}
    shared = snap[bm.block_table("a")[0]]
    assert shared["owners"] == ["a", "b"] and shared["state"] == "used" and shared["hash"]


def test_check_invariants_catches_a_lost_ref_count():
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.allocate_prompt("a", toks(0, 5))
    bm.blocks[bm.block_table("a")[0]].ref_count += 1
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_free_of_an_unknown_sequence_is_a_no_op():
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.free("nobody")
    bm.check_invariants()
    assert bm.num_free_blocks() == 4


# --- random traces --------------------------------------------------------------------------
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8]]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_traces_keep_invariants_and_reuse_only_computed_matching_kv(data):
    bm = BlockManager(num_blocks=data.draw(st.integers(3, 10)), block_size=BS)
    seqs: dict[str, list[int]] = {}  # live seq -> its tokens
    done: dict[str, int] = {}  # live seq -> tokens whose KV is computed
    # What each physical block really holds, as written by the sequence that computed it.
    content: dict[int, tuple[int, ...]] = {}
    for step in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["alloc", "alloc", "append", "compute", "free"]))
        live = sorted(seqs)
        if op == "alloc":
            prompt = data.draw(st.sampled_from(PREFIXES)) + data.draw(
                st.lists(st.integers(0, 3), min_size=1, max_size=6))
            if bm.blocks_needed(prompt) > bm.num_free_blocks():
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate_prompt(f"s{step}", prompt)
            else:
                expect_cached, before = bm.cached_prefix_len(prompt), bm.num_free_blocks()
                need = bm.blocks_needed(prompt)
                cached = bm.allocate_prompt(f"s{step}", prompt)
                assert cached == expect_cached < len(prompt) and cached % BS == 0
                assert before - bm.num_free_blocks() == need
                table = bm.block_table(f"s{step}")
                for i, block_id in enumerate(table):
                    if i < cached // BS:  # a reused block holds exactly these tokens' KV
                        assert content[block_id] == tuple(prompt[i * BS:(i + 1) * BS])
                    else:  # a fresh block is private and its old content is gone
                        assert bm.blocks[block_id].ref_count == 1
                        content.pop(block_id, None)
                seqs[f"s{step}"], done[f"s{step}"] = prompt, cached
        elif op == "append" and live:
            seq_id = data.draw(st.sampled_from(live))
            if bm.can_append_slots(seq_id, len(seqs[seq_id]) + 1):
                old_len = len(bm.block_table(seq_id))
                seqs[seq_id].append(data.draw(st.integers(0, 3)))
                bm.append_slots(seq_id, len(seqs[seq_id]))
                for block_id in bm.block_table(seq_id)[old_len:]:
                    content.pop(block_id, None)
        elif op == "compute" and live:
            seq_id = data.draw(st.sampled_from(live))
            n = data.draw(st.integers(done[seq_id], len(seqs[seq_id])))
            bm.mark_computed(seq_id, seqs[seq_id], n)
            for i, block_id in enumerate(bm.block_table(seq_id)[: n // BS]):
                content[block_id] = tuple(seqs[seq_id][i * BS:(i + 1) * BS])
            done[seq_id] = n
        elif op == "free" and live:
            seq_id = data.draw(st.sampled_from(live))
            bm.free(seq_id)
            del seqs[seq_id], done[seq_id]
        bm.check_invariants()
        # Ref counts are conserved: every table entry is one reference, nothing else is.
        assert sum(b.ref_count for b in bm.blocks) == sum(
            len(bm.block_table(s)) for s in seqs)
        s = bm.stats()
        assert s["free"] + s["cached"] + s["used"] == bm.num_blocks
    for seq_id in list(seqs):
        bm.free(seq_id)
    bm.check_invariants()
    assert all(b.ref_count == 0 for b in bm.blocks)  # R2: drained -> every block free or cached
    assert bm.stats()["used"] == 0 and bm.num_free_blocks() == bm.num_blocks

"""The paged backend against Hugging Face itself (SPEC B1, B2, K2, R3).

The oracle is an untouched copy of the same tiny random Llama run by HF directly:
a full forward of each sequence alone, no cache, at every step (`allclose` logits),
and `generate(do_sample=False)` of each prompt alone (equal greedy tokens).
`Sched` below does what the scheduler does around a backend, and nothing more.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from minserve.backends.base import model_forward_kwargs
from minserve.backends.kv_storage import KVBlockStorage
from minserve.backends.paged import PAGED_ATTN_IMPL, PagedBackend, PagedForward, paged_attention
from minserve.kv_cache import BlockManager
from minserve.request import Request
from minserve.sampling import SamplingParams

BLOCK = 4  # tokens per block: small, so every prompt spans several blocks and a partial one
ATOL = 1e-4


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,  # GQA: 2 query heads per KV head
                      max_position_embeddings=512)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(model the backend hooks into, untouched copy that stays plain HF: the oracle)."""
    model = tiny_llama()
    return model, copy.deepcopy(model)


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


def test_a_rows_logits_are_the_same_alone_or_in_a_mixed_forward(models):
    """prefill_chunk, prefill_together and decode_step_batched are forward_mixed's special
    cases: a row's logits do not depend on what its forward carries besides it (a plain
    (B, T) batch or the flat mixed sequence), and only a prompt's final piece gives
    logits, except through prefill_chunk (the contract: always (V,))."""
    model, ref = models
    s = make(model)
    a = s.admit("a", prompt_of(9, seed=3))
    greedy(a, s.prefill(a, chunk=4))
    b, c, d = (s.admit(rid, prompt_of(n, seed=n)) for rid, n in (("b", 11), ("c", 6), ("d", 9)))
    assert_close(s.backend.prefill_chunk(b, 0, 5), hf_logits(ref, b.prompt_token_ids[:5]))
    together = s.backend.prefill_together([(d, 0, 6), (c, 0, 6)])  # one group: (2, 6)
    assert together[0] is None  # d's piece was not its prompt's last
    assert_close(together[1], hf_logits(ref, c.prompt_token_ids))
    s.bm.append_slots("a", a.num_tokens)
    dec, pieces = s.backend.forward_mixed([a], [a.output_token_ids[-1]], [(b, 5, 11), (d, 6, 8)])
    assert_close(dec[0], hf_logits(ref, a.prompt_token_ids + a.output_token_ids))
    assert_close(pieces[0], hf_logits(ref, b.prompt_token_ids))
    assert pieces[1] is None
    assert s.backend.row_lengths() == {"a": 10, "b": 11, "c": 6, "d": 8}
    s.check()


@torch.inference_mode()
def hf_logits(ref: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """The oracle: last-position logits of a plain full forward of this sequence alone, (V,)."""
    return ref(torch.tensor([tokens])).logits[0, -1].float()


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, atol=ATOL), f"max diff {(got - want).abs().max():.2e}"


class Sched:
    """The scheduler's side of the contract: allocate, grow, publish and free blocks."""

    def __init__(self, backend: PagedBackend, bm: BlockManager):
        self.backend, self.bm = backend, bm
        self.chunks: dict[str, list[tuple[int, int]]] = {}  # request_id -> prefill ranges run

    def admit(self, rid: str, prompt: list[int]) -> Request:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=64), arrival_seq=len(self.chunks))
        req.num_cached_tokens = self.bm.allocate_prompt(rid, req.prompt_token_ids)
        req.num_computed_prompt_tokens = req.num_cached_tokens
        self.backend.begin_prefill(req)
        self.chunks[rid] = []
        self.check()
        return req

    def prefill(self, req: Request, chunk: int | None = None) -> torch.Tensor:
        """All remaining chunks, then publish the prompt's blocks and promote; first logits."""
        start = req.num_computed_prompt_tokens
        while start < req.prompt_len:
            end = req.prompt_len if chunk is None else min(start + chunk, req.prompt_len)
            logits = self.backend.prefill_chunk(req, start, end)
            self.chunks[req.request_id].append((start, end))
            req.num_computed_prompt_tokens = start = end
            self.check()
        self.bm.mark_computed(req.request_id, req.prompt_token_ids, req.prompt_len)
        self.backend.promote(req)
        self.check()
        return logits

    def decode(self, reqs: list[Request]) -> torch.Tensor:
        """Feed each row's last sampled token; (B, V) in `reqs` order."""
        for r in reqs:
            self.bm.append_slots(r.request_id, r.num_tokens)
        logits = self.backend.decode_step_batched(reqs, [r.output_token_ids[-1] for r in reqs])
        self.check()
        return logits

    def evict(self, req: Request) -> None:
        self.backend.remove_row(req)
        self.bm.free(req.request_id)
        self.check()

    def check(self) -> None:
        self.backend.check_invariants()
        self.bm.check_invariants()


def make(model, num_blocks: int = 64, caching: bool = True) -> Sched:
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    return Sched(PagedBackend(model, bm), bm)


def greedy(req: Request, logits: torch.Tensor) -> None:
    req.output_token_ids.append(int(logits.argmax()))


# --- prefill -------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 1, 3, 7])
def test_prefill_logits_match_hf_whatever_the_chunk_size(models, chunk):
    model, ref = models
    s = make(model)
    req = s.admit("a", prompt_of(17, seed=1))  # 17: not a multiple of 3, 7 or the block size
    logits = s.prefill(req, chunk)
    assert_close(logits, hf_logits(ref, req.prompt_token_ids))
    assert len(s.chunks["a"]) == (1 if chunk is None else -(-17 // chunk))
    for _ in range(3):  # the KV every chunk wrote is read back by later decode steps
        greedy(req, logits)
        logits = s.decode([req])[0]
        assert_close(logits, hf_logits(ref, req.prompt_token_ids + req.output_token_ids))


# --- batched decode ---------------------------------------------------------------------------
def test_batched_decode_equals_each_row_alone_in_any_order(models):
    model, ref = models
    s = make(model)
    reqs = [s.admit(f"r{i}", prompt_of(n, seed=10 + i)) for i, n in enumerate([3, 8, 13, 21])]
    for r in reqs:
        greedy(r, s.prefill(r, chunk=5))
    rng = random.Random(0)
    for _ in range(6):
        order = reqs[:]
        rng.shuffle(order)  # any subset, any order (base.py contract)
        logits = s.decode(order)
        for r, row in zip(order, logits):
            assert_close(row, hf_logits(ref, r.prompt_token_ids + r.output_token_ids))
            greedy(r, row)
    assert s.backend.kv_length == 21 + 6  # the longest row; no row is padded to it in storage
    assert s.backend.row_lengths() == {r.request_id: r.num_tokens - 1 for r in reqs}


@torch.inference_mode()
def test_greedy_tokens_equal_hf_generate_of_each_prompt_alone(models):
    model, ref = models
    s = make(model)
    prompts = [prompt_of(n, seed=20 + n) for n in (5, 11, 2)]
    reqs = [s.admit(f"g{i}", p) for i, p in enumerate(prompts)]
    for r in reqs:
        greedy(r, s.prefill(r, chunk=4))
    for _ in range(7):
        for r, row in zip(reqs, s.decode(reqs)):
            greedy(r, row)
    for r, p in zip(reqs, prompts):
        out = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)
        want = out[0, len(p):].tolist()  # generate may stop early at EOS: compare that prefix
        assert want and r.output_token_ids[:len(want)] == want
        for t in range(len(want)):  # the comparison means something: no near-ties
            top2 = hf_logits(ref, p + want[:t]).topk(2).values
            assert top2[0] - top2[1] > 10 * ATOL


# --- R3: the longest row leaves mid-flight ------------------------------------------------------
def test_evicting_the_longest_row_midflight_keeps_the_others_exact(models):
    model, ref = models
    # 12 blocks: just enough that the newcomer must take the evicted row's blocks, so any
    # stale KV left behind in them would show up in its logits.
    s = make(model, num_blocks=12, caching=False)
    a, b, c = (s.admit(rid, prompt_of(n, seed=30 + n)) for rid, n in (("a", 20), ("b", 6), ("c", 10)))
    for r in (a, b, c):
        greedy(r, s.prefill(r, chunk=6))
    for _ in range(2):
        for r, row in zip((b, a, c), s.decode([b, a, c])):
            greedy(r, row)
    assert s.backend.kv_length == 22
    a_blocks = set(s.bm.block_table("a"))
    s.evict(a)
    assert s.backend.kv_length == 12  # the metric drops (R3): nothing may be sized from it
    d = s.admit("d", prompt_of(9, seed=39))
    assert set(s.bm.block_table("d")) & a_blocks  # the newcomer rewrites a's old blocks
    greedy(d, s.prefill(d, chunk=4))
    assert s.backend.decode_step_batched([], []).shape == (0, 128)  # an empty batch is fine
    for _ in range(3):
        order = [d, c, b]
        for r, row in zip(order, s.decode(order)):
            assert_close(row, hf_logits(ref, r.prompt_token_ids + r.output_token_ids))
            greedy(r, row)
    assert s.backend.num_rows == 3


# --- K2: prefix blocks are shared, their KV reused ---------------------------------------------
def test_shared_prefix_blocks_are_reused_not_recomputed(models):
    model, ref = models
    s = make(model)
    prefix = prompt_of(2 * BLOCK, seed=40)
    a = s.admit("a", prefix + prompt_of(3, seed=41))
    greedy(a, s.prefill(a))  # publishes a's 2 full blocks (mark_computed)
    b = s.admit("b", prefix + prompt_of(5, seed=42))
    assert b.num_cached_tokens == 2 * BLOCK
    assert s.bm.block_table("b")[:2] == s.bm.block_table("a")[:2]  # the same physical blocks
    greedy(b, s.prefill(b, chunk=3))
    assert s.chunks["b"][0][0] == 2 * BLOCK  # the shared tokens never went through the model
    for _ in range(2):  # both rows read the shared blocks in the same batch
        for r, row in zip((a, b), s.decode([a, b])):
            assert_close(row, hf_logits(ref, r.prompt_token_ids + r.output_token_ids))
            greedy(r, row)
    # The check can fail: wipe the shared blocks and a third hit on them goes wrong.
    shared = s.bm.block_table("a")[:2]
    for layer in range(s.backend.storage.num_layers):
        s.backend.storage.key_cache[layer][shared] = 0.0
    c = s.admit("c", prefix + prompt_of(4, seed=43))
    assert c.num_cached_tokens == 2 * BLOCK
    logits = s.prefill(c)
    assert not torch.allclose(logits, hf_logits(ref, c.prompt_token_ids), atol=ATOL)


@torch.inference_mode()
def test_decode_reads_a_shared_prefix_once_and_attends_exactly_as_row_by_row():
    """Rows whose tables start with the same blocks (a cached system prompt) meet those
    keys in one matmul for all rows; the result is each row's attention alone."""
    H, H_kv, D = 4, 2, 8
    st = KVBlockStorage(num_blocks=32, block_size=BLOCK, num_layers=1, num_kv_heads=H_kv, head_dim=D)
    torch.manual_seed(0)
    st.flat(0)[0].normal_(), st.flat(0)[1].normal_()
    prefix = [7, 3, 12]  # 3 full blocks every row starts with
    tables = [prefix + [20, 21], prefix + [5], prefix + [9, 10, 11]]
    starts = [17, 13, 23]  # each row's new token; all lie past the prefix (3 * 4 = 12 tokens)
    rows = [(t, s, 1) for t, s in zip(tables, starts)]
    ctx = PagedForward.build_rows(st, rows)
    assert ctx.groups[0].shared_blocks.tolist() == prefix
    q, k, v = torch.randn(3, H, 1, D), torch.randn(3, H_kv, 1, D), torch.randn(3, H_kv, 1, D)
    together = paged_attention(ctx, 0, q, k, v, D ** -0.5)  # (B, 1, H, D)
    for b, row in enumerate(rows):  # alone: B = 1, nothing shared, every key read per row
        alone_ctx = PagedForward.build_rows(st, [row])
        assert alone_ctx.groups[0].shared_blocks is None
        alone = paged_attention(alone_ctx, 0, q[b:b + 1], k[b:b + 1], v[b:b + 1], D ** -0.5)
        assert torch.allclose(together[b], alone[0], atol=1e-6)
    # A row whose new token lies inside the third block sees only part of it: two shared.
    short = PagedForward.build_rows(st, rows + [(prefix + [6], 10, 1)])
    assert short.groups[0].shared_blocks.tolist() == prefix[:2]
    # Tables that differ in their first block share nothing.
    assert PagedForward.build_rows(st, rows + [([1, 3, 12, 4], 13, 1)]).groups[0].shared_blocks is None


# --- KVBlockStorage, as the padded backend uses it -----------------------------------------------
def test_storage_store_then_load_returns_the_same_tensors():
    L, H, D = 3, 2, 8
    st = KVBlockStorage(num_blocks=10, block_size=BLOCK, num_layers=L, num_kv_heads=H, head_dim=D)
    assert st.bytes_per_token() == 2 * L * H * D * 4
    table = [5, 2, 9]  # scattered blocks: order lives in the table, not in memory
    kv = [(torch.randn(11, H, D), torch.randn(11, H, D)) for _ in range(L)]  # (T, H, D)
    with torch.inference_mode():  # the padded backend calls it from inference mode
        st.store_tokens(table, 0, [(k[:6], v[:6]) for k, v in kv])
        # the rest in HF's DynamicCache layout (1, H, T, D), starting mid-block
        st.store_tokens(table, 6, [(k[6:].transpose(0, 1)[None], v[6:].transpose(0, 1)[None])
                                   for k, v in kv])
        loaded = st.load_tokens(table, 11)
    for (k, v), (lk, lv) in zip(kv, loaded):
        assert lk.shape == (1, H, 11, D)
        assert torch.equal(lk[0].transpose(0, 1), k) and torch.equal(lv[0].transpose(0, 1), v)
    assert torch.equal(st.key_cache[1][2, 1], kv[1][0][5])  # token 5 sits in block 2, slot 1
    with pytest.raises(ValueError):
        st.slot_mapping(table, 0, 13)  # 3 blocks hold 12 tokens


@torch.inference_mode()
def test_dynamic_cache_parked_in_storage_and_reloaded_gives_the_same_next_logits(models):
    _, ref = models
    arg = model_forward_kwargs(ref)
    prompt, nxt = prompt_of(10, seed=50), 7
    out = ref(torch.tensor([prompt]), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    want = ref(torch.tensor([[nxt]]), use_cache=True, **{arg: copy.deepcopy(cache)}).logits[0, -1]

    st = KVBlockStorage.for_model(ref, num_blocks=8, block_size=BLOCK)
    table = [6, 1, 3]
    st.store_tokens(table, 0, [(layer.keys, layer.values) for layer in cache.layers])
    reloaded = DynamicCache(config=ref.config)
    for layer, (k, v) in enumerate(st.load_tokens(table, len(prompt))):
        reloaded.update(k, v, layer)  # k, v: (1, H_kv, T, D)
    got = ref(torch.tensor([[nxt]]), use_cache=True, **{arg: reloaded}).logits[0, -1]
    assert torch.equal(got, want)
    assert_close(got, hf_logits(ref, prompt + [nxt]))


# --- the HF model object, shared with other users -------------------------------------------------
@torch.inference_mode()
def test_model_outside_the_backend_still_computes_what_sdpa_computes(models):
    model, ref = models
    s = make(model)
    assert model.config._attn_implementation == PAGED_ATTN_IMPL
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5]])  # left padding: needs HF's mask
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert_close(model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
    p = prompt_of(6, seed=60)
    assert torch.equal(model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False),
                       ref.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False))
    s.backend.close()
    assert model.config._attn_implementation == ref.config._attn_implementation


def test_backend_reinstalls_itself_if_the_model_was_switched_away(models):
    model, ref = models
    s = make(model)
    model.set_attn_implementation("eager")  # e.g. a notebook cell elsewhere
    req = s.admit("a", prompt_of(9, seed=70))
    assert_close(s.prefill(req, chunk=4), hf_logits(ref, req.prompt_token_ids))
    assert model.config._attn_implementation == PAGED_ATTN_IMPL


def test_two_paged_backends_on_one_model_do_not_interfere(models):
    model, ref = models
    s1, s2 = make(model), make(model)  # two engines in one notebook, one model object
    r1, r2 = s1.admit("x", prompt_of(7, seed=80)), s2.admit("x", prompt_of(12, seed=81))
    greedy(r1, s1.prefill(r1, chunk=3))
    greedy(r2, s2.prefill(r2))
    for _ in range(3):
        for s, r in ((s1, r1), (s2, r2)):
            row = s.decode([r])[0]
            assert_close(row, hf_logits(ref, r.prompt_token_ids + r.output_token_ids))
            greedy(r, row)


# --- loud failures ----------------------------------------------------------------------------
def test_decode_past_the_block_table_fails_loudly_without_append_slots(models):
    model, _ = models
    s = make(model)
    req = s.admit("a", prompt_of(8, seed=90))  # exactly 2 full blocks: token 8 needs a third
    greedy(req, s.prefill(req))
    with pytest.raises(ValueError, match="append_slots"):
        s.backend.decode_step_batched([req], [req.output_token_ids[-1]])
    with pytest.raises(ValueError):  # a chunk that does not start where the row stands
        s.backend.prefill_chunk(req, 3, 5)


def test_check_invariants_flags_a_row_longer_than_its_block_table(models):
    model, _ = models
    s = make(model)
    req = s.admit("a", prompt_of(6, seed=91))
    s.prefill(req)
    s.backend.rows["a"] = 9  # 2 blocks hold 8 tokens
    with pytest.raises(AssertionError, match="9 tokens in 2 blocks"):
        s.backend.check_invariants()

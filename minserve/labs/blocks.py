"""Lab 5: the block manager (SPEC K1-K3). The student subclasses `BlockManager` and writes
its three decisions: which blocks of a prompt are already cached (the chained-hash walk),
which block to take for new content (free first, else evict the least recently used
cached one), and what `free` does to reference counts. The lab manager then replaces the
engine's in the paged backend, whose KV *is* the block pool."""

from __future__ import annotations

from ..engine import Engine
from ..kv_cache import BlockManager, NoFreeBlocksError
from ..sampling import SamplingParams
from .allowlist import Cell
from .common import drain, fail, secret_rng, stock_tokens, student, tiny_engine
from .guard import guarded_check

WHERE = ("docs/kv_cache.md (K1-K3: chained hashes, reference counts, LRU eviction) and notebook "
         "03_kv_blocks_and_prefix_caching.ipynb")
GRADED = ("_cached_blocks", "_take_block", "free")


def reference():
    """What a submission may not lean on: BlockManager's own versions of the three graded
    methods (the rest of BlockManager is the skeleton it inherits, by design)."""
    return [(BlockManager, GRADED, "BlockManager", False)]


def check_defines(cls) -> None:
    """The three graded methods are the student's: defined in their class, not inherited."""
    inherited = [m for m in GRADED if getattr(cls, m, None) is getattr(BlockManager, m)]
    if inherited:
        fail(f"BlockManagerLab does not define {', '.join(inherited)}: it inherits minserve's "
             "own, which earns no points; write them in your class", WHERE)


def invariants(bm, after: str) -> None:
    """The pool's invariants (BlockManager.check_invariants) as a check with a message."""
    try:
        bm.check_invariants()
    except AssertionError as e:
        fail(f"after {after} the pool's bookkeeping broke: {e or 'an invariant'} (every block "
             "is in exactly one of free / cached / used; ref_count = the tables holding it; "
             "a hashed block is in the hash table, a free one has no hash)",
             f"BlockManagerLab.free / _take_block; {WHERE}")


def use_block_manager(engine: Engine, cls) -> Engine:
    """Replace a fresh engine's block manager with `cls(num_blocks, block_size, prefix)`."""
    if engine.scheduler.has_work():
        raise ValueError("plug a block manager in before submitting anything")
    old = engine.block_manager
    bm = student(cls, old.num_blocks, old.block_size, old.enable_prefix_caching,
                 name="BlockManagerLab()", where=WHERE)
    engine.block_manager = engine.scheduler.block_manager = bm
    engine.scheduler.backend.block_manager = bm
    return engine


def _bm(cls, num_blocks=10, block_size=4):
    check_defines(cls)
    return student(cls, num_blocks, block_size, True, name="BlockManagerLab()", where=WHERE)


def _call(bm, method, *args):
    return student(getattr(bm, method), *args, name=f"BlockManagerLab.{method}", where=WHERE)


@guarded_check(20, reference, WHERE)
def check_prefix_reuse(cls) -> None:
    """Computed full blocks are shared by an equal prefix (ref counts), never after a
    different prefix (the chain), and the block with the last token is always computed (K2)."""
    bm = _bm(cls)
    sys_prompt = list(range(1, 9))  # two full blocks of 4
    a = sys_prompt + [20, 21, 22]
    if _call(bm, "allocate_prompt", "a", a) != 0:
        fail("the very first prompt found cached tokens in an empty pool",
             f"BlockManagerLab._cached_blocks; {WHERE}")
    fresh = [bm.blocks[b].ref_count for b in bm.block_table("a")]
    if fresh != [1] * len(fresh):
        fail(f"a's first prompt took new blocks {bm.block_table('a')} with ref counts {fresh}, "
             "expected 1 each: a block _take_block hands out is held by one table (ref_count "
             "1), whether it came from the free list or was evicted",
             f"BlockManagerLab._take_block; {WHERE}")
    bm.mark_computed("a", a, len(a))
    hit = _call(bm, "allocate_prompt", "b", sys_prompt + [30, 31])
    if hit != 8:
        fail(f"a prompt starting with the same 8 tokens (2 computed full blocks) reused {hit} "
             "cached tokens, expected 8: walk the prompt's full blocks chaining each hash from "
             "its parent's (hash_block(parent_hash, tokens)), as mark_computed stored them",
             f"BlockManagerLab._cached_blocks; {WHERE}")
    shared = bm.block_table("a")[:2]
    if bm.block_table("b")[:2] != shared or [bm.blocks[i].ref_count for i in shared] != [2, 2]:
        fail(f"b should share a's first two blocks {shared} with ref_count 2 each; b's table is "
             f"{bm.block_table('b')}, ref counts {[bm.blocks[i].ref_count for i in shared]}",
             f"BlockManagerLab._cached_blocks / allocate_prompt; {WHERE}")
    other = [99, 98, 97, 96] + sys_prompt[4:8] + [5]
    if _call(bm, "allocate_prompt", "c", other) != 0:
        fail("a prompt whose SECOND block equals a cached block, after a different first block, "
             "reused it: the hash must chain the parent's hash (the same tokens after a "
             "different prefix have different KV)", f"BlockManagerLab._cached_blocks; {WHERE}")
    if _call(bm, "cached_prefix_len", sys_prompt) != 4:
        fail(f"a prompt that IS the two cached blocks reuses {bm.cached_prefix_len(sys_prompt)} "
             "tokens, expected 4: the block holding the last token is always computed, so there "
             "are logits to sample from (K2)", f"BlockManagerLab._cached_blocks; {WHERE}")


@guarded_check(20, reference, WHERE)
def check_free_and_lru(cls) -> None:
    """free: ref_count - 1; a hashed block at 0 becomes cached (evictable, LRU order), an
    unhashed one free. _take_block: the free list first, then the least recently used cached
    block, back to front within a table (a chain's tail goes before its head)."""
    bm = _bm(cls, num_blocks=4, block_size=2)
    _call(bm, "allocate_prompt", "a", [1, 2, 3, 4, 5])  # 3 blocks: 2 full + 1 partial
    bm.mark_computed("a", [1, 2, 3, 4, 5], 5)
    table = bm.block_table("a")
    _call(bm, "free", "a")
    invariants(bm, "free('a')")
    states = [(bm.blocks[b].ref_count, bm.blocks[b].block_hash is not None) for b in table]
    if states != [(0, True), (0, True), (0, False)] or bm.num_free_blocks() != 4:
        fail(f"after freeing a (2 computed full blocks + 1 partial) its blocks are "
             f"(ref_count, hashed) = {states} with {bm.num_free_blocks()} free; expected the full "
             "blocks cached (ref 0, hash kept) and the partial one free",
             f"BlockManagerLab.free; {WHERE}")
    _call(bm, "allocate_prompt", "b", [7, 8, 9, 10, 11, 12])  # 3 new blocks: 2 free, then evict 1
    invariants(bm, "an allocation that evicts")
    if bm.evictions != 1 or bm.blocks[table[1]].block_hash is not None \
            or bm.blocks[table[0]].block_hash is None:
        fail("with the free list empty, a new block must evict the least recently used cached "
             f"block, the chain's tail first (block {table[1]}, not its head {table[0]}); "
             f"evictions={bm.evictions}", f"BlockManagerLab._take_block / free; {WHERE}")
    try:
        bm.allocate_prompt("c", list(range(50, 60)))
    except NoFreeBlocksError:
        pass
    except Exception as e:  # noqa: BLE001 - named below
        fail(f"allocating more blocks than the pool has raised {type(e).__name__}: {e}; expected "
             "NoFreeBlocksError when nothing is free or cached", f"BlockManagerLab._take_block; {WHERE}")
    else:
        fail("allocating more blocks than the pool has did not raise NoFreeBlocksError",
             f"BlockManagerLab._take_block; {WHERE}")
    invariants(bm, "a failed allocation (NoFreeBlocksError)")
    if bm.blocks[table[0]].block_hash is None:
        fail(f"a's first block {table[0]} lost its hash although only its tail was evicted: "
             "evict one block at a time, the least recently used, and keep the others' hashes",
             f"BlockManagerLab._take_block; {WHERE}")


SYSTEM = list(range(40, 72))  # a 32-token system prompt: 2 blocks of 16


def hidden_workload(hidden, evicting: bool = False) -> dict:
    """check_in_engine's arguments drawn from the instructor's secret: questions after the
    shared system prompt; `evicting`: four to six questions of 17-19 tokens (a full block of
    their own each) in a pool of 7 blocks, where finished requests leave cached blocks and
    later ones must evict some (a pool of 8 would evict none)."""
    rng = secret_rng(hidden.seed, f"lab5/engine/{evicting}")
    n = rng.randint(4, 6)
    if evicting:
        questions = tuple(tuple(range(100 + 20 * k, 100 + 20 * k + rng.randint(17, 19)))
                          for k in range(n))
        return {"questions": questions, "max_tokens": rng.randint(2, 4), "num_blocks": 7,
                "min_evictions": 1}
    questions = tuple(tuple(range(1 + 10 * k, 1 + 10 * k + rng.randint(1, 6))) for k in range(n))
    return {"questions": questions, "max_tokens": rng.randint(2, 5)}


@guarded_check(60, reference, WHERE)
def check_in_engine(cls, questions=((1, 2, 3), (4, 5), (6, 7, 8, 9), (10,)), max_tokens=5,
                    num_blocks: int = 24, min_evictions: int = 0) -> dict:
    """Requests sharing a system prompt, on the paged backend with the lab's block manager:
    the later ones reuse its blocks, every token equals a stock engine's, and the pool's
    invariants hold after every tick. With `min_evictions` the pool is small enough that
    cached blocks must be evicted, and the check asserts they were. Returns the block stats."""
    check_defines(cls)
    engine = use_block_manager(tiny_engine(backend="paged", max_batch_size=2,
                                           num_blocks=num_blocks), cls)
    plan = [(SYSTEM + list(q), max_tokens) for q in questions]
    handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in plan]
    drain(engine, WHERE)
    stats = engine.block_manager.stats()
    if stats["evictions"] < min_evictions:
        fail(f"a pool of {num_blocks} blocks under this workload must evict cached blocks, but "
             f"evictions={stats['evictions']}: _take_block should take a free block first and "
             "evict the least recently used cached one only when none is free (and count it)",
             f"BlockManagerLab._take_block; {WHERE}")
    if stats["prefix_hit_tokens"] < 32 * (len(plan) - 2) and not min_evictions:
        fail(f"{len(plan)} requests share a 32-token system prompt, batch of 2: at least the "
             f"later {len(plan) - 2} should reuse its 2 blocks, but only "
             f"{stats['prefix_hit_tokens']} tokens were hits", f"BlockManagerLab; {WHERE}")
    ref = stock_tokens(plan, backend="paged", max_batch_size=2, num_blocks=num_blocks,
                           enable_prefix_caching=False)
    for h, want in zip(handles, ref):
        if h.output.token_ids != want:
            fail(f"{h.request_id} generated {h.output.token_ids}, without prefix caching it "
                 f"gives {want}: a reused block held the wrong KV", f"BlockManagerLab; {WHERE}")
    return stats


# ------------------------------------------------------------------ hidden: against the engine
CONTRACT = {
    "init": "BlockManagerLab(num_blocks, block_size, True) starts with every block free.",
    "allocate": "allocate_prompt(seq, tokens) shares the longest cached prefix of whole, "
                "computed blocks (the chained-hash walk, stopping at the first miss, never "
                "the block holding the last token: K2), takes new blocks for the rest (the "
                "free list's first id, else the least recently used cached block), and "
                "returns the cached token count; NoFreeBlocksError, changing nothing, when "
                "the pool is too small.",
    "computed": "mark_computed(seq, tokens, n) publishes the full computed blocks (K3).",
    "grow": "append_slots(seq, n) grows the table with new blocks (free first, else the least "
            "recently used cached one); NoFreeBlocksError when none is left.",
    "free": "free(seq) drops seq: every per-sequence entry (_tables, _seq_len, _seq_hashes, "
            "_seq_salt) goes; ref_count - 1 per block, back to front; a block at 0 becomes "
            "cached (hashed, newest in the LRU order) or free (appended to the free list). "
            "An unknown id is ignored.",
    "query": "cached_prefix_len / blocks_needed / _cached_blocks only read: the longest "
             "cached prefix, by the chained-hash walk stopping at the first miss (whole "
             "blocks, at most (len - 1) // block_size of them).",
    "take": "_take_block() with nothing free and nothing cached raises NoFreeBlocksError.",
    "state": "every block is in exactly one of free / cached / used, with the ref counts, "
             "hashes and token counts the engine's BlockManager gives it; the free list is "
             "a queue (taken from the left, given back on the right), the cached ones are "
             "in LRU order.",
}


def _where5(method: str) -> str:
    return f"BlockManagerLab.{method}; {WHERE}"


def _state(bm) -> dict:
    """What a block manager's state is, as plain data (the submission's is read the same)."""
    blocks = [(b.ref_count, b.block_hash,
               b.num_tokens if b.ref_count or b.block_hash is not None else "-")
              for b in bm.blocks]
    per_seq = {name: sorted(getattr(bm, name)) for name in
               ("_tables", "_seq_len", "_seq_hashes", "_seq_salt")}
    return {"blocks (ref_count, hash, num_tokens)": blocks,
            "block tables": {s: list(t) for s, t in sorted(bm._tables.items())},
            "per-sequence entries": per_seq,
            "free list": list(bm._free), "cached, LRU first": list(bm._evictable),
            "hash table": sorted(bm._hash_to_block.items()),
            "counters (evictions, hit tokens, query tokens)":
                (bm.evictions, bm.prefix_hit_tokens, bm.prefix_query_tokens)}


def _machine():
    from .differential import Differential, choose

    class Machine(Differential):
        submission: type
        OPS = ((4, "allocate"), (3, "computed"), (2, "grow"), (4, "free"), (3, "query"),
               (1, "take"), (2, "share"), (2, "side_by_side"))

        def setup(self, arg) -> None:
            self.num_blocks, arg = choose((3, 4, 6, 8, 8, 10), arg)
            self.size, arg = choose((1, 2, 2, 3, 4), arg)
            # block-sized chunks that prompts are made of, so that prefixes repeat
            self.chunks = [[100 + 10 * c + t for t in range(self.size)] for c in range(3)]
            self.tokens: dict[str, list[int]] = {}
            self.prompts: list[list[int]] = []  # every prompt allocated: queries reuse them
            self.fresh = 500  # tokens no chunk uses: prompts that share nothing
            self.n = 0
            args = (self.num_blocks, self.size, True)
            self.ref = self.sub = None
            self.ref, self.sub = self.call(
                f"bm = BlockManagerLab(num_blocks={self.num_blocks}, block_size={self.size}, "
                "enable_prefix_caching=True)", lambda: BlockManager(*args),
                lambda: self.submission(*args), sentence=CONTRACT["init"],
                where=_where5("__init__"))

        def observe(self):
            if self.sub is None:
                return []
            ref, sub = _state(self.ref), self.read(lambda: _state(self.sub))
            if isinstance(sub, str):
                return [("its state", "readable", sub, CONTRACT["state"], WHERE)]
            seen = [(name, ref[name], sub[name], CONTRACT["state"], WHERE) for name in ref]
            return seen + [("check_invariants()", "passes", self.read(
                lambda: self.sub.check_invariants() or "passes"), CONTRACT["state"], WHERE)]

        def _prompt(self, arg) -> tuple[list[int], int]:
            """A prompt of whole chunks (0-4 of them, from 3: prefixes repeat) and a tail;
            or exactly as many blocks as are free now (an exactly full pool); or one block
            more than the free list holds, of tokens no chunk uses (it evicts the least
            recently used cached block, and only it)."""
            kind, arg = choose(("chunks", "chunks", "chunks", "full", "evict one"), arg)
            k, arg = choose((0, 1, 2, 2, 3, 4), arg)
            tail, arg = choose((0, 1, self.size - 1), arg)
            if kind == "full":
                k, tail = self.ref.num_free_blocks(), 0
            if kind == "evict one" and self.ref._evictable:
                n = (len(self.ref._free) + 1) * self.size
                self.fresh += n
                return list(range(self.fresh - n, self.fresh)), arg
            tokens = []
            for _ in range(k):
                c, arg = choose(self.chunks, arg)
                tokens += c
            tokens += [7 + t for t in range(tail)]
            return tokens or [7], arg

        def _seq(self, arg, new: bool) -> tuple[str, int]:
            known = sorted(self.tokens)
            if new or not known:
                self.n += 1
                return f"s{self.n}", arg
            return choose(known, arg)

        def _both(self, text, method, *args, sentence, where, canon=None):
            return self.call(text, lambda: getattr(self.ref, method)(*args),
                             lambda: getattr(self.sub, method)(*args),
                             ref_canon=canon or (lambda v: v), sentence=sentence,
                             where=where)

        def op_allocate(self, arg):
            again, arg = choose((False, False, False, False, True), arg)
            seq, arg = self._seq(arg, new=not again)
            tokens, _ = self._prompt(arg)
            ref, _ = self._both(f"bm.allocate_prompt({seq!r}, {tokens})", "allocate_prompt",
                                seq, tokens, sentence=CONTRACT["allocate"],
                                where=_where5("_cached_blocks / _take_block"))
            if self.ref.has_seq(seq) and seq not in self.tokens:
                self.tokens[seq] = tokens
                self.prompts.append(tokens)

        def op_computed(self, arg):
            if not self.tokens:
                return self.op_allocate(arg)
            seq, arg = self._seq(arg, new=False)
            tokens = self.tokens[seq]
            n, _ = choose((len(tokens), len(tokens), len(tokens) // 2), arg)
            self._both(f"bm.mark_computed({seq!r}, {tokens}, {n})", "mark_computed", seq, tokens,
                       n, sentence=CONTRACT["computed"], where=_where5("_take_block / free"))

        def op_grow(self, arg):
            if not self.tokens:
                return self.op_allocate(arg)
            seq, arg = self._seq(arg, new=False)
            extra, _ = choose((1, 1, self.size, 2 * self.size + 1), arg)
            n = self.ref._seq_len[seq] + extra
            self._both(f"bm.append_slots({seq!r}, {n})", "append_slots", seq, n,
                       sentence=CONTRACT["grow"], where=_where5("_take_block"))

        def op_free(self, arg):
            unknown, arg = choose((False, False, False, True), arg)
            if unknown or not self.tokens:
                seq = choose(("nobody", f"s{self.n + 1}", "s0"), arg)[0]
            else:
                seq, _ = self._seq(arg, new=False)
                del self.tokens[seq]
            self._both(f"bm.free({seq!r})" + ("  # an id it does not hold" if unknown else ""),
                       "free", seq, sentence=CONTRACT["free"], where=_where5("free"))

        def op_query(self, arg):
            method, arg = choose(("cached_prefix_len", "blocks_needed", "_cached_blocks"), arg)
            again, arg = choose((True, False), arg)
            tokens, _ = choose(self.prompts, arg) if again and self.prompts else self._prompt(arg)
            self._both(f"bm.{method}({tokens})", method, tokens, sentence=CONTRACT["query"],
                       where=_where5("_cached_blocks"))

        def op_side_by_side(self, arg):
            """Two prompts with the same new prefix admitted in the same tick, computed one
            after the other (the second one's copy of the prefix stays private, its next
            block is registered: K3), then freed shorter first. Later evictions can then
            leave a chain with a gap: a block cached after one that is not."""
            k, arg = choose((1, 2), arg)
            extra, arg = choose(self.chunks, arg)
            self.fresh += k * self.size
            prefix = list(range(self.fresh - k * self.size, self.fresh))
            short, long = prefix + [7], prefix + extra + [8]
            ids = []
            for tokens in (short, long):
                self.n += 1
                seq = f"s{self.n}"
                self._both(f"bm.allocate_prompt({seq!r}, {tokens})", "allocate_prompt", seq,
                           tokens, sentence=CONTRACT["allocate"],
                           where=_where5("_cached_blocks / _take_block"))
                if not self.ref.has_seq(seq):
                    return
                self.tokens[seq] = tokens
                self.prompts.append(tokens)
                ids.append(seq)
            for seq in ids:
                tokens = self.tokens[seq]
                self._both(f"bm.mark_computed({seq!r}, {tokens}, {len(tokens)})", "mark_computed",
                           seq, tokens, len(tokens), sentence=CONTRACT["computed"],
                           where=_where5("_take_block / free"))
            last_prefix = self.ref.block_table(ids[0])[k - 1]  # the short one's: registered
            for seq in ids:
                del self.tokens[seq]
                self._both(f"bm.free({seq!r})", "free", seq, sentence=CONTRACT["free"],
                           where=_where5("free"))
            # evict every cached block up to that one (the LRU order): the long prompt's next
            # block, registered by the long one, stays cached after the gap
            order = list(self.ref._evictable)
            if last_prefix not in order:
                return
            blocks = len(self.ref._free) + order.index(last_prefix) + 1
            if blocks > self.ref.num_free_blocks():
                return
            self.fresh += blocks * self.size
            self.n += 1
            seq = f"s{self.n}"
            tokens = list(range(self.fresh - blocks * self.size, self.fresh))
            self._both(f"bm.allocate_prompt({seq!r}, {tokens})  # evicts the oldest cached",
                       "allocate_prompt", seq, tokens, sentence=CONTRACT["allocate"],
                       where=_where5("_take_block"))
            if self.ref.has_seq(seq):
                self.tokens[seq] = tokens
            for method in ("_cached_blocks", "cached_prefix_len"):
                self._both(f"bm.{method}({long})", method, long, sentence=CONTRACT["query"],
                           where=_where5("_cached_blocks"))

        def op_share(self, arg):
            """A computed prompt, then another with its prefix (shared blocks, ref counts 2),
            then one of the two freed."""
            k, arg = choose((1, 1, 2), arg)
            tokens = []
            for _ in range(k):
                c, arg = choose(self.chunks, arg)
                tokens += c
            tail, arg = choose(self.chunks, arg)
            first, arg = choose((True, False), arg)
            seqs = []
            for t in (tokens + [7], tokens + tail + [9]):
                self.n += 1
                seq = f"s{self.n}"
                self._both(f"bm.allocate_prompt({seq!r}, {t})", "allocate_prompt", seq, t,
                           sentence=CONTRACT["allocate"],
                           where=_where5("_cached_blocks / _take_block"))
                if not self.ref.has_seq(seq):
                    return
                self.tokens[seq] = t
                self.prompts.append(t)
                seqs.append(seq)
                if len(seqs) == 1:
                    self._both(f"bm.mark_computed({seq!r}, {t}, {len(t)})", "mark_computed", seq,
                               t, len(t), sentence=CONTRACT["computed"],
                               where=_where5("_take_block / free"))
            seq = seqs[0] if first else seqs[1]
            del self.tokens[seq]
            self._both(f"bm.free({seq!r})", "free", seq, sentence=CONTRACT["free"],
                       where=_where5("free"))

        def op_take(self, arg):
            if self.ref.num_free_blocks():  # only where no caller would reach it
                return self.op_allocate(arg)
            self._both("bm._take_block()  # nothing free, nothing cached", "_take_block",
                       sentence=CONTRACT["take"], where=_where5("_take_block"),
                       canon=lambda b: b.block_id)

    return Machine


@guarded_check(60, reference, WHERE)
def check_against_the_engine(cls, hidden) -> None:
    """Hidden: BlockManagerLab beside the engine's BlockManager on random sequences drawn
    from the instructor's secret: allocations of prompts made of repeating chunks (shared
    prefixes, exactly full pools, an id allocated twice), mark_computed, append_slots,
    frees (unknown ids too), read-only queries, a _take_block with nothing left. After
    every step: what each call returned or raised, every block's state, the tables, the
    free list and the LRU order, the per-sequence entries, the counters."""
    from .differential import run

    check_defines(cls)
    run(_machine(), hidden, "lab5/blocks", piece="your BlockManagerLab",
        reference="the engine's BlockManager", where=WHERE, bind={"submission": cls},
        examples=120, steps=30)


def _provided() -> dict:
    from ..kv_cache import Block, hash_block

    return {"Block": Block, "BlockManager": BlockManager, "NoFreeBlocksError": NoFreeBlocksError,
            "hash_block": hash_block}


# what the graded cell defines and may use (allowlist.py; grading runs it alone)
CELL = Cell(names=("BlockManagerLab",), provided=_provided,
            imports={"minserve.kv_cache": frozenset({"Block", "BlockManager",
                                                     "NoFreeBlocksError", "hash_block"})},
            reference=("BlockManager", frozenset(GRADED)))

"""The decode step replayed from CUDA graphs, one per batch-size bucket (SPEC D5).

Why a GPU idles. An eager forward is a Python loop that launches kernels: for a 16-layer
model about a thousand of them per decode step, each a few microseconds of CPU to set up
(argument checks, dispatch, the launch itself) for a kernel that, at decode batch sizes,
runs in a few microseconds too. The GPU finishes each kernel before the CPU has queued
the next one, so it waits on the CPU most of the tick. A CUDA graph records the kernels of
one forward once (their arguments, their memory addresses) and replays them with one
launch: the CPU cost of a step becomes one call, whatever the number of layers. vLLM and
nano-vllm capture their decode step this way; prompt pieces (many tokens, long kernels)
stay eager, where launching is not what costs.

A graph replays exactly what it recorded: the same shapes, the same addresses. So the
step is written over static buffers, filled before each replay:

    one device buffer (int64), one copy from the host per step:
      [ ids (B) | positions (B) | write slots (B) | lengths (B) | block tables (B x M) ]
    logits (B, V) float32: the graph's output, read after the replay

and the shapes that change are bucketed: B, the rows, rounded up to 1, 2, 4, 8, 16, ...
`max_batch_size`; M, the blocks of the longest row, rounded up to a power of two. A
graph is captured on the first step of each (B, M) it meets. Rows past the real ones
(B - n of them) are padding: token 0 at position 0, writing its K/V into a spare block
no block table names (`KVBlockStorage(spare_blocks=1)`), attending over that block only;
their logits are dropped. A row's attention reads M whole blocks, masked past its length
(`lengths`): the readable decode attention of backends/paged.py (`_attend`), over a
fixed-size gather, with the mask computed in the graph from the lengths. No
FlashAttention, no custom kernel: PyTorch's own operators, so it runs wherever CUDA
PyTorch does.

The math is the compact forward's (`fast/compact.py`), called on the static buffers: the
same tokens as the eager step up to float rounding (the gather is padded wider; softmax
sums a few more zeros). Where CUDA is absent, `DecodeGraphs(capture=False)` runs the same
static step eagerly over the same buffers: what the CPU tests check (buckets, padding
rows, rows joining and leaving), the capture itself being the one part only a GPU runs
(tests marked `cuda`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.paged import PagedForward, RowGroup


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes a graph is captured for: powers of two below `max_batch_size`,
    and `max_batch_size` itself (vLLM's are 1, 2, 4, then steps of 8)."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `n` (buckets ascending)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is larger than the largest bucket, {buckets[-1]}")


def block_bucket(blocks: int, max_blocks: int) -> int:
    """Blocks of the longest row, rounded up to a power of two (at most `max_blocks`)."""
    m = 1
    while m < blocks:
        m *= 2
    return min(m, max_blocks)


@dataclass
class Graph:
    """One captured decode step: its static buffers, and the graph (None: run eagerly)."""

    B: int
    M: int
    inputs: torch.Tensor  # (4*B + B*M,) int64 on the device: ids|positions|slots|lengths|tables
    logits: torch.Tensor | None = None  # (B, V) float32, written by each replay
    graph: object = None  # torch.cuda.CUDAGraph


class DecodeGraphs:
    """Decode steps of the compact forward over static buffers, replayed per bucket.

    `run(ids, positions, tables)` -> logits (n, V) for n decode rows: token `ids[b]` at
    `positions[b]` of the row whose block table is `tables[b]` (it must already hold the
    slot). The pool must have a spare block past `num_blocks` (`spare_blocks=1`).
    """

    def __init__(self, runner, storage, max_batch_size: int, max_model_len: int,
                 capture: bool = True) -> None:
        if storage.spare_blocks < 1:
            raise ValueError("DecodeGraphs needs a pool with a spare block (spare_blocks=1) "
                             "for the padding rows to write into")
        self.runner, self.storage = runner, storage
        self.capture = capture
        self.buckets = batch_buckets(max_batch_size)
        self.max_blocks = -(-max_model_len // storage.block_size)
        self.spare = storage.num_blocks  # the first block past the ones tables name
        self.graphs: dict[tuple[int, int], Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool
        self.capture_stream = None  # every capture into that pool on the same stream
        self.replays = 0

    def fits(self, n: int) -> bool:
        return 0 < n <= self.buckets[-1]

    def capture_all(self, max_tokens: int | None = None) -> int:
        """Capture now every (B, M) a step of rows of at most `max_tokens` tokens can meet
        (default: `max_model_len`), as vLLM and nano-vllm do at start-up; returns how many
        graphs there are. `run` captures lazily otherwise, in the middle of serving: each
        capture synchronises the device and empties PyTorch's memory cache
        (`torch.cuda.graph`), so a measured run should not be the one paying for it.
        Largest first: a smaller graph then fits in memory the larger ones left in the pool."""
        S = self.storage.block_size
        top = block_bucket(-(-(max_tokens or self.max_blocks * S) // S), self.max_blocks)
        Ms, m = [], 1
        while True:
            Ms.append(block_bucket(m, self.max_blocks))
            if Ms[-1] >= top:
                break
            m *= 2
        for B in reversed(self.buckets):
            for M in reversed(Ms):
                if (B, M) not in self.graphs:
                    self._make(B, M)
        return len(self.graphs)

    # --- one step ---------------------------------------------------------------------
    def run(self, ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        n, S = len(ids), self.storage.block_size
        B = bucket_for(n, self.buckets)
        M = block_bucket(max(p // S + 1 for p in positions), self.max_blocks)
        g = self.graphs.get((B, M)) or self._make(B, M)
        g.inputs.copy_(self._host_inputs(ids, positions, tables, B, M), non_blocking=True)
        if g.graph is not None:
            g.graph.replay()
        else:  # no CUDA: the same static step, run eagerly over the same buffers
            g.logits = self._step(g)
        self.replays += 1
        return g.logits[:n]

    def _host_inputs(self, ids, positions, tables, B: int, M: int) -> torch.Tensor:
        """What one step's buffer holds, built on the host: (4*B + B*M,) int64. Padding
        rows (b >= n) write and read only the spare block."""
        S, n, pad = self.storage.block_size, len(ids), B - len(ids)
        slots = [table[p // S] * S + p % S for table, p in zip(tables, positions)]
        rows = [table[:M] + [self.spare] * (M - len(table[:M])) for table in tables]
        flat = (ids + [0] * pad) + (positions + [0] * pad) \
            + (slots + [self.spare * S] * pad) + ([p + 1 for p in positions] + [1] * pad)
        for row in rows + [[self.spare] * M] * pad:
            flat += row
        assert len(flat) == 4 * B + B * M and n <= B
        out = torch.tensor(flat, dtype=torch.long)
        return out.pin_memory() if self.capture else out

    # --- the static step ------------------------------------------------------------------
    def _views(self, g: Graph):
        B, M = g.B, g.M
        ids, pos, slots, lengths = (g.inputs[i * B:(i + 1) * B] for i in range(4))
        return ids, pos, slots, lengths, g.inputs[4 * B:].view(B, M)

    def _step(self, g: Graph) -> torch.Tensor:
        """The decode forward over `g`'s buffers: what the graph records. Only device
        operators on fixed shapes: no host reads, no new host tensors."""
        st = self.storage
        ids, pos, slots, lengths, tables = self._views(g)
        L = g.M * st.block_size
        key_pos = torch.arange(L, device=st.device)  # (L,)
        visible = key_pos[None, :] < lengths[:, None]  # (B, L): keys 0..length-1
        bias = torch.zeros(g.B, 1, L, dtype=st.dtype, device=st.device).masked_fill_(
            ~visible[:, None, :], float("-inf"))  # (B, 1, L)
        bias = bias.expand(st.num_kv_heads, *bias.shape).reshape(-1, 1, L)  # (H_kv*B, 1, L)
        group = RowGroup(0, g.B, 1, tables, visible[:, None, None, :], None, bias)
        ctx = PagedForward(st, slots, [group], reuse_scratch=False)
        return self.runner.forward(ids.view(g.B, 1), pos.view(g.B, 1), ctx, 1)[:, -1]  # (B, V)

    def _make(self, B: int, M: int) -> Graph:
        g = Graph(B, M, torch.empty(4 * B + B * M, dtype=torch.long, device=self.storage.device))
        # capture (and warm-up) inputs: every row a padding row, so nothing real is written
        g.inputs.copy_(self._host_inputs([], [], [], B, M))
        if self.capture:
            # on the pool's GPU (device="cuda:1": streams are made on the current device)
            with torch.cuda.device(self.storage.device):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up: lazy inits (cuBLAS handles) happen here
                    self._step(g)
                torch.cuda.current_stream().wait_stream(side)
                self.capture_stream = self.capture_stream or torch.cuda.Stream()  # one for the pool
                g.graph = torch.cuda.CUDAGraph()
                # "thread_local": only this thread's calls are checked while it captures. With
                # the default "global", a CUDA call that may not run during a capture (a
                # cudaMalloc, a sync) made by ANY other thread of the process fails, and may
                # invalidate this capture: the HTTP server ticks the engine in a thread of its
                # own, beside others (PyTorch's own graph trees capture "thread_local" too).
                with torch.cuda.graph(g.graph, pool=self.pool, stream=self.capture_stream,
                                      capture_error_mode="thread_local"):
                    g.logits = self._step(g)
        self.graphs[(B, M)] = g
        return g


def graphs_for(mode: str, runner, storage, max_batch_size: int, max_model_len: int):
    """What `EngineConfig.cuda_graphs` asks for: None for "off", and for "auto" off CUDA or
    without the compact forward (the one the graphs record)."""
    if mode == "off" or runner is None or storage.device.type != "cuda":
        return None
    return DecodeGraphs(runner, storage, max_batch_size, max_model_len, capture=True)

"""EngineConfig: every knob of the engine, validated once, at construction.

One dataclass, the SPEC's knob names (A2), no globals. A bad value raises
`ValueError` with a message that says what to change, so a typo in a notebook
fails on the line that made it, not three ticks later inside a forward pass.

    EngineConfig(max_batch_size=4, policy="fcfs", backend="padded",
                 prefill_mode="monolithic", dtype="float32")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum


class PrefillMode(str, Enum):
    """How a prompt's tokens get through the model (SPEC C1, C2)."""

    MONOLITHIC = "monolithic"  # the whole prompt in one forward pass, in the tick of admission
    CHUNKED = "chunked"  # Version A: each prefilling row, one chunk per tick, its own pass
    MIXED_BATCH = "mixed_batch"  # Version B (Sarathi-Serve): chunk + decode rows in ONE pass
    DISAGGREGATED = "disaggregated"  # prefill and decode on different workers (DistServe)


# (prefill mode, backend) pairs that are built; any other pair fails at construction, loudly,
# never falling back to another mode (C2)
BUILT_MODE_BACKENDS = {(PrefillMode.MONOLITHIC, "padded"), (PrefillMode.MONOLITHIC, "paged"),
                       (PrefillMode.CHUNKED, "padded"), (PrefillMode.CHUNKED, "paged"),
                       (PrefillMode.MIXED_BATCH, "paged"), (PrefillMode.DISAGGREGATED, "paged")}
POLICIES = ("fcfs", "fair")
ADMISSIONS = ("reserve", "preempt")
SHARES = ("off", "equal")
RECLAIMS = ("recompute", "off")
BACKENDS = ("padded", "paged")
MODEL_RUNNERS = ("hf", "compact", "auto")
DECODE_ATTENTIONS = ("torch", "kernel", "auto")
CUDA_GRAPHS = ("off", "auto")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class EngineConfig:
    """All engine knobs. Unknown names are a TypeError; bad values a ValueError.

    Sizes are in *tokens* unless the name says blocks.
    """

    # --- model ---------------------------------------------------------------
    model: str | None = None  # None -> the embedded SmolLM2-135M-Instruct (D2); or a path / hub id
    dtype: str = "float32"
    device: str = "auto"  # "auto" -> cuda, then mps, then cpu (D1)
    max_model_len: int | None = None  # None -> the model's max_position_embeddings

    # --- queues and batch (Q) -------------------------------------------------
    max_batch_size: int = 8  # rows in prefilling + active together (Q3)
    max_queue_size: int = 256  # gate G1: pending requests beyond this are refused
    max_rows_per_session: int | None = None  # batch rows one session may hold; None: no cap
    # H6 (shares.py): "equal": the tenants (without tenants, sessions) that want them share
    # batch rows, the KV budget, the pending queue and a tick's prompt tokens equally,
    # a tenant's sessions split its share, and a share nobody else wants is lent.
    # "off": first come (or the fair policy's order) takes what the gates allow.
    # `minserve serve` sets "equal".
    shares: str = "off"
    # H6, with shares="equal": what a unit holds beyond its share was lent; when a unit
    # owed a row waits for a full batch or KV, "recompute" takes the borrowed rows back at
    # once (preempted, newest first, recomputed on re-admission: shares.py, in every
    # admission mode); "off" only holds the borrower's next requests back, so the
    # newcomer waits until borrowed rows end (the behaviour before; for comparisons).
    reclaim: str = "recompute"

    # --- policy (P) -------------------------------------------------------------
    policy: str = "fcfs"  # "fcfs" (P1) | "fair" (P2, VTC)
    fair_w_in: float = 1.0  # P3: cost of one prompt token computed
    fair_w_out: float = 2.0  # P3: cost of one output token
    fair_max_sessions: int = 10_000  # sessions whose counters are kept; idle ones beyond are forgotten

    # --- backpressure (G) -------------------------------------------------------
    kv_budget_tokens: int | None = None  # gate G2; None -> num_blocks * block_size
    # H5: the share of the G2 budget one request may reserve (prompt + max_tokens; more is
    # refused at submit), and one tenant's running rows together (more waits while other
    # tenants go first). 1.0: no cap. `minserve serve` sets 0.5 for both (a shared server).
    max_request_kv_share: float = 1.0
    max_tenant_kv_share: float = 1.0
    # "reserve": admit on prompt + max_tokens, so a running row never runs out of KV (R1).
    # "preempt": admit on what the prompt needs now; when decode would run out of KV, a
    # running row is preempted (its KV dropped, recomputed on re-admission). P6.
    admission: str = "reserve"

    # --- backend and KV cache (B, K) --------------------------------------------
    backend: str = "padded"  # "padded" (DynamicCache) | "paged" (block tables)
    block_size: int = 16  # tokens per KV block (K1)
    num_blocks: int | None = None  # None -> derived from max_batch_size * max_model_len
    enable_prefix_caching: bool = True  # K1/K2: reuse the KV of equal prompt prefixes
    # What computes the paged backend's forward: "hf" (the HF model, any architecture),
    # "compact" (fast/compact.py: the Llama family written out; faster on CPU), or
    # "auto": compact on the paged backend when it can run the model, else hf.
    model_runner: str = "hf"
    # Who computes a decode step's attention on the paged backend: "torch" (paged.py, the
    # readable version), "kernel" (fast/decode_kernel.c, built on first use: reads the
    # blocks in place; CPU, float32) or "auto": the kernel where it runs, else torch.
    decode_attention: str = "torch"
    # The decode step replayed from CUDA graphs, one per batch-size bucket (fast/cuda_graphs.py,
    # SPEC D5): "off" (eager, the readable path) or "auto": on when the device is CUDA and
    # the compact forward runs (model_runner="compact"/"auto" on backend="paged").
    cuda_graphs: str = "off"

    # --- prefill (C) ---------------------------------------------------------------
    prefill_mode: str = ""  # "" -> derived from prefill_chunk_size (C2)
    prefill_chunk_size: int = 0  # > 0 -> chunked prefill with chunks of this many tokens
    # (disaggregated: a row's piece in one of the prefill worker's forwards, 0 -> 512)
    # The prompt tokens one tick computes over all rows (vLLM's --max-num-batched-tokens,
    # for prompts only), split max-min fair between tenants, then rows (shares.py).
    # None: no budget beyond each prefilling row's chunk. Needs chunked, mixed_batch or
    # disaggregated (there: the prompt tokens on the prefill worker at once, two forwards
    # of half of it; None: forwards of one chunk).
    max_prefill_tokens: int | None = None
    # disaggregated (disagg/): the prefill worker's torch threads (None: half the cores,
    # at least 1), and how long one of its forwards may take (and it may take to start,
    # at least 120 s) before the worker is restarted (nothing waits forever).
    prefill_worker_threads: int | None = None
    prefill_timeout_s: float = 120.0

    # --- misc ------------------------------------------------------------------------
    seed: int = 0  # seeds requests that bring no seed of their own

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"EngineConfig: {msg}")

        for name, choices in (("dtype", DTYPES), ("policy", POLICIES), ("admission", ADMISSIONS),
                              ("shares", SHARES), ("reclaim", RECLAIMS),
                              ("backend", BACKENDS), ("model_runner", MODEL_RUNNERS),
                              ("decode_attention", DECODE_ATTENTIONS),
                              ("cuda_graphs", CUDA_GRAPHS)):
            v = getattr(self, name)
            need(v in choices, f"{name}={v!r}; use one of {choices}")
        need(isinstance(self.device, str) and self.device != "", "device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")
        if self.device != "auto":  # "auto" is resolved by the engine, which asks again
            self.check_device(self.device.split(":")[0])
        # counts: an int >= 1; where a meaning of None is given, None too
        for name, none in (("max_batch_size", ""), ("max_queue_size", ""),
                           ("max_rows_per_session", "for no cap"), ("fair_max_sessions", ""),
                           ("block_size", ""), ("num_blocks", "to derive it"),
                           ("kv_budget_tokens", "to derive it"),
                           ("max_prefill_tokens", "for no budget beyond the chunks"),
                           ("prefill_worker_threads", "for half the cores"),
                           ("max_model_len", "for the model's own")):
            v = getattr(self, name)
            need(_pos_int(v) or (none != "" and v is None),
                 f"{name}={v!r}; use an int >= 1" + (f", or None {none}" if none else ""))
        for name in ("max_request_kv_share", "max_tenant_kv_share"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1,
                 f"{name}={v!r}; use a share of the KV budget in (0, 1] (1 = no cap)")
        need(self.fair_w_in >= 0 and self.fair_w_out >= 0 and self.fair_w_in + self.fair_w_out > 0,
             "fair_w_in and fair_w_out must be >= 0 and not both 0")
        need(self.model_runner != "compact" or self.backend == "paged",
             f"model_runner={self.model_runner!r} runs on backend='paged', not "
             f"backend={self.backend!r}")
        need(self.decode_attention != "kernel" or self.backend == "paged",
             f"decode_attention='kernel' runs on backend='paged', not backend={self.backend!r}")
        need(isinstance(self.prefill_chunk_size, int) and self.prefill_chunk_size >= 0,
             f"prefill_chunk_size={self.prefill_chunk_size!r}; use 0 (no chunking) or an int >= 1")

        # C2: an empty mode is derived from the chunk size.
        # Remembered (a plain attribute, not a field) so that `replace` derives it again.
        self._derived_prefill_mode = self.prefill_mode in ("", None)
        if self._derived_prefill_mode:
            self.prefill_mode = "chunked" if self.prefill_chunk_size > 0 else "monolithic"
        modes = [m.value for m in PrefillMode]
        need(self.prefill_mode in modes, f"prefill_mode={self.prefill_mode!r}; use one of {modes}")
        mode = PrefillMode(self.prefill_mode)
        need((mode, self.backend) in BUILT_MODE_BACKENDS,
             f"prefill_mode={mode.value!r} is built on the "
             f"{' / '.join(sorted(b for m, b in BUILT_MODE_BACKENDS if m is mode))} backend, "
             f"not backend={self.backend!r}")
        need(mode is not PrefillMode.CHUNKED or self.prefill_chunk_size > 0,
             "prefill_mode='chunked' needs prefill_chunk_size > 0")
        need(self.max_prefill_tokens is None or mode is not PrefillMode.MONOLITHIC,
             f"max_prefill_tokens={self.max_prefill_tokens} cuts prompts into pieces; "
             f"{mode.value} prefill computes each whole: set prefill_chunk_size > 0 (chunked) "
             "or prefill_mode='mixed_batch' or 'disaggregated', or max_prefill_tokens=None")
        need(isinstance(self.prefill_timeout_s, (int, float)) and self.prefill_timeout_s > 0,
             f"prefill_timeout_s={self.prefill_timeout_s!r}; use seconds > 0")

    def check_device(self, device_type: str) -> None:
        """D1: refuse what this config asks of a device that does not have it, saying why:
        the C decode kernel is CPU-only, and MPS computes bfloat16 only from macOS 14 and
        no test has run it there. (Whether the device exists is `models.resolve_device`'s.)"""
        problems = []
        if device_type != "cpu" and self.decode_attention == "kernel":
            problems.append(f"decode_attention='kernel' runs on the CPU (fast/decode_kernel.c "
                            f"reads float32 CPU memory), not on {device_type}; use "
                            "decode_attention='torch' or 'auto'")
        if device_type == "mps" and self.dtype == "bfloat16":
            problems.append("dtype='bfloat16' on mps: MPS has bfloat16 only from macOS 14 and "
                            "minserve has not run it there; use dtype='float16' or 'float32'")
        if problems:
            raise ValueError("EngineConfig: " + "; ".join(problems))

    @property
    def prefill(self) -> PrefillMode:
        return PrefillMode(self.prefill_mode)

    def replace(self, **changes) -> EngineConfig:
        """A copy with some fields changed (validated again). A prefill mode that was
        derived (C2) is derived again, so `replace(prefill_chunk_size=16)` on a default
        config gives chunked prefill, not monolithic with an unused chunk size."""
        if self._derived_prefill_mode and "prefill_mode" not in changes:
            changes["prefill_mode"] = ""
        return dataclasses.replace(self, **changes)


def _pos_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1

"""Engine: the public face (SPEC §10). Model + tokenizer + scheduler + worker thread.

    engine = Engine(EngineConfig(max_batch_size=4))      # model=None -> embedded SmolLM2
    outs = engine.generate(["Hello", [1, 2, 3], [{"role": "user", "content": "Hi"}]],
                           SamplingParams(max_tokens=32))
    handle = engine.submit("Hi", SamplingParams(max_tokens=8), session_id="alice")
    engine.step()                                        # one tick, by hand (step mode)

Two ways to drive the scheduler:

* **step mode** (notebooks, tests): nothing runs until you call `step()` (or
  `generate`, which steps until its prompts are done). Deterministic.
* **serving mode** (`start()`, the HTTP server, the Gradio app): a worker
  thread runs ticks while there is work and sleeps when there is none;
  `submit` may then be called from any thread.

Everything is per-instance: two engines can live side by side in a notebook.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Union

import torch

from .backends.base import refuse_unsupported
from .backends.padded import PaddedBackend
from .config import EngineConfig
from .fair import FairPolicy
from .models import load_model, resolve_device
from .policies import FCFSPolicy, Policy
from .records import TickRecord
from .request import Request, RequestOutput
from .sampling import SamplingParams, make_generator
from .scheduler import Scheduler
from .spans import Spans, from_env
from .streaming import RequestHandle, Waker

Prompt = Union[str, Sequence[int], Sequence[dict]]
DEFAULT_MAX_CONTEXT_FOR_BLOCKS = 1024  # tokens per row assumed when deriving num_blocks


def make_policy(name: str, w_in: float = 1.0, w_out: float = 2.0,
                max_sessions: int = 10_000) -> Policy:
    """Build the policy a config names (FCFS in policies.py, VTC in fair.py)."""
    if name == "fcfs":
        return FCFSPolicy()
    if name == "fair":
        return FairPolicy(w_in=w_in, w_out=w_out, max_sessions=max_sessions)
    raise ValueError(f"unknown policy {name!r}; use 'fcfs' or 'fair'")


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, model: torch.nn.Module | None = None,
                 tokenizer=None) -> None:
        self.config = config = config or EngineConfig()
        if config.prefill_mode == "disaggregated":  # before anything is loaded (disagg/)
            from .disagg.process import refuse_spawn_reimport

            refuse_spawn_reimport()  # this process is a prefill worker re-running a script
        if model is None:  # D1: "auto" may pick mps: refuse what it lacks before loading
            config.check_device(resolve_device(config.device).type)
            model, tokenizer = load_model(config.model, config.dtype, config.device)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.device = next(model.parameters()).device
        config.check_device(self.device.type)
        self.max_model_len = config.max_model_len or int(model.config.max_position_embeddings)
        self.eos_token_ids = self._eos_ids()
        # A local folder is named by its last component (no home paths in UIs or /v1/models).
        name = config.model or getattr(model.config, "name_or_path", "") or "custom"
        self.model_name = os.path.basename(name.rstrip("/")) if os.path.isdir(name) else name

        # K1: the block pool. Default size: every batch row holding up to
        # DEFAULT_MAX_CONTEXT_FOR_BLOCKS tokens. G2's budget defaults to the same number of tokens.
        bs = config.block_size
        num_blocks = config.num_blocks or max_batch_blocks(
            config.max_batch_size, min(self.max_model_len, DEFAULT_MAX_CONTEXT_FOR_BLOCKS), bs)
        self.num_blocks = num_blocks
        kv_budget = config.kv_budget_tokens or num_blocks * bs
        # All three gates always run (SPEC G), so there is always a block manager. The
        # physical block storage exists when something reads it back: the paged
        # backend (it IS its KV), or the padded backend with prefix caching on.
        from .kv_cache import BlockManager

        refuse_unsupported(model, config.backend, self.max_model_len)  # before any allocation
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        storage = None
        # a spare block for the padding rows of captured decode steps (fast/cuda_graphs.py)
        graphs = (config.cuda_graphs != "off" and config.backend == "paged"
                  and self.device.type == "cuda")
        if config.backend == "paged" or config.enable_prefix_caching:
            from .backends.kv_storage import KVBlockStorage

            storage = KVBlockStorage.for_model(model, num_blocks, bs, spare_blocks=int(graphs))
        if config.backend == "paged":
            from .backends.paged import PagedBackend
            from .fast import compact, cuda_graphs, decode_kernel  # faster, the same math (opt-in)

            runner = compact.runner_for(config.model_runner, model, self.max_model_len)
            backend = PagedBackend(model, self.block_manager, storage, self.max_model_len, runner,
                                   decode_kernel.kernel_for(config.decode_attention, storage),
                                   cuda_graphs.graphs_for(config.cuda_graphs, runner, storage,
                                                          config.max_batch_size,
                                                          self.max_model_len))
        else:
            from .fast.in_place_cache import InPlaceLayer  # the same floats, no copy per step

            backend = PaddedBackend(model, storage=storage, decode_layer=InPlaceLayer)
            backend.block_manager = self.block_manager
        policy = make_policy(config.policy, config.fair_w_in, config.fair_w_out,
                             config.fair_max_sessions)
        self.scheduler = Scheduler(config, backend, policy, kv_budget, self.block_manager)
        if config.prefill_mode == "disaggregated":  # prompts on a worker process (disagg/)
            from .disagg.connector import PrefillWorker

            remote = self.scheduler.remote = PrefillWorker(
                model, storage, self.block_manager, runner_kind=config.model_runner,
                max_model_len=self.max_model_len, max_batch_size=config.max_batch_size,
                threads=config.prefill_worker_threads or max(1, (os.cpu_count() or 2) // 2),
                timeout_s=config.prefill_timeout_s,
                chunk_tokens=config.prefill_chunk_size or 512,
                budget_tokens=config.max_prefill_tokens)
            # stopped with the engine (`close`), or when it is collected, or at exit
            weakref.finalize(self, remote.close)
            try:  # loaded before the first prompt; a worker that dies first raises here, at once
                remote.wait_ready()
            except BaseException:
                remote.close()
                raise

        self._seq = itertools.count()
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.last_tick_at: float | None = None  # time.time() of the worker's last loop
        self.trace: list[TickRecord] | None = None  # set to [] to record every tick
        # async readers' wakes: the worker sends them between ticks (streaming.Waker)
        self.waker = Waker()
        self.spans: Spans | None = None  # where each tick's and token's time goes (spans.py)
        self.set_spans(from_env())  # MINSERVE_SPANS=FILE turns them on; off by default

    # ================================================================ inputs
    def _eos_ids(self) -> tuple[int, ...]:
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def encode(self, prompt: Prompt) -> list[int]:
        """Text, token ids, or chat messages (through the chat template) -> token ids."""
        text = isinstance(prompt, str)
        chat = not text and len(prompt) and isinstance(prompt[0], dict)
        if (text or chat) and self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass token ids")
        if text:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif chat:
            ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True,
                                                     tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = list(prompt)
        ids = [int(t) for t in ids]
        vocab = int(self.model.config.vocab_size)
        if not ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        return ids

    @property
    def request_kv_cap(self) -> int:
        """Tokens of KV one request may reserve, prompt + max_tokens (H5:
        `max_request_kv_share` of the G2 budget), so no request holds everyone out."""
        return int(self.config.max_request_kv_share * self.scheduler.kv_budget_tokens)

    def make_request(self, prompt: Prompt, sampling: SamplingParams | None = None, *,
                     session_id: str = "default", priority: int = 0,
                     request_id: str | None = None, tenant: str | None = None) -> Request:
        sampling = sampling or SamplingParams()
        ids = self.encode(prompt)
        if len(ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                             f"exceeds the model's context of {self.max_model_len} tokens")
        share = self.config.max_request_kv_share
        if share < 1 and len(ids) + sampling.max_tokens > self.request_kv_cap:
            raise ValueError(request_cap_message(len(ids), sampling.max_tokens,
                                                 self.request_kv_cap,
                                                 self.scheduler.kv_budget_tokens, share))
        seq = next(self._seq)
        req = Request(request_id=request_id or f"req-{seq}", prompt_token_ids=ids,
                      sampling=sampling, arrival_seq=seq, session_id=str(session_id),
                      priority=int(priority), eos_token_ids=self.eos_token_ids, tenant=tenant)
        # Per-request RNG: the same seed gives the same tokens whatever shares the batch.
        req.generator = make_generator(sampling.seed if sampling.seed is not None
                                       else self.config.seed * 1_000_003 + seq)
        req.handle = RequestHandle(req.request_id, self.cancel, self.tokenizer, sampling.stop,
                                   drive=self._drive_step_mode, spans=self.spans,
                                   waker=self.waker)
        return req

    # ================================================================ public API
    def submit(self, prompt: Prompt, sampling: SamplingParams | None = None, *,
               session_id: str = "default", priority: int = 0,
               request_id: str | None = None, tenant: str | None = None) -> RequestHandle:
        """Queue one request; return its streaming handle at once.

        A refusal (G1 now, G2/G3 at admit) arrives as the handle's final event,
        with `rejection` naming the gate. Invalid input raises ValueError.
        """
        req = self.make_request(prompt, sampling, session_id=session_id, priority=priority,
                                request_id=request_id, tenant=tenant)
        self.scheduler.submit(req)
        self._wake.set()
        return req.handle

    def cancel(self, request_id: str) -> bool:
        ok = self.scheduler.cancel(request_id)
        self._wake.set()
        return ok

    def _drive_step_mode(self) -> bool:
        """A handle's reader needs the next event: in step mode, run one tick for it
        (True); with the worker running, it ticks (False: just wait)."""
        if self.running or not self.scheduler.has_work():
            return False
        self.step()
        return True

    def step(self) -> TickRecord:
        """One tick (T1..T4). In serving mode the worker calls this; don't call it yourself
        then. The worker's records leave out the state after the tick unless a trace is
        kept (`Scheduler.snapshot_ticks`); step mode's always have it (T6)."""
        self.scheduler.snapshot_ticks = (self.trace is not None
                                         or threading.current_thread() is not self._worker)
        rec = self.scheduler.step()
        if self.trace is not None:
            self.trace.append(rec)
        return rec

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 session_id: str = "default", priority: int = 0) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order.

        In step mode this ticks the scheduler itself; with the worker running it
        waits. Either way it never submits past the queue's capacity (G1).
        """
        single = isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, dict)))
        prompts = [prompts] if single else list(prompts)
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        reqs = [self.make_request(p, s, session_id=session_id, priority=priority)
                for p, s in zip(prompts, params)]
        todo = list(reqs)
        while True:
            while todo and len(self.scheduler.policy) < self.config.max_queue_size:
                self.scheduler.submit(todo.pop(0))
            self._wake.set()
            if not todo and all(r.handle.finished for r in reqs):
                break
            if self.running:
                time.sleep(0.005)
            else:
                self.step()
        return [r.handle.output for r in reqs]

    def set_spans(self, spans: Spans | None) -> None:
        """Time each tick's phases and each token's way to its client from now on
        (spans.py; requests submitted from now on), or stop (None)."""
        self.spans = self.scheduler.spans = spans

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        s.update(model=self.model_name, device=str(self.device), worker_alive=self.running,
                 last_error=self.last_error,
                 # wall-clock heartbeat: a time a reader can use, and how old it is
                 last_tick_at=(None if self.last_tick_at is None else datetime.fromtimestamp(
                     self.last_tick_at, timezone.utc).isoformat(timespec="milliseconds")),
                 seconds_since_last_tick=(None if self.last_tick_at is None
                                          else round(time.time() - self.last_tick_at, 3)))
        return s

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def explain(self, request_id: str) -> dict[str, Any]:
        """Where a request is and why (its queue, what holds it, with the numbers), as
        data plus one `sentence` (explain.py)."""
        from .explain import explain

        return explain(self.scheduler, request_id)

    # ================================================================ serving mode
    @property
    def running(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def start(self) -> Engine:
        """Start the worker thread (serving mode). Idempotent."""
        if not self.running:
            self._stop.clear()
            self._worker = threading.Thread(target=self._run, name="minserve-worker", daemon=True)
            self._worker.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._worker is not None:
            self._worker.join(timeout)
        self._worker = None
        if self.spans is not None and self.spans.path is not None:  # MINSERVE_SPANS=FILE
            self.spans.dump()

    def close(self) -> None:
        """Stop the worker thread and, if there is one, the prefill worker process."""
        self.stop()
        if self.scheduler.remote is not None:
            self.scheduler.remote.close()

    def _run(self) -> None:
        self.waker.hold()  # async readers are woken between ticks (streaming.Waker)
        try:
            self._loop()
        finally:
            self.waker.release()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.last_tick_at = time.time()  # heartbeat: a stuck worker stops updating it
            try:
                self.waker.flush()  # the last tick's tokens, as this tick's forward begins
                if not self.scheduler.has_work():
                    if self.scheduler.remote is not None:  # idle: the prefill worker's
                        with self.scheduler.lock:  # answers free the staging of abandoned
                            self.scheduler.remote.poll()  # prompts; a death is seen, and healed
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                self.step()
                # Between two ticks, hand the tick lock to anyone waiting for it (explain,
                # check_invariants): CPython's locks are not fair, and a worker that takes
                # it again at once can keep a reader out for as long as there is work.
                time.sleep(0)
            except Exception as e:  # keep serving: fail the rows in flight, report the error
                try:
                    self.recover(e)
                except Exception as e2:  # never let the worker die (SPEC H5)
                    from .failures import log

                    log.error("recovering from a failed tick raised too", exc_info=e2)

    def recover(self, exc: BaseException) -> int:
        """What the worker does when a tick raises outside any one row (a policy's
        peek, a bug): log the traceback, fail the rows in flight so everything they
        held goes back (R1, R2), keep serving. Returns how many rows failed."""
        from .failures import log, row_error

        log.error("a tick raised; failing the rows in flight", exc_info=exc)
        self.scheduler.last_error = row_error("a tick", exc)
        return self.scheduler.fail_all(self.scheduler.last_error)

    @property
    def last_error(self) -> str | None:
        """The newest error, one line (the traceback is in the `minserve` log)."""
        return self.scheduler.last_error

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def request_cap_message(prompt_len: int, max_tokens: int, cap: int, budget: int,
                        share: float) -> str:
    advice = (f"lower max_tokens to {cap - prompt_len} or less" if prompt_len < cap else
              f"the prompt alone is over that: shorten it to fewer than {cap} tokens")
    return (f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
            f"{prompt_len + max_tokens} tokens of KV; one request may reserve at most {cap} "
            f"of the {budget}-token KV budget (max_request_kv_share={share:g}), so that no "
            f"request holds everyone else out: {advice}")


def max_batch_blocks(max_batch_size: int, tokens_per_row: int, block_size: int) -> int:
    """Blocks for `max_batch_size` rows of `tokens_per_row` tokens, rounded up per row."""
    return max_batch_size * -(-tokens_per_row // block_size)

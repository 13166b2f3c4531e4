"""Engine overhead: one decode tick vs a bare batched forward (docs/benchmarks.md).

The physical floor for this design on this machine is what the model itself
costs: one forward pass of B rows, one new token each, over a KV cache of the
same length, then an argmax -- the inner loop of Hugging Face's greedy
`generate`, nothing else. A minserve decode tick does that plus scheduling
(admit, evict, policy hooks), backend bookkeeping (masks, positions, invariant
checks), sampling and streaming each token, and the tick's record (SPEC T6).

    overhead % = (tick - bare) / tick         (medians over interleaved pairs)

and, as a cross-check that a noisy neighbour cannot skew, the share of each
tick spent outside the model's forward (forward hooks time the forward inside
the tick itself).

We put B equal-length prompts in the decode batch (no padding, so both do the
same arithmetic), then interleave (timing.py): one engine tick, one bare step, each
growing its own KV by one column, the order flipping every pair. Only pure decode
ticks count (nothing admitted, prefilled or evicted), with their pair.

`profile_ticks` runs the same ticks under cProfile: where the non-forward time goes.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
from typing import Any

import numpy as np
import torch

from .timing import ForwardClock, decoding, drain, interleave


def fill_decode_batch(engine, batch_size: int, prompt_len: int, n_ticks: int, seed: int):
    """Submit B prompts of prompt_len random ids and step until all are decoding."""
    if engine.running:
        raise RuntimeError("measure the overhead in step mode: stop the engine's worker first")
    if engine.scheduler.has_work():
        raise RuntimeError("the engine must be idle")
    vocab = int(engine.model.config.vocab_size)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(min(100, vocab // 4), vocab, size=prompt_len).tolist()
               for _ in range(batch_size)]
    return prompts, decoding(engine, prompts, n_ticks + 4, session_id="overhead")


class BareDecoder:
    """The floor: HF model + DynamicCache, one batched forward and an argmax per step."""

    def __init__(self, model, prompts: list[list[int]]) -> None:
        from ..backends.base import model_forward_kwargs

        self.model, self.cache_arg = model, model_forward_kwargs(model)
        device = next(model.parameters()).device
        ids = torch.tensor(prompts, device=device)  # (B, L): equal lengths, no padding
        self.mask = torch.ones_like(ids)  # (B, L)
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=self.mask, use_cache=True)
        self.cache = out["cache"] if "cache" in out else out["past_key_values"]  # 5.x renamed it
        self.tok = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)

    def step(self) -> None:
        pos = self.mask.sum(dim=1, keepdim=True)  # (B, 1)
        self.mask = torch.cat([self.mask, torch.ones_like(self.tok)], dim=1)
        with torch.inference_mode():
            out = self.model(input_ids=self.tok, attention_mask=self.mask, position_ids=pos,
                             use_cache=True, **{self.cache_arg: self.cache})
        self.tok = out.logits[:, -1].argmax(-1, keepdim=True)
        self.tok.tolist()  # the host needs the tokens, as the engine does


def measure_overhead(engine, batch_size: int = 8, prompt_len: int = 128, ticks: int = 24,
                     warmup: int = 3, seed: int = 0) -> dict[str, Any]:
    """Decode-tick wall time vs a bare forward at the same batch and lengths.

    Three readings, because a shared machine is noisy:
    * `overhead_pct`: medians of the interleaved pairs, (tick - bare) / tick;
    * `overhead_pct_min`: the same with each side's fastest (least disturbed) step;
    * `outside_forward_pct`: within each tick, the share of time not spent inside
      the model's forward (timed by hooks; both parts see the same disturbances).
    """
    prompts, handles = fill_decode_batch(engine, batch_size, prompt_len, ticks + warmup, seed)
    bare = BareDecoder(engine.model, prompts)
    clock = ForwardClock(engine.model)
    pure, fwd = [], []

    def tick() -> None:
        clock.spent = 0.0
        rec = engine.step()
        fwd.append(clock.spent)
        pure.append(len(rec.decode.rows) == batch_size and not rec.admit.admitted
                    and not rec.prefill.chunks and not rec.evict.evicted)

    try:
        times = interleave({"engine": tick, "bare": bare.step}, ticks, warmup)
    finally:
        clock.remove()
        drain(engine, handles)
    keep = [i for i, ok in enumerate(pure[warmup:]) if ok]
    tick_s = [times["engine"][i] for i in keep]
    bare_s = [times["bare"][i] for i in keep]
    fwd_s = [fwd[warmup + i] for i in keep]
    tick, floor = statistics.median(tick_s), statistics.median(bare_s)
    outside = [(t - f) / t for t, f in zip(tick_s, fwd_s)]
    return {"batch_size": batch_size, "prompt_len": prompt_len, "ticks": len(tick_s),
            "tick_ms": tick * 1e3, "bare_forward_ms": floor * 1e3,
            "overhead_ms": (tick - floor) * 1e3, "overhead_pct": 100.0 * (tick - floor) / tick,
            "tick_ms_min": min(tick_s) * 1e3, "bare_forward_ms_min": min(bare_s) * 1e3,
            "overhead_pct_min": 100.0 * (min(tick_s) - min(bare_s)) / min(tick_s),
            "outside_forward_ms": statistics.median(t - f for t, f in zip(tick_s, fwd_s)) * 1e3,
            "outside_forward_pct": 100.0 * statistics.median(outside),
            "tick_ms_all": [round(t * 1e3, 3) for t in tick_s],
            "bare_ms_all": [round(t * 1e3, 3) for t in bare_s],
            "forward_in_tick_ms_all": [round(t * 1e3, 3) for t in fwd_s],
            "backend": engine.config.backend}


def profile_ticks(engine, batch_size: int = 8, prompt_len: int = 128, ticks: int = 16,
                  seed: int = 0, top: int = 25) -> str:
    """cProfile of `ticks` pure decode ticks: the top functions by own time, as text."""
    _, handles = fill_decode_batch(engine, batch_size, prompt_len, ticks, seed)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(ticks):
        engine.step()
    prof.disable()
    drain(engine, handles)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()

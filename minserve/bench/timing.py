"""How every experiment takes its numbers: the timing discipline, written once.

A shared 2-core machine drifts by tens of percent from one minute to the next, so:

* **warm-up**: the first rounds of every side run off the record (first calls pay
  one-off costs: thread pools, the allocator, lazy imports, oneDNN's weight reorders);
* **interleaving**: the sides compared take turns round by round, the order rotating
  every round, so the machine's drift hits every side alike and none always runs first;
* **medians** of the rounds (and the fastest round, the least disturbed), not means;
* **the conditions beside every figure**: torch's thread count and the 1-minute load
  average at the start and at the end of the run (`Conditions.line()`).

    times = interleave({"padded": padded.step, "paged": paged.step}, rounds=16)
    medians_ms(times)            # {"padded": 152.3, "paged": 168.0}

`ForwardClock` times the model's forward inside a tick with hooks: the share of a tick
spent outside the forward then comes from one measurement, which the machine's noise
hits alike. `decoding` fills an engine's decode batch, `decode_race` interleaves pure
decode ticks of several engines so filled, and `drain` empties them again.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable


def interleave(sides: dict[str, Callable[[], object]], rounds: int,
               warmup: int = 1) -> dict[str, list[float]]:
    """Each side once per round, the order rotating; the seconds of every round after the
    first `warmup`, per side. Round i of every side is at index i (pairs stay pairs)."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for k in range(warmup + rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            t = time.perf_counter()
            sides[name]()
            if k >= warmup:
                times[name].append(time.perf_counter() - t)
    return times


def medians_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def fastest_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: min(v) * 1e3 for name, v in times.items()}


class Conditions:
    """The machine, torch's threads and the load average, taken when a run starts."""

    def __init__(self) -> None:
        import torch

        self.threads, self.load_start = torch.get_num_threads(), os.getloadavg()[0]
        self.torch = torch.__version__

    def line(self) -> str:
        """What goes beside every figure (the load average at the end is taken now)."""
        return (f"_{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
                f"torch {self.torch}, {self.threads} threads; load average (1 min) "
                f"{self.load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
                f"{os.cpu_count()} cores_")

    def as_dict(self) -> dict[str, float | int]:
        return {"threads": self.threads, "load_start": self.load_start,
                "load_end": os.getloadavg()[0], "cores": os.cpu_count() or 0}


class ForwardClock:
    """Forward hooks on a module: the seconds spent inside its forward, summed (`spent`)."""

    def __init__(self, model) -> None:
        self.spent, self._t = 0.0, 0.0
        self._handles = [model.register_forward_pre_hook(self._pre),
                         model.register_forward_hook(self._post)]

    def _pre(self, *_):
        self._t = time.perf_counter()

    def _post(self, *_):
        self.spent += time.perf_counter() - self._t

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def decoding(engine, prompts: list, max_tokens: int, **submit) -> list:
    """Submit `prompts` (EOS ignored) and step `engine` until every one decodes; the handles."""
    from ..sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    handles = [engine.submit(p, params, **submit) for p in prompts]
    while len(engine.scheduler.active) < len(prompts):
        if not engine.scheduler.has_work():
            raise RuntimeError("requests ended before filling the batch (gates?): "
                               f"{[h.events[-1] for h in handles]}")
        engine.step()
    return handles


def decode_race(engines: dict, rounds: int, warmup: int = 1, rows: int | None = None,
                seen: Callable | None = None, **sides) -> dict[str, list[float]]:
    """`interleave` one tick of each of `engines` (each `decoding` its rows) and any other
    `sides`; every tick must be a pure decode tick (of `rows` rows); `seen(name, record)`
    after each."""
    def tick(name: str) -> None:
        rec = engines[name].step()
        assert not rec.prefill.chunks and rows in (None, len(rec.decode.rows)), \
            "not a pure decode tick"
        if seen is not None:
            seen(name, rec)

    return interleave({**{n: (lambda n=n: tick(n)) for n in engines}, **sides}, rounds, warmup)


def drain(engine, handles=(), close: bool = False) -> None:
    """Cancel `handles`, step `engine` until idle; `close`: the paged backend gives the
    model its attention back."""
    for h in handles:
        h.cancel()
    while engine.scheduler.has_work():
        engine.step()
    if close and hasattr(engine.scheduler.backend, "close"):
        engine.scheduler.backend.close()

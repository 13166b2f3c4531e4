"""Streaming: tokens reach the handle as they are sampled; text never splits a character."""

from __future__ import annotations

import asyncio
import threading

import pytest

from minserve import SamplingParams
from minserve.streaming import IncrementalDetokenizer, RequestHandle, StreamEvent, Waker

from .conftest import make_engine


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from minserve.models import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir())


def test_multibyte_characters_are_never_split_across_deltas(tokenizer):
    text = "Café 🍕 → naïve 日本語 ok 🎉🎉"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split()), "some characters must span several tokens"
    det = IncrementalDetokenizer(tokenizer)
    deltas = [det.add(t) for t in ids] + [det.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas), "an incomplete character is held back"


def test_stop_string_split_over_tokens_never_leaks(tokenizer):
    text = "alpha beta STOPHERE gamma"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    det = IncrementalDetokenizer(tokenizer, stop=["STOPHERE"])
    released = ""
    for t in ids:
        released += det.add(t)
        if det.stopped:
            break
    released += det.flush()
    assert det.stopped and released == "alpha beta "
    assert "STOP" not in released


def test_stop_string_ends_request_with_reason_stop(real_model):
    model, tok = real_model
    engine = make_engine(model, tok, max_batch_size=2)
    out = engine.generate("1, 2, 3, 4,", SamplingParams(max_tokens=20, stop=[" 7"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == " 5, 6,"


def test_events_arrive_while_the_request_runs_sync_iterator(tiny_model):
    engine = make_engine(tiny_model)
    h = engine.submit([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    seen = []
    engine.step()  # admit + prefill + first decode: two tokens out already
    assert [e.index for e in h.events] == [0, 1] and not h.finished
    t = threading.Thread(target=lambda: seen.extend(h))  # a reader in another thread
    t.start()
    while engine.scheduler.has_work():
        engine.step()
    t.join(5)
    assert [e.index for e in seen[:-1]] == list(range(6))
    assert seen[-1].finish_reason == "length" and seen[-1].token_id is None
    assert [e.token_id for e in seen[:-1]] == h.output.token_ids


def test_async_iterator_receives_every_event_from_a_worker_thread(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=4).start()
    try:
        async def consume(prompt):
            h = engine.submit(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
            return [ev async for ev in h], h

        async def main():
            return await asyncio.gather(*(consume([i + 1] * (i + 2)) for i in range(5)))

        for events, h in asyncio.run(main()):
            assert [e.index for e in events[:-1]] == list(range(8))
            assert events[-1].finish_reason == "length"
            assert [e.token_id for e in events[:-1]] == h.output.token_ids
    finally:
        engine.stop()


class _Loop:
    """Stands in for an event loop: records what other threads ask it to run."""

    def __init__(self) -> None:
        self.calls: list = []

    def call_soon_threadsafe(self, fn) -> None:
        self.calls.append(fn)


def test_the_holding_thread_wakes_each_loop_once_when_it_flushes_and_others_at_once():
    """The serving worker holds the engine's Waker: its tokens wake their loops in one
    call per loop between ticks; a push from any other thread wakes at once."""
    waker, loops = Waker(), [_Loop(), _Loop()]
    events = [asyncio.Event() for _ in range(3)]
    waker.hold()
    for loop, ev in ((loops[0], events[0]), (loops[0], events[1]), (loops[1], events[2])):
        waker.wake(loop, ev)
    assert not loops[0].calls and not loops[1].calls  # held until the flush
    other = threading.Thread(target=waker.wake, args=(loops[1], asyncio.Event()))
    other.start()
    other.join()
    assert len(loops[1].calls) == 1  # another thread's wake is not held
    waker.flush()
    assert len(loops[0].calls) == 1 and len(loops[1].calls) == 2  # one call per loop
    for loop in loops:
        for fn in loop.calls:
            fn()
    assert all(ev.is_set() for ev in events)
    waker.release()
    waker.wake(loops[0], asyncio.Event())
    assert len(loops[0].calls) == 2  # released: at once again


def test_handle_keeps_events_for_a_late_reader():
    h = RequestHandle("r")
    h._push(StreamEvent(0, 5, "a"))
    h._push(StreamEvent(-1, None, "", finish_reason="stop"), output="out")
    assert [e.token_id for e in h] == [5, None]
    assert h.result(timeout=1) == "out"


def test_the_readme_step_mode_recipe_streams_to_the_end_without_a_worker(tiny_model):
    """README: submit, step(), then `for ev in h:`. Nothing ticks the engine in step
    mode, so iterating used to block forever after the tokens of the first tick."""
    engine = make_engine(tiny_model, max_batch_size=2)
    h = engine.submit([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True),
                      session_id="alice")
    rec = engine.step()
    assert rec.admit.admitted
    events = [ev for ev in h]  # ticks the engine itself, as often as needed
    assert events[-1].finish_reason == "length" and len(h.output.token_ids) == 8
    assert engine.scheduler.is_drained() and not engine.running
    # result() and async iteration do the same
    h2 = engine.submit([4, 5], SamplingParams(max_tokens=5, ignore_eos=True))
    assert h2.result(timeout=5).finish_reason == "length"

    async def read_all(handle):
        return [ev async for ev in handle]

    h3 = engine.submit([6], SamplingParams(max_tokens=3, ignore_eos=True))
    assert asyncio.run(read_all(h3))[-1].finish_reason == "length"

"""Traces: every tick's record, saved to JSON and replayed without a model (SPEC T6).

A `TickRecord` (records.py) says what one tick did. A `Trace` is a run of them
plus the two things the records alone do not carry:

* the engine's configuration (batch size, block pool, KV budget, policy
  weights), so a figure can say "12 of 16 blocks" without an engine;
* one small card per request (session, prompt, max_tokens, arrival tick and,
  once it is done, its output and finish reason), so the timeline can draw a
  request from the tick it arrived, including one refused at submit (G1),
  which never reaches a tick.

    rec = engine.step()                 # one TickRecord
    rec.to_dict()                       # plain JSON-friendly data

    recorder = TraceRecorder(engine)    # sets engine.trace = [] and watches submits
    recorder.submit([1, 2, 3], SamplingParams(max_tokens=4), session_id="alice")
    recorder.run()                      # ticks until the engine is idle
    trace = recorder.trace()
    trace.save("run.json")
    Trace.load("run.json").ticks[-1]    # the same TickRecord, no model needed

Everything here reads public attributes and public methods; nothing here
changes what the engine does.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import records
from ..records import AdmitRecord, DecodeRecord, EvictRecord, PrefillRecord, TickRecord
from ..sampling import SamplingParams

TRACE_VERSION = 1

# What happened to one request in one tick: the states the timeline draws.
QUEUED, HELD, PREFILL, PREFILL_WAIT, DECODE, FINISHED, REJECTED, PREEMPTED = (
    "queued", "held", "prefill", "prefill wait", "decode", "finished", "rejected", "preempted")
REMOTE = "on prefill worker"  # disaggregated: its prompt is computed in another process
STATES = (QUEUED, HELD, PREFILL, PREFILL_WAIT, REMOTE, DECODE, FINISHED, REJECTED, PREEMPTED)


def tick_from_dict(d: dict[str, Any]) -> TickRecord:
    """Rebuild a TickRecord from `TickRecord.to_dict()` (or its JSON)."""
    d = dict(d)
    return TickRecord(
        admit=AdmitRecord(**d.pop("admit")), prefill=PrefillRecord(**d.pop("prefill")),
        evict=EvictRecord(**d.pop("evict")), decode=DecodeRecord(**d.pop("decode")), **d)


def engine_config(engine) -> dict[str, Any]:
    """The engine's config as plain data, plus the sizes it derived at construction."""
    cfg = dataclasses.asdict(engine.config)
    cfg.update(num_blocks=engine.num_blocks, kv_budget_tokens=engine.scheduler.kv_budget_tokens,
               max_model_len=engine.max_model_len, model_name=engine.model_name)
    return cfg


@dataclass
class Trace:
    """A recorded run: config, one TickRecord per tick, one card per request."""

    config: dict[str, Any] = field(default_factory=dict)
    ticks: list[TickRecord] = field(default_factory=list)
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> card (see module doc)
    version: int = TRACE_VERSION

    # --- building --------------------------------------------------------------------------
    @classmethod
    def from_engine(cls, engine, handles=None) -> Trace:
        """A trace of `engine.trace` (the list it appends to when set). `handles`: optional
        `RequestHandle`s, whose outputs fill the request cards."""
        trace = cls(config=engine_config(engine), ticks=list(engine.trace or []))
        for h in handles or []:
            trace.requests[h.request_id] = output_card(h)
        return trace

    # --- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "config": self.config,
                "ticks": [t.to_dict() for t in self.ticks], "requests": self.requests}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        if d.get("version", TRACE_VERSION) > TRACE_VERSION:
            raise ValueError(f"trace version {d['version']} is newer than this minserve "
                             f"reads ({TRACE_VERSION}); upgrade minserve")
        return cls(config=dict(d.get("config", {})),
                   ticks=[tick_from_dict(t) for t in d.get("ticks", [])],
                   requests={k: dict(v) for k, v in d.get("requests", {}).items()},
                   version=d.get("version", TRACE_VERSION))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_dict(json.loads(Path(path).read_text()))

    # --- views -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ticks)

    def __getitem__(self, i: int) -> TickRecord:
        return self.ticks[i]

    def request_ids(self) -> list[str]:
        """Every request the trace knows, by arrival tick (then submit order)."""
        first: dict[str, int | None] = {rid: c.get("arrival_tick") for rid, c in self.requests.items()}
        for rec in self.ticks:
            for rid in _ids_in(rec):
                if first.get(rid) is None:
                    first[rid] = rec.tick  # not submitted through a recorder: first mention
        return sorted(first, key=lambda rid: first[rid] or 0)  # stable: ties keep submit order

    def session_of(self, request_id: str) -> str | None:
        card = self.requests.get(request_id)
        if card and card.get("session") is not None:
            return card["session"]
        for rec in self.ticks:
            if request_id in rec.requests:
                return rec.requests[request_id]["session"]
        return None


def _ids_in(rec: TickRecord):
    yield from (a["request_id"] for a in rec.admit.admitted)
    if rec.admit.held:
        yield rec.admit.held["request_id"]
    yield from (r["request_id"] for r in rec.admit.rejected)
    yield from rec.admit.cancelled
    yield from (c["request_id"] for c in rec.prefill.chunks)
    yield from (e["request_id"] for e in rec.evict.evicted)
    yield from rec.decode.rows
    for q in ("pending", "prefilling", "active"):
        yield from rec.queues.get(q, [])


def output_card(handle) -> dict[str, Any]:
    """What a finished handle says about its request (empty fields while it runs)."""
    out = handle.output
    if out is None:
        return {"request_id": handle.request_id}
    return {"request_id": handle.request_id, "prompt_token_ids": list(out.prompt_token_ids),
            "prompt_len": len(out.prompt_token_ids), "output_token_ids": list(out.token_ids),
            "text": out.text, "finish_reason": out.finish_reason, "rejection": out.rejection,
            "num_cached_tokens": out.num_cached_tokens}


class TraceRecorder:
    """Step an engine and keep everything a replay needs.

    `submit` is `engine.submit` plus a card (session, prompt length, arrival tick);
    `step` / `run` are `engine.step` in a loop. Requests submitted straight to the
    engine still show up in the trace, from the first tick that mentions them.
    Step mode only: do not use it while the engine's worker thread runs.
    """

    def __init__(self, engine) -> None:
        if engine.running:
            raise RuntimeError("TraceRecorder drives step mode; stop the engine's worker first")
        self.engine = engine
        if engine.trace is None:
            engine.trace = []
        self.handles: dict[str, Any] = {}
        self.cards: dict[str, dict[str, Any]] = {}

    @property
    def ticks(self) -> list[TickRecord]:
        return self.engine.trace

    def submit(self, prompt, sampling=None, *, session_id: str = "default", priority: int = 0,
               request_id: str | None = None):
        """`engine.submit`, remembering when the request arrived. Returns its handle."""
        # The first tick whose admit phase can see it (TickRecord.tick counts from 1).
        arrival = self.engine.scheduler.tick_count + 1
        h = self.engine.submit(prompt, sampling, session_id=session_id, priority=priority,
                               request_id=request_id)
        ids = self.engine.encode(prompt)
        self.handles[h.request_id] = h
        self.cards[h.request_id] = {
            "request_id": h.request_id, "session": str(session_id), "priority": int(priority),
            "prompt_len": len(ids), "max_tokens": (sampling or SamplingParams()).max_tokens,
            "arrival_tick": arrival, "prompt": prompt if isinstance(prompt, str) else None}
        return h

    def step(self) -> TickRecord:
        return self.engine.step()

    def run(self, max_ticks: int = 10_000) -> int:
        """Tick until the engine is idle (or `max_ticks`); return the ticks run."""
        n = 0
        while n < max_ticks and self.engine.scheduler.has_work():
            self.step()
            n += 1
        return n

    def trace(self) -> Trace:
        """A snapshot of the run so far (later ticks do not change it)."""
        t = Trace.from_engine(self.engine)
        for rid, card in self.cards.items():
            t.requests[rid] = {**card, **{k: v for k, v in output_card(self.handles[rid]).items()
                                          if v is not None}}
        return t


def snapshot_record(engine, admit: AdmitRecord | None = None,
                    prefill: PrefillRecord | None = None, evict: EvictRecord | None = None,
                    decode: DecodeRecord | None = None, tick: int | None = None) -> TickRecord:
    """The engine *now*, as a TickRecord (see `records.snapshot`): the phase
    records given so far, empty ones for the phases not run yet. For drawing a tick
    half-way (after T1, after T2, ...)."""
    return records.snapshot(engine.scheduler, admit, prefill, evict, decode, tick=tick)


def request_states(trace: Trace) -> dict[str, list[dict[str, Any]]]:
    """What each request did in each tick, from the records alone (the timeline's data).

    Returns `{request_id: [{"tick", "state", "detail"}, ...]}` in tick order; a tick
    can hold two events for one request (monolithic prefill then decode in the same
    tick: T2 before T4). States: queued, held (with the gate), prefill (the chunk's
    token range), prefill wait (chunked: no budget left this tick), on prefill worker
    (disaggregated: its prompt is computed in the worker process this tick, or queued
    there; its final "prefill" event is the tick its KV was moved in and it was
    promoted), decode, finished (with the reason), rejected (with the gate), preempted
    (admission="preempt": its KV was dropped before the tick's decode; or, with shares,
    taken back in T1 for a tenant owed a row; it waits in pending to be recomputed).
    """
    events: dict[str, list[dict[str, Any]]] = {rid: [] for rid in trace.request_ids()}

    def add(rid: str, tick: int, state: str, detail: str = "") -> None:
        events.setdefault(rid, []).append({"tick": tick, "state": state, "detail": detail})

    for rid, card in trace.requests.items():  # refused at submit (G1): never in a tick
        rej = card.get("rejection")
        if rej and rej.get("gate") == "G1":
            add(rid, card.get("arrival_tick") or 1, REJECTED, f"G1 {rej.get('reason', '')}")
    arrived = {rid: c["arrival_tick"] for rid, c in trace.requests.items()
               if c.get("arrival_tick") is not None}
    for rec in trace.ticks:
        t = rec.tick
        touched: set[str] = set()
        held = rec.admit.held["request_id"] if rec.admit.held else None
        for r in rec.admit.rejected:
            j = r["rejection"]
            add(r["request_id"], t, REJECTED, f"{j['gate']} {j['reason']}")
            touched.add(r["request_id"])
        for rid in rec.admit.cancelled:
            add(rid, t, FINISHED, "cancelled")
            touched.add(rid)
        remote = rec.prefill.remote
        moved = remote.get("transfers") or {}
        for c in rec.prefill.chunks:  # disaggregated: pieces the prefill worker finished
            # (the last one is drawn as prefill here: its KV moves in at this tick)
            remote_piece = c.get("on_worker") and not c["final"]
            add(c["request_id"], t, REMOTE if remote_piece else PREFILL,
                f"tokens {c['start']}..{c['end']}" + (" (last)" if c["final"] else "")
                + (" done on the prefill worker" if remote_piece else "")
                + (f" on the prefill worker; {transfer_words(moved[c['request_id']])}"
                   if moved.get(c["request_id"]) else ""))
            touched.add(c["request_id"])
        for e in rec.evict.evicted:
            add(e["request_id"], t, FINISHED, e["finish_reason"])
            touched.add(e["request_id"])
        for p in rec.admit.reclaimed + rec.decode.preempted:  # taken back in T1 (H6), or T4
            add(p["request_id"], t, PREEMPTED, f"{p['released_tokens']} tokens of KV "
                f"released after {p['tokens_so_far']} tokens; {p['why']}")
            touched.add(p["request_id"])
        for rid in rec.decode.rows:
            add(rid, t, DECODE, f"pos {rec.decode.positions.get(rid, '')}")
            touched.add(rid)
        worker = {j["request_id"]: j for j in
                  rec.backend.get("prefill_worker", {}).get("on_worker", [])}
        for rid in rec.queues.get("prefilling", []):
            if rid in touched:
                continue
            if rid in remote.get("on_worker", []) or rid in worker:
                job = worker.get(rid)
                add(rid, t, REMOTE, ("being computed" if job and job["started"] else "queued")
                    + (", sent this tick" if rid in remote.get("sent", []) else ""))
            elif rid in remote.get("waiting", {}):
                add(rid, t, PREFILL_WAIT, f"not sent to the prefill worker: {remote['waiting'][rid]}")
            else:
                add(rid, t, PREFILL_WAIT, "no chunk this tick")
            touched.add(rid)
        if held is not None and held not in touched:
            j = rec.admit.held["rejection"]
            add(held, t, HELD, f"{j['gate']}: {j['message']}")
            touched.add(held)
        for rid in rec.queues.get("pending", []):
            if rid not in touched and arrived.get(rid, 0) <= t:
                add(rid, t, QUEUED, "waiting in pending")
    return {rid: ev for rid, ev in events.items() if ev}


def service_by_session(trace: Trace) -> dict[str, list[float]]:
    """Cumulative weighted service per session after each tick (SPEC P3), from the records:
    `w_in * prompt tokens computed + w_out * output tokens`. Works for every policy."""
    w_in = float(trace.config.get("fair_w_in", 1.0))
    w_out = float(trace.config.get("fair_w_out", 2.0))
    sessions = {rid: trace.session_of(rid) for rid in trace.request_ids()}
    totals: dict[str, float] = {s: 0.0 for s in sessions.values() if s is not None}
    series: dict[str, list[float]] = {s: [] for s in totals}
    for rec in trace.ticks:
        for c in rec.prefill.chunks:
            # the final chunk also samples the first output token
            totals[sessions[c["request_id"]]] += (w_in * (c["end"] - c["start"])
                                                   + (w_out if c["final"] else 0.0))
        for rid in rec.decode.rows:  # one output token per decode row
            totals[sessions[rid]] += w_out
        for s in series:
            series[s].append(totals[s])
    return series


# --- text views: what a notebook prints (deterministic, so nbval can check it) --------------
def describe_phase(rec) -> str:
    """One line per phase record: what it did, in the words of SPEC T1-T4."""
    if isinstance(rec, AdmitRecord):
        parts = [f"admitted {a['request_id']} (reserved {a['reserved']}, "
                 f"cached {a['cached_tokens']})" for a in rec.admitted]
        if rec.held:
            parts.append(f"held {rec.held['request_id']} at the head "
                         f"({_why(rec.held['rejection'])})")
        parts += [f"rejected {r['request_id']} ({_why(r['rejection'])})" for r in rec.rejected]
        parts += [f"dropped {rid} (cancelled)" for rid in rec.cancelled]
        return "T1 admit_pending:        " + ("; ".join(parts) or "nothing waiting")
    if isinstance(rec, PrefillRecord):
        moved = rec.remote.get("transfers") or {}
        parts = [f"{c['request_id']} tokens {c['start']}..{c['end']}"
                 + (f" on the prefill worker ({transfer_words(moved[c['request_id']])})"
                    if moved.get(c["request_id"]) else
                    " done on the prefill worker" if c.get("on_worker") else "")
                 + (f" (last chunk, first token {c['first_token']})" if c["final"] else "")
                 for c in rec.chunks]
        if rec.promoted:
            parts.append("promoted to active: " + ", ".join(rec.promoted))
        parts += remote_words(rec.remote)
        return "T2 advance_prefill_chunk: " + ("; ".join(parts) or "nothing to prefill")
    if isinstance(rec, EvictRecord):
        parts = [f"{e['request_id']} ({e['finish_reason']}, released {e['released_tokens']} "
                 f"KV tokens)" for e in rec.evicted]
        return "T3 evict_finished:       " + ("; ".join(parts) or "nothing finished")
    if isinstance(rec, DecodeRecord):
        if not rec.rows:
            return "T4 decode_step:          no active rows"
        toks = ", ".join(f"{rid} -> {rec.tokens[rid]} @{rec.positions[rid]}" for rid in rec.rows)
        done = "; finished: " + ", ".join(f"{k} ({v})" for k, v in rec.finished.items()) \
            if rec.finished else ""
        return f"T4 decode_step:          {len(rec.rows)} rows [{toks}]{done}"
    raise TypeError(f"not a phase record: {type(rec).__name__}")


def transfer_words(t: dict[str, Any]) -> str:
    """One remote prefill's cost in words: the worker's forward, then the move of its KV
    into the row's own blocks at `_promote_to_decode` (SPEC C2, C3)."""
    words = (f"computed there in {t['worker_ms']:.1f} ms; KV moved in: {t['blocks']} "
             f"block{'s' if t['blocks'] != 1 else ''}, {t['bytes']:,} bytes in {t['ms']:.2f} ms")
    if t.get("bytes_to_worker"):
        words += f"; its cached prefix sent there first: {t['bytes_to_worker']:,} bytes"
    return words


def remote_words(remote: dict[str, Any]) -> list[str]:
    """disaggregated (`PrefillRecord.remote`): who was sent to the prefill worker this
    tick, who waits to be sent (and why), who is on the worker now."""
    if not remote:
        return []
    parts = []
    if remote.get("sent"):  # one forward there: each row's piece
        pieces = remote.get("pieces", {})
        parts.append("sent to the prefill worker: " + ", ".join(
            f"{rid} tokens {pieces[rid][0]}..{pieces[rid][1]}" if rid in pieces else rid
            for rid in remote["sent"]) + (f" (one forward of {remote['forward_tokens']} tokens)"
                                          if remote.get("forward_tokens") else ""))
    parts += [f"{rid} waits to be sent ({why})" for rid, why in remote.get("waiting", {}).items()]
    if remote.get("on_worker"):
        parts.append("on the prefill worker: " + ", ".join(remote["on_worker"]))
    return parts


def worker_words(worker: dict[str, Any]) -> str:
    """The prefill worker now, from a TickRecord's `backend["prefill_worker"]` snapshot:
    the prompts on it (computing, or queued behind another), KV arrived and not yet
    spliced, its staging pool. No pid, no clock: the same run prints the same line."""
    if worker.get("broken"):
        return f"prefill worker: broken: {worker['broken']}"
    jobs = [f"{j['request_id']} ({j['tokens']} tokens, {j.get('computed', 0)} computed, "
            + ("abandoned: its pieces there dropped" if j.get("abandoned") else
               "a piece being computed" if j["started"] else
               "a piece queued" if j.get("sent", 0) > j.get("computed", 0) else "not sent")
            + ")" for j in worker["on_worker"]]
    state = "" if worker.get("alive", True) else " (not running)"
    line = f"prefill worker{state}: " + ("; ".join(jobs) if jobs else "no prompt on it")
    if worker.get("arrived"):
        line += "; KV arrived, spliced in at the next T2: " + ", ".join(worker["arrived"])
    return (line + f"; staging blocks in use {worker['staging_blocks_used']}/"
            f"{worker['staging_blocks']}")


def _why(rejection: dict[str, Any]) -> str:
    """'G2 kv_budget: need=10, active_kv_reserved=36, kv_budget_tokens=40' (SPEC G6).
    The gate, its reason code and its numbers: stable data, unlike the message's wording."""
    nums = ", ".join(f"{k}={v}" for k, v in rejection.get("numbers", {}).items())
    return f"{rejection['gate']} {rejection['reason']}" + (f": {nums}" if nums else "")


def describe_tick(rec: TickRecord) -> str:
    """A tick in five lines: the four phases, then the queues and the reservation (R1)."""
    q = rec.queues
    return "\n".join([f"tick {rec.tick}"] + [
        "  " + describe_phase(p) for p in (rec.admit, rec.prefill, rec.evict, rec.decode)] + [
        f"  queues: pending {q.get('pending', [])}  prefilling {q.get('prefilling', [])}  "
        f"active {q.get('active', [])}  |  active_kv_reserved {rec.active_kv_reserved}"])

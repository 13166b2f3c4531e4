"""Lab 2: the gates G1, G2, G3 (SPEC G1-G6). The student's three functions replace
`minserve/gates.py`'s in one engine (`Scheduler.gates`); the scheduler keeps calling them
at the same points, with the same numbers."""

from __future__ import annotations

from types import SimpleNamespace

from .. import gates as core_gates
from ..engine import Engine
from ..request import Rejection
from ..sampling import SamplingParams
from .allowlist import Cell
from .common import drain, fail, secret_rng, show, student, tiny_engine
from .guard import guarded_check

WHERE = "the gate table in docs/gates.md (G1-G6) and notebook 05_backpressure_gates.ipynb"
NAMES = ("check_queue_capacity", "check_kv_budget", "check_block_pool")


def reference():
    """What a submission may not lean on: minserve's own gate functions."""
    return [(core_gates, NAMES, "gates")]


def use_gates(engine: Engine, **fns) -> Engine:
    """Plug the student's gate functions into this engine only; the rest stay minserve's."""
    unknown = set(fns) - set(NAMES)
    if unknown:
        raise ValueError(f"not a gate: {sorted(unknown)}; use {NAMES}")
    table = {name: getattr(core_gates, name) for name in dir(core_gates) if not name.startswith("_")}
    wrapped = {name: _as_student(name, fn) for name, fn in fns.items()}
    engine.scheduler.gates = SimpleNamespace(**{**table, **wrapped})
    return engine


def _as_student(name: str, fn):
    """A gate the scheduler calls: a crash or a stub in it becomes one LabCheckFailed that
    names the gate and its input."""
    def gate(*args, **kwargs):
        return student(fn, *args, name=name, where=f"{name}; {WHERE}", **kwargs)
    return gate


def _verdict(fn, name: str, args: dict, expect: tuple[str, str, bool] | None) -> None:
    """Call a gate; compare with (gate, reason, hard) or None (pass)."""
    got = student(fn, name=name, where=WHERE, **args)
    call = f"{name}({', '.join(f'{k}={v}' for k, v in args.items())})"
    if expect is None:
        if got is not None:
            fail(f"{call} returned {got!r}; it should pass (None): the request fits",
                 f"{name}; {WHERE}")
        return
    gate, reason, hard = expect
    if not isinstance(got, Rejection):
        fail(f"{call} returned {got!r}; expected a Rejection(gate={gate!r}, reason={reason!r}, "
             f"hard={hard})", f"{name}; {WHERE}")
    if (got.gate, got.reason, got.hard) != expect:
        fail(f"{call} returned gate={got.gate!r}, reason={got.reason!r}, hard={got.hard}; "
             f"expected gate={gate!r}, reason={reason!r}, hard={hard} "
             f"({'refuse: it can never fit' if hard else 'hold: it fits once room opens'})",
             f"{name}; {WHERE}")
    missing = [k for k, v in args.items() if got.numbers.get(k) != v]
    if missing or not got.message:
        fail(f"{call}: the rejection must carry a message and the numbers that decided it "
             f"(G6); numbers={got.numbers!r} lacks {missing}", f"{name}; {WHERE}")


@guarded_check(20, reference, WHERE)
def check_g1(fn) -> None:
    _verdict(fn, "check_queue_capacity", {"pending": 3, "max_queue_size": 3}, ("G1", "queue_full", True))
    _verdict(fn, "check_queue_capacity", {"pending": 2, "max_queue_size": 3}, None)


@guarded_check(20, reference, WHERE)
def check_g2(fn) -> None:
    name = "check_kv_budget"
    _verdict(fn, name, {"need": 50, "reserved": 0, "budget": 40}, ("G2", "kv_budget_exceeded", True))
    _verdict(fn, name, {"need": 10, "reserved": 36, "budget": 40}, ("G2", "kv_budget", False))
    _verdict(fn, name, {"need": 4, "reserved": 36, "budget": 40}, None)
    # a hard reject wins even when the reservation is full too
    _verdict(fn, name, {"need": 41, "reserved": 39, "budget": 40}, ("G2", "kv_budget_exceeded", True))


@guarded_check(20, reference, WHERE)
def check_g3(fn) -> None:
    name = "check_block_pool"
    _verdict(fn, name, {"blocks_needed": 8, "free_blocks": 6, "prompt_blocks": 8, "num_blocks": 6},
             ("G3", "prompt_exceeds_block_pool", True))
    _verdict(fn, name, {"blocks_needed": 3, "free_blocks": 0, "prompt_blocks": 3, "num_blocks": 6},
             ("G3", "block_pool", False))
    _verdict(fn, name, {"blocks_needed": 2, "free_blocks": 2, "prompt_blocks": 3, "num_blocks": 6}, None)


@guarded_check(60, reference, WHERE)
def gate_story(g1, g2, g3, budget: int = 40, sizes=((12, 8), (10, 6), (6, 4), (40, 10))) -> list[dict]:
    """docs/gates.md's G2 story in a real engine with the student's gates: requests of
    (prompt, max_tokens) `sizes` into a KV budget of `budget` tokens. Returns the events."""
    engine = use_gates(tiny_engine(max_batch_size=4, kv_budget_tokens=budget, max_queue_size=4,
                                   enable_prefix_caching=False),
                       check_queue_capacity=g1, check_kv_budget=g2, check_block_pool=g3)
    handles = [student(engine.submit, list(range(10 * i + 1, 10 * i + 1 + p)),
                       SamplingParams(max_tokens=n), name="a gate (called by submit)", where=WHERE)
               for i, (p, n) in enumerate(sizes)]
    extra = student(engine.submit, [5, 6, 7], SamplingParams(max_tokens=2),  # full queue: G1
                    name="check_queue_capacity (called by submit)", where=WHERE)
    drain(engine, WHERE)
    events = []
    for rec in engine.trace:
        if rec.admit.held:
            r = rec.admit.held["rejection"]
            events.append({"tick": rec.tick, "held": rec.admit.held["request_id"], "gate": r["gate"]})
        for x in rec.admit.rejected:
            events.append({"tick": rec.tick, "refused": x["request_id"], "gate": x["rejection"]["gate"]})
    if extra.output.finish_reason != "error" or (extra.output.rejection or {}).get("gate") != "G1":
        fail("a fifth request submitted to a full queue (max_queue_size=4) was not refused by "
             "G1 at submit", f"check_queue_capacity; {WHERE}")
    return check_story(handles, events, budget, sizes)


def check_story(handles, events, budget: int, sizes) -> list[dict]:
    """The first two run, the third is held (soft) until one finishes, the fourth (more than
    the whole budget) is refused (hard); the messages use this story's own numbers."""
    held = [e for e in events if "held" in e]
    refused = [e for e in events if "refused" in e]
    third, fourth = handles[2].request_id, handles[3].request_id
    (p0, n0), (p1, n1), (p2, n2), (p3, n3) = sizes[:4]
    if not any(e["held"] == third and e["gate"] == "G2" for e in held):
        fail(f"{third} needs {p2 + n2} tokens while {p0 + n0} + {p1 + n1} of the {budget} are "
             f"reserved: G2 should hold it (soft) until a running request finishes; holds "
             f"seen: {held}", f"check_kv_budget; {WHERE}")
    if [(e["refused"], e["gate"]) for e in refused] != [(fourth, "G2")]:
        fail(f"{fourth} needs {p3 + n3} tokens of a {budget}-token budget: G2 should refuse it "
             f"(hard), and nothing else; refusals seen: {refused}", f"check_kv_budget; {WHERE}")
    if any(h.output.finish_reason == "error" for h in handles[:3]):
        fail("a request that fits was refused", WHERE)
    return events


# ------------------------------------------------------------------ hidden: against the engine
CONTRACT = {
    "check_queue_capacity": "G1 refuses (hard, queue_full) when pending >= max_queue_size, "
                            "however far beyond it pending already is (preempted rows come "
                            "back to pending without passing G1); else it passes (None).",
    "check_kv_budget": "G2 refuses (hard, kv_budget_exceeded) when need > budget: it can never "
                       "fit; else holds (soft, kv_budget) when reserved + need > budget; else "
                       "passes (None). Exactly full (reserved + need == budget) passes.",
    "check_block_pool": "G3 refuses (hard, prompt_exceeds_block_pool) when prompt_blocks > "
                        "num_blocks; else holds (soft, block_pool) when blocks_needed > "
                        "free_blocks; else passes (None). Exactly full passes.",
    "numbers": "a rejection carries a message and the numbers that decided it, under the "
               "names of the gate's own arguments (G6).",
}


def _lab_verdict(args: dict):
    """canon of a gate's answer under the lab's contract: None, or (gate, reason, hard,
    whether its numbers hold the call's inputs and it has a message). Field types are
    checked exactly: a look-alike answer is named for what it is."""
    from .differential import WrongKind

    def canon(got):
        if got is None:
            return None
        if not isinstance(got, Rejection):
            raise WrongKind(f"{show(got)}, which is neither None nor a Rejection")
        fields = (got.gate, got.reason, got.hard)
        if not (type(got.gate) is str and type(got.reason) is str and type(got.hard) is bool):
            raise WrongKind(f"a Rejection whose gate, reason, hard are {fields!r}")
        numbers = got.numbers if type(got.numbers) is dict else {}
        missing = sorted(k for k, v in args.items() if numbers.get(k) != v)
        said = "numbers hold the inputs" if not missing else f"numbers lack {missing}"
        message = "with a message" if type(got.message) is str and got.message else "no message"
        return (*fields, said, message)

    return canon


def _engine_verdict(got):
    """The engine's answer in the lab's terms (its numbers use the engine's own names)."""
    if got is None:
        return None
    return (got.gate, got.reason, got.hard, "numbers hold the inputs", "with a message")


def _near(base: int, arg: int) -> tuple[int, int]:
    """A number at, just below, just above or far from `base` (never negative)."""
    from .differential import choose

    d, arg = choose((0, 0, -1, 1, -2, 3, 17, -base), arg)
    return max(0, base + d), arg


def _machine():
    from .differential import Differential, choose

    class Machine(Differential):
        g1: object
        g2: object
        g3: object
        OPS = ((1, "g1"), (2, "g2"), (2, "g3"))

        def _gate(self, name, fn, args):
            text = f"{name}({', '.join(f'{k}={v}' for k, v in args.items())})"
            self.call(text, lambda: getattr(core_gates, name)(*args.values()),
                      lambda: fn(**args), ref_canon=_engine_verdict, sub_canon=_lab_verdict(args),
                      sentence=f"{CONTRACT[name]} {CONTRACT['numbers']}",
                      where=f"{name}; {WHERE}")

        def op_g1(self, arg):
            size, arg = choose((1, 2, 3, 4, 8, 64), arg)
            pending, _ = _near(size, arg)
            self._gate("check_queue_capacity", self.g1,
                       {"pending": pending, "max_queue_size": size})

        def op_g2(self, arg):
            budget, arg = choose((8, 16, 40, 64, 100), arg)
            # the whole budget twice as often: a need that exactly fits is the boundary
            # students move (>= for >)
            need, arg = _near(choose((budget, budget, budget // 2, 1, budget // 3), arg)[0],
                              arg // 5)
            room, arg = choose((budget - need, budget - need, 0, budget, need), arg)
            reserved, _ = _near(max(0, room), arg)
            self._gate("check_kv_budget", self.g2,
                       {"need": need, "reserved": reserved, "budget": budget})

        def op_g3(self, arg):
            pool, arg = choose((1, 4, 6, 8, 32), arg)
            prompt, arg = _near(pool, arg)
            free, arg = choose((pool, 0, pool // 2, 1), arg)
            needed, _ = _near(choose((free, prompt, 1), arg)[0], arg >> 2)
            self._gate("check_block_pool", self.g3,
                       {"blocks_needed": needed, "free_blocks": min(free, pool),
                        "prompt_blocks": prompt, "num_blocks": pool})

    return Machine


@guarded_check(60, reference, WHERE)
def check_against_the_engine(g1, g2, g3, hidden) -> None:
    """Hidden: the three gates beside minserve's own on random calls drawn from the
    instructor's secret, biased to the boundaries (exactly full, one over, far over, a
    queue already beyond its size, a prompt as big as the pool): the same verdict every
    time (gate, reason, hard), with the call's numbers and a message."""
    from .differential import run

    run(_machine(), hidden, "lab2/gates", piece="your gates", reference="minserve's own gates",
        where=WHERE, bind={"g1": g1, "g2": g2, "g3": g3}, examples=100, steps=20)


# what the graded cell defines and may use (allowlist.py; grading runs it alone)
CELL = Cell(names=NAMES, provided=lambda: {"Rejection": Rejection},
            imports={"minserve.request": frozenset({"Rejection"})})

# similarity.py: three `if`s per gate are the same tokens whoever writes them (honest
# answers measure up to 0.98 against minserve/gates.py): measured, never flagged
SIMILARITY_THRESHOLD = None


def hidden_story(hidden, label: str = "story") -> dict:
    """gate_story's arguments drawn from the instructor's secret: a budget and four
    (prompt, max_tokens) that keep the story (the first two fit together, the third fits
    after either finishes but not beside both, the fourth exceeds the whole budget)."""
    rng = secret_rng(hidden.seed, f"lab2/{label}")
    budget = rng.randint(30, 90)
    first = rng.randint(budget // 4, budget // 2 - 2)
    second = rng.randint(budget // 4, budget - first - 2)
    third = rng.randint(budget - first - second + 1, budget - max(first, second))
    fourth = rng.randint(budget + 1, budget + 30)

    def split(total):
        out = rng.randint(1, max(1, total // 3))
        return (total - out, out)

    return {"budget": budget, "sizes": tuple(split(t) for t in (first, second, third, fourth))}

"""Hidden checks that run the submission beside the engine's reference (SPEC L1).

Hand-picked hidden cases check the mistakes someone thought of. These checks do not pick:
Hypothesis draws random sequences of the piece's operations (arrivals, peeks, picks,
removes, allocations, frees, splices ...) from the instructor's secret, with inputs each
lab's machine biases toward what students get wrong (ties, negative priorities,
re-arrivals, exactly full pools, a prompt exactly as wide as the batch, unknown ids).
Each operation goes to the submission and to the engine's own implementation of the
piece, on objects of their own; after every operation what each returned or raised, and
every observable of its state (len, iteration order, counters, block tables, masks ...),
must be the same. On a difference Hypothesis shrinks the sequence, and the message shows
the shortest one found, what the reference did, what the submission did and the sentence
of the lab's contract it breaks.

    hidden = Hidden(seed_of(secret, lab))
    run(Machine, hidden, "lab1/fcfs", piece=..., reference=..., where=...,
        bind={"submission": FCFSLab})            # LabCheckFailed on a difference

How a sequence is drawn. A sequence is a list of integers, one per operation, that
Hypothesis draws and shrinks (`st.lists(st.integers(...))`: deleting an element deletes an
operation, a smaller integer is a simpler one); the lab's machine decodes each integer
into an operation and its inputs (`Differential.apply`). This is Hypothesis's stateful
testing in its cheapest form: one draw per operation, where `RuleBasedStateMachine`
makes several (a rule, its arguments, its preconditions), which cost about ten times
more per step; grading must stay under ten seconds a submission.

Values are compared as plain data: a machine turns what each side returned into ids,
numbers and lists before comparing (`canon`), never trusting the submission's own `==`.

Bounded: every call into the submission has a time limit (a loop that never ends is a
difference like any other: the reference returned, the submission did not); the number
of sequences is fixed (so whether a submission passes never depends on the machine's
speed); shrinking has a budget in seconds, after which the shortest sequence found so
far is shown.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .common import LabCheckFailed, alarm, fail, make_req, show


# ------------------------------------------------------------------ the secret, as a seed
def seed_of(secret: str, lab: str) -> int:
    """The seed a lab's hidden checks draw from: a hash of the instructor's secret. The
    grader passes this number, never the secret, to the process that runs a submission."""
    return int(hashlib.sha256(f"{secret}\x00{lab}".encode()).hexdigest()[:16], 16)


@dataclass(eq=False)
class Hidden:
    """What a hidden test draws from: `seed` (seed_of the secret) and how many random
    sequences each differential check tries (`scale` multiplies every check's own count:
    1 when grading; `make test` uses less). Its repr shows neither the seed nor any
    input: a hidden test's message quotes the test's line, never what it was called with.
    `memo` keeps each check's outcome, so a lab's hidden tests that rerun one check pay
    for it once."""

    seed: int
    scale: float = 1.0
    shrink: bool = True  # False: report the first failing sequence as found (a detection count)
    memo: dict = field(default_factory=dict)

    def seed_for(self, label: str) -> int:
        return int(hashlib.sha256(f"{self.seed}\x00{label}".encode()).hexdigest()[:16], 16)

    def examples(self, n: int) -> int:
        return max(1, round(n * self.scale))

    def __repr__(self) -> str:
        return f"Hidden(scale={self.scale:g})"


# ------------------------------------------------------------------ one call, bounded
class Hang(BaseException):
    """The submission did not return in time. A BaseException, so that no `except
    Exception` in the submission swallows it."""


def call_limit(seconds: float) -> contextlib.AbstractContextManager:
    """Raise Hang if the block runs longer than `seconds` (common.alarm: main thread only;
    an outer time limit, e.g. guard.guarded_check's, gets what is left of it back)."""

    def expire():
        raise Hang()

    return alarm(seconds, expire)


class WrongKind(ValueError):
    """A submission returned something that is not what the contract asks (canon says what)."""


HUNG = "nothing: it did not return within the time limit"


@dataclass(frozen=True)
class Outcome:
    """What one call did, as plain data: ("returned", value) or ("raised", type name)."""

    kind: str
    value: Any

    def __str__(self) -> str:
        return f"returned {self.value!r}" if self.kind == "returned" else f"raised {self.value}"


def outcome(fn: Callable[[], Any], canon: Callable[[Any], Any], limit: float | None) -> Outcome:
    """Call fn (bounded by `limit` seconds when given); its result through `canon`, or
    the type of what it raised. `canon` raises WrongKind for a result of the wrong kind."""
    try:
        if limit is None:
            value = fn()
        else:
            with call_limit(limit):
                value = fn()
    except Hang:
        return Outcome("raised", HUNG)
    except LabCheckFailed:  # a guard's own message (guard.forbid_reference): said as it is
        raise
    except RecursionError:
        return Outcome("raised", "RecursionError")
    except Exception as e:  # noqa: BLE001 - what the call raised is the observable
        return Outcome("raised", type(e).__name__)
    try:
        return Outcome("returned", canon(value))
    except WrongKind as e:
        return Outcome("returned", f"<{e}>")


def mix(x: int) -> int:
    """A 32-bit integer hash (a bijection): 0 stays 0, neighbours land far apart."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def choose(options: Sequence, arg: int) -> tuple[Any, int]:
    """One of `options`, decoded from a drawn integer, and what is left of the integer for
    the next input (so 0, the simplest integer, is the first option every time)."""
    return options[arg % len(options)], arg // len(options)


def nothing(value: Any) -> None:
    """canon for a hook whose return value the contract leaves free (it returns None)."""
    return None


# ------------------------------------------------------------------ requests, twice
class Twins:
    """The two sides' copies of every request of a sequence: the reference and the
    submission never share an object, so neither can change what the other sees; a
    result is compared as the request id it stands for."""

    def __init__(self) -> None:
        self.ref: dict[str, object] = {}
        self.sub: dict[str, object] = {}
        self._ids: dict[int, str] = {}
        self.fields: dict[str, tuple] = {}

    def add(self, i: int, session: str = "default", prompt: int = 4, out: int = 4,
            priority: int = 0, ref_priority: int | None = None) -> str:
        """Make request i twice (ref_priority: the reference's copy's, if not the same)."""
        ref = make_req(i, session, prompt=prompt, out=out,
                       priority=priority if ref_priority is None else ref_priority)
        sub = make_req(i, session, prompt=prompt, out=out, priority=priority)
        rid = ref.request_id
        self.ref[rid], self.sub[rid] = ref, sub
        self._ids[id(sub)] = rid
        self.fields[rid] = self.snapshot(sub)
        return rid

    @staticmethod
    def snapshot(req) -> tuple:
        return (req.request_id, req.priority, req.arrival_seq, req.session_id,
                tuple(req.prompt_token_ids), req.max_tokens)

    def ref_id(self, value) -> str | None:
        return None if value is None else value.request_id

    def sub_id(self, value) -> str | None:
        """The id of one of the submission's requests, or WrongKind naming what it was."""
        if value is None:
            return None
        rid = self._ids.get(id(value))
        if rid is None:
            raise WrongKind(f"{show(value)}, which is not one of the requests it was given")
        return rid

    def changed(self) -> list[str]:
        """Ids of the submission's requests whose fields are not what they were made with."""
        return [rid for rid, req in self.sub.items() if self.snapshot(req) != self.fields[rid]]



# ------------------------------------------------------------------ the machine
class Divergence(Exception):
    """The submission and the reference differ after a step (Hypothesis shrinks on it)."""

    def __init__(self, steps: list[str], what: str, ref: str, sub: str, sentence: str, where: str):
        super().__init__(what)
        self.steps, self.what, self.ref, self.sub = list(steps), what, ref, sub
        self.sentence, self.where = sentence, where


@dataclass
class Trial:
    """One check's run: who is compared, and every failure seen so far."""

    piece: str  # "your FCFSLab"
    reference: str  # "the engine's FCFSPolicy" (or, without a reference: "the contract")
    where: str
    lead: str = "does not do what {reference} does"
    call_seconds: float = 2.0  # per call into the submission; 0.2 s once one hung
    failures: list[Divergence] = field(default_factory=list)
    sequences: int = 0


class Differential:
    """Base of a lab's machine. A subclass defines `setup(arg)` (build both sides; the
    submission's constructor is the first step of every sequence), `OPS` (weight, name)
    and an `op_<name>(arg)` per operation (arg: an integer its inputs are decoded from),
    and `observe()`: what must agree after every step. Class attributes given to `run`
    as `bind` (the submission's class or functions) are set on a subclass."""

    OPS: Sequence[tuple[int, str]] = ()

    def __init__(self, trial: Trial) -> None:
        self.trial = trial
        self.steps: list[str] = []
        self._table = [name for weight, name in self.OPS for _ in range(weight)]

    def setup(self, arg: int) -> None:
        """Build the reference and the submission; `arg`, the sequence's first drawn
        integer (mixed), chooses whatever a sequence fixes at the start (sizes, weights)."""

    def observe(self) -> list[tuple[str, Any, Any, str, str]]:
        """(what, reference's value, yours, contract sentence, where to look), compared
        after every step, in order: the first difference is reported."""
        return []

    def apply(self, code: int) -> None:
        """Decode one drawn integer into an operation and run it: its bits, mixed (so that
        Hypothesis's many small integers still spread over every operation and input),
        pick the operation (by weight), and the rest are its inputs. 0 is no operation:
        shrinking turns the operations a failure does not need into 0s, which the
        message leaves out."""
        if code == 0:
            return
        code = mix(code)
        name = self._table[code % len(self._table)]
        getattr(self, f"op_{name}")(code // len(self._table))

    # --- what operations call
    @staticmethod
    def read(fn: Callable[[], Any], limit: float | None = 2.0) -> Any:
        """An observable of the submission's state, or what reading it raised (limit None:
        no time limit of its own, inside an operation that has one)."""
        try:
            if limit is None:
                return fn()
            with call_limit(limit):
                return fn()
        except Hang:
            return "raised nothing: reading it did not finish within the time limit"
        except Exception as e:  # noqa: BLE001 - what reading it raised is the observable
            return f"raised {type(e).__name__}"

    def call(self, text: str, ref_fn: Callable[[], Any], sub_fn: Callable[[], Any], *,
             sentence: str, where: str, ref_canon: Callable[[Any], Any] = nothing,
             sub_canon: Callable[[Any], Any] | None = None):
        """One operation on both sides: what each returned or raised must agree, then
        every observable. Returns (the reference's result, the submission's)."""
        self.steps.append(text)
        raw: dict[str, Any] = {}

        def ref_call():
            raw["ref"] = ref_fn()
            return raw["ref"]

        def sub_call():
            raw["sub"] = sub_fn()
            return raw["sub"]

        ref = outcome(ref_call, ref_canon, None)
        sub = outcome(sub_call, sub_canon or ref_canon, self.trial.call_seconds)
        if sub.value == HUNG:
            self.trial.call_seconds = 0.2  # it hung once: shrinking need not wait as long
        if ref != sub:
            self.diverge(f"at step {len(self.steps)}", str(ref), str(sub), sentence, where)
        self.check_observables(sentence, where)
        return raw.get("ref"), raw.get("sub")

    def check_observables(self, sentence: str = "", where: str = "") -> None:
        """Every observable after a step; a difference names the step's own contract
        sentence too (the step broke it) and where to look for the step's hook."""
        for what, ref, sub, obs_sentence, obs_where in self.observe():
            if ref != sub:
                said = obs_sentence if not sentence or sentence == obs_sentence else \
                    f"{sentence} {obs_sentence}"
                self.diverge(f"after step {len(self.steps)}, {what}", _show(ref), _show(sub),
                             said, where or obs_where)

    def expect(self, ok: bool, what: str, want: str, got: str, sentence: str, where: str) -> None:
        """A property of the submission alone (no reference to compare with): `want`
        describes what the contract asks, `got` what it did."""
        if not ok:
            self.diverge(f"after step {len(self.steps)}, {what}", want, got, sentence, where)

    def diverge(self, what: str, ref: str, sub: str, sentence: str, where: str):
        d = Divergence(self.steps, what, ref, sub, sentence, where)
        self.trial.failures.append(d)
        raise d


def _show(value: Any, limit: int = 400) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def message(trial: Trial, d: Divergence) -> str:
    steps = "\n".join(f"    {i}. {s}" for i, s in enumerate(d.steps, 1))
    lead = trial.lead.format(reference=trial.reference)
    first = "the reference:" if trial.lead == Trial.lead else "the contract: "
    return (f"{trial.piece} {lead} on this sequence of calls (the shortest found among "
            f"{trial.sequences} random sequences drawn from the instructor's secret):\n"
            f"{steps}\n"
            f"  {d.what}:\n"
            f"    {first} {d.ref}\n"
            f"    yours:         {d.sub}\n"
            f"  The contract: {d.sentence}")


@contextlib.contextmanager
def shrink_budget(seconds: float) -> Iterator[None]:
    """Hypothesis stops shrinking after MAX_SHRINKING_SECONDS (five minutes by default;
    its engine documents the constant as the one to patch for another budget)."""
    from hypothesis.internal.conjecture import engine

    saved = engine.MAX_SHRINKING_SECONDS
    engine.MAX_SHRINKING_SECONDS = seconds
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = saved


@contextlib.contextmanager
def no_local_constants() -> Iterator[None]:
    """Draw from the seed alone. Hypothesis (6.170 here) now and then draws a literal of the
    "local" modules the process has loaded (those outside site-packages): which lab
    modules grading happened to import, and whether minserve is an editable checkout or
    a wheel, would change the sequences, and so a grade (lab 7's corpus passed once
    lab 5's checks were imported). Its pool of local constants is kept empty meanwhile."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants

        saved, empty = providers._get_local_constants, Constants()
        providers.CONSTANTS_CACHE.cache.clear()
    except (ImportError, AttributeError):  # an older Hypothesis: no such pool
        yield
        return
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = saved
        providers.CONSTANTS_CACHE.cache.clear()


def run(machine: type[Differential], hidden: Hidden, label: str, *, piece: str,
        reference: str, where: str, examples: int = 200, steps: int = 40,
        shrink_s: float = 6.0, bind: dict | None = None, lead: str | None = None,
        least: int = 1) -> None:
    """Run `machine` on `hidden.examples(examples)` random sequences of up to `steps`
    operations (at least `least` sequences whatever the scale), drawn from the seed for
    `label`; `bind` sets class attributes of the
    machine (the submission's class or functions). Raises LabCheckFailed with the
    shortest failing sequence; the outcome is remembered in `hidden.memo`."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
    from hypothesis import strategies as st
    from hypothesis.errors import Flaky

    key = (label, machine, tuple(id(v) for v in (bind or {}).values()))
    if key in hidden.memo:
        if hidden.memo[key] is not None:
            raise LabCheckFailed(hidden.memo[key])
        return
    trial = Trial(piece, reference, where, **({"lead": lead} if lead else {}))
    # functions as staticmethods: a class attribute that is a function would bind `self`
    bound = type(machine.__name__, (machine,), {k: v if isinstance(v, type) else staticmethod(v)
                                                for k, v in (bind or {}).items()})

    @seed(hidden.seed_for(label))
    @settings(max_examples=max(least, hidden.examples(examples)), deadline=None, database=None,
              phases=[Phase.generate, Phase.shrink] if hidden.shrink else [Phase.generate],
              verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck), print_blob=False)
    # at least half the steps: Hypothesis's lists are short on average (about 6 elements),
    # and most mistakes need a dozen operations to show; shrinking zeroes what is not needed
    @given(st.lists(st.integers(0, 0xFFFFFFFF), min_size=steps // 2 + 1, max_size=steps + 1))
    def sequence(codes: list[int]) -> None:
        trial.sequences += 1
        m = bound(trial)
        m.setup(mix(codes[0]))
        for code in codes[1:]:
            m.apply(code)

    found = None
    try:
        with shrink_budget(shrink_s * max(0.5, min(1.0, hidden.scale))), no_local_constants():
            sequence()
    except Divergence as d:
        found = d
    except Flaky:  # a submission that does not do the same twice: the shortest failure seen
        found = min(trial.failures, key=lambda d: len(d.steps)) if trial.failures else None
    except LabCheckFailed as e:
        hidden.memo[key] = str(e)
        raise
    except Exception as e:  # noqa: BLE001 - the machine could not read the submission
        hidden.memo[key] = f"{piece}: the check could not run it: {type(e).__name__}: {e}"
        fail(hidden.memo[key], where)
    text = None if found is None else message(trial, found)
    hidden.memo[key] = None if text is None else f"{text}\n    where to look: {found.where}"
    if text is not None:
        fail(text, found.where)

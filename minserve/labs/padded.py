"""Lab 4: the padded batch's bookkeeping (SPEC R3, B2). The student writes three pure
functions on the attention mask; `LabPaddedBackend` is `PaddedBackend` with its
splice-in, removal and position ids routed through them, so the real engine runs on them.

    splice_in(mask (B, L), n, kv_length) -> (new mask (B+1, W), grow, row_pad)
        grow: columns added on the left of the batch; row_pad: on the left of the new row
    remove(mask (B, L), i, trim) -> (new mask (B-1, L'), keep: row indices kept, first: columns dropped)
    next_positions(mask (B, L)) -> (B, 1) position id of each row's next token

The check replays the mixed workload of `tests/test_padded_backend.py` with
`trim_on_remove=False`: the longest row leaves first, so the mask is wider than
`kv_length` when the next row splices in. Sizing the new mask from `kv_length` then
concatenates tensors of different widths and the row dies: the crash the design records.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backends.padded import PaddedBackend
from ..engine import Engine
from ..sampling import SamplingParams
from .allowlist import TORCH, TORCH_F, Cell
from .common import drain, fail, show, stock_tokens, student, tiny_engine
from .guard import guarded_check

WHERE = ("docs/backends.md (the padded backend, R3: mask width vs kv_length) and notebook "
         "02_padding_and_batched_kv.ipynb")


class LabPaddedBackend(PaddedBackend):
    """PaddedBackend whose mask bookkeeping is three functions a student wrote."""

    def __init__(self, model, splice_in, remove, next_positions, trim_on_remove: bool = False):
        super().__init__(model, storage=None, trim_on_remove=trim_on_remove)
        self.fns = {"splice_in": splice_in, "remove": remove, "next_positions": next_positions}
        self.splices: list[tuple[int, int]] = []  # (mask width, kv_length) before each splice-in

    def _call(self, name, *args):
        return student(self.fns[name], *args, name=name, where=WHERE)

    def promote(self, req) -> None:
        if self.cache is None or not self.row_ids:
            return super().promote(req)  # the first row: its own cache becomes the batch
        row = self.staging.pop(req.request_id)
        n = row.get_seq_length()
        self.splices.append((self.width, self.kv_length))
        mask, grow, row_pad = self._call("splice_in", self.mask, n, self.kv_length)
        for big, small in zip(self.cache.layers, row.layers):  # (B, H_kv, L, D) per layer
            big.keys = torch.cat([F.pad(big.keys, (0, 0, grow, 0)), F.pad(small.keys, (0, 0, row_pad, 0))])
            big.values = torch.cat([F.pad(big.values, (0, 0, grow, 0)),
                                    F.pad(small.values, (0, 0, row_pad, 0))])
        self.mask = mask
        self.row_ids.append(req.request_id)
        self.check_invariants()

    def remove_row(self, req) -> None:
        if self.staging.pop(req.request_id, None) is not None or req.request_id not in self.row_ids:
            return
        i = self.row_ids.index(req.request_id)
        self.row_ids.pop(i)
        if not self.row_ids:
            self.cache, self.mask = None, self.mask[:0, :0]
            return
        mask, keep, first = self._call("remove", self.mask, i, self.trim_on_remove)
        idx = torch.tensor(list(keep), device=self.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[idx, :, first:], layer.values[idx, :, first:]
        self.mask = mask
        self.check_invariants()

    @torch.inference_mode()
    def decode_step_batched(self, reqs, token_ids):
        order = {rid: i for i, rid in enumerate(self.row_ids)}
        col = torch.empty(len(reqs), 1, dtype=torch.long, device=self.device)  # (B, 1)
        for r, t in zip(reqs, token_ids):
            col[order[r.request_id], 0] = t
        pos = self._call("next_positions", self.mask)  # (B, 1)
        self.mask = torch.cat([self.mask, torch.ones_like(col)], dim=1)  # (B, L+1)
        out = self.model(input_ids=col, attention_mask=self.mask, position_ids=pos,
                         use_cache=True, **{self.cache_arg: self.cache})
        logits = out.logits[:, -1].float()
        self.check_invariants()
        return logits[torch.tensor([order[r.request_id] for r in reqs], device=self.device)]


def use_padded(engine: Engine, splice_in, remove, next_positions, trim_on_remove=False) -> Engine:
    """Give a fresh padded engine (prefix caching off) a LabPaddedBackend."""
    if engine.scheduler.has_work() or engine.config.backend != "padded":
        raise ValueError("plug the lab backend into a fresh padded engine")
    engine.scheduler.backend = LabPaddedBackend(engine.model, splice_in, remove, next_positions,
                                                trim_on_remove)
    return engine


@guarded_check(20, where=WHERE)
def check_shapes(splice_in, remove, next_positions) -> None:
    """Small masks by hand: a wider batch, a longer new row, removal with and without trim."""
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    new, grow, pad = student(splice_in, mask, 2, 3, name="splice_in", where=WHERE)
    if (grow, pad) != (0, 1) or new.tolist() != [[0, 1, 1], [1, 1, 1], [0, 1, 1]]:
        fail(f"splice_in(mask=[[0,1,1],[1,1,1]], n=2) gave grow={grow}, row_pad={pad}, mask="
             f"{new.tolist()}; expected grow=0, row_pad=1 and the new row left-padded to "
             "[0,1,1]", f"splice_in; {WHERE}")
    new, grow, pad = student(splice_in, mask, 5, 3, name="splice_in", where=WHERE)
    if (grow, pad) != (2, 0) or new.tolist() != [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]:
        fail(f"splice_in(mask=[[0,1,1],[1,1,1]], n=5) gave grow={grow}, row_pad={pad}, mask="
             f"{new.tolist()}; expected grow=2 (the batch is padded on the left), row_pad=0",
             f"splice_in; {WHERE}")
    pos = student(next_positions, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
                  name="next_positions", where=WHERE)
    if torch.as_tensor(pos).tolist() != [[2], [4]]:
        fail(f"next_positions([[0,0,1,1],[1,1,1,1]]) gave {torch.as_tensor(pos).tolist()}; expected "
             "[[2],[4]]: a row's next position is its count of real tokens, not the column "
             "index (rotary embeddings must see the positions the row would have alone)",
             f"next_positions; {WHERE}")
    wide = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    for trim, want, first in ((True, [[0, 1, 1], [1, 1, 1]], 1), (False, [[0, 0, 1, 1], [0, 1, 1, 1]], 0)):
        new, keep, f = student(remove, wide, 0, trim, name="remove", where=WHERE)
        if list(keep) != [1, 2] or f != first or new.tolist() != want:
            fail(f"remove(mask={wide.tolist()}, i=0, trim={trim}) gave mask={new.tolist()}, keep="
                 f"{list(keep)}, first={f}; expected mask={want}, keep=[1, 2], first={first} "
                 "(trim drops the leading columns that are padding in every remaining row)",
                 f"remove; {WHERE}")


# 0 is the longest prompt and leaves first (max_tokens 2); 3 and 4 splice in afterwards
PLAN = [(list(range(1, 41)), 2), ([7, 8, 9, 10, 11], 12), (list(range(20, 30)), 12),
        ([3, 4, 5], 6), (list(range(100, 120)), 5)]


@guarded_check(60, where=WHERE)
def check_mixed_workload(splice_in, remove, next_positions, plan=PLAN, trim=False) -> list:
    """The mixed workload on the real engine with the lab backend; tokens must equal a stock
    engine's (which equal HF generate on each prompt alone). Returns (width, kv_length) seen
    before each splice-in. The small masks are checked first: a function they catch is
    named there, before any engine runs."""
    check_shapes(splice_in, remove, next_positions)
    engine = use_padded(tiny_engine(max_batch_size=3, enable_prefix_caching=False),
                        splice_in, remove, next_positions, trim_on_remove=trim)
    return _run_mixed(engine, plan)


def _run_mixed(engine, plan) -> list:
    backend = engine.scheduler.backend
    handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in plan]
    try:
        drain(engine, WHERE)
    except AssertionError as e:
        wider = [(w, k) for w, k in backend.splices if w > k]
        hint = ""
        if wider and "Sizes of tensors" in str(e):
            w, k = wider[-1]
            hint = (f"\n    This is the mixed-workload crash (R3): the longest row had left, so the "
                    f"mask was {w} columns wide but kv_length was {k}; a splice-in sized from "
                    "kv_length builds a new row of the wrong width. Size it from mask.shape[1].")
        raise type(e)(str(e) + hint) from None
    ref = stock_tokens(plan, max_batch_size=3, enable_prefix_caching=False)
    for h, want in zip(handles, ref):
        if h.output.token_ids != want:
            first = next(i for i, (a, b) in enumerate(zip(h.output.token_ids, want)) if a != b)
            fail(f"{h.request_id} generated {h.output.token_ids}, HF generate on its prompt "
                 f"alone gives {want} (first difference at output token {first}): the mask or "
                 "the position ids of a batched row are off", f"next_positions / splice_in; {WHERE}")
    return backend.splices


class KvLengthBackend(PaddedBackend):
    """The padded backend as it was when it crashed (R3): splice-in takes the batch's width
    from `kv_length`, the longest row's real KV, instead of the mask's own width."""

    def __init__(self, model):
        super().__init__(model, storage=None, trim_on_remove=False)
        self.splices: list[tuple[int, int]] = []

    def promote(self, req) -> None:
        if self.cache is None or not self.row_ids:
            return super().promote(req)
        row = self.staging.pop(req.request_id)
        n = row.get_seq_length()
        self.splices.append((self.width, self.kv_length))
        width = self.kv_length  # the bug
        grow = max(0, n - width)  # as the engine's own splice-in (backends/padded.py)
        row_pad = max(0, width - n)
        for big, small in zip(self.cache.layers, row.layers):  # (B, H_kv, L, D) per layer
            big.keys = torch.cat([F.pad(big.keys, (0, 0, grow, 0)), F.pad(small.keys, (0, 0, row_pad, 0))])
            big.values = torch.cat([F.pad(big.values, (0, 0, grow, 0)),
                                    F.pad(small.values, (0, 0, row_pad, 0))])
        new_row = F.pad(torch.ones(1, n, dtype=torch.long, device=self.device), (row_pad, 0))
        self.mask = torch.cat([F.pad(self.mask, (grow, 0)), new_row])
        self.row_ids.append(req.request_id)


@guarded_check(60, where=WHERE)
def the_crash() -> str:
    """The mixed workload on the backend that sized splice-in from kv_length: returns what
    the check says about it (the crash, and its cause)."""
    engine = tiny_engine(max_batch_size=3, enable_prefix_caching=False)
    engine.scheduler.backend = KvLengthBackend(engine.model)
    try:
        _run_mixed(engine, PLAN)
    except AssertionError as e:
        return str(e)
    return "no crash"


# ------------------------------------------------------------------ hidden: against the engine
class _Layer:
    """A cache layer of the stand-in: keys and values (B, 1, L, 1) whose entries name the
    row and the token, so a misplaced column shows."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys, self.values = keys, keys.clone()


class _Row:
    """A prefilled row, as PaddedBackend.promote reads it: its length and its layers."""

    def __init__(self, n: int, tag: int) -> None:
        self.n = n
        self.layers = [_Layer(torch.arange(1, n + 1).float().view(1, 1, n, 1) + 1000 * tag)]

    def get_seq_length(self) -> int:
        return self.n


class _Model:
    """The stand-in model of a decode step: it records the position ids it is given and
    appends one column to every cache layer, as a Hugging Face forward does."""

    def __init__(self) -> None:
        self.positions = None

    def __call__(self, input_ids, attention_mask, position_ids, use_cache, past_key_values):
        self.positions = position_ids.tolist()
        for layer in past_key_values.layers:
            col = layer.keys.new_full((layer.keys.shape[0], 1, 1, 1), -1.0)
            layer.keys = torch.cat([layer.keys, col], dim=2)
            layer.values = torch.cat([layer.values, col], dim=2)
        return type("Out", (), {"logits": torch.zeros(input_ids.shape[0], 1, 2)})()


def stand_in_backend(trim: bool) -> PaddedBackend:
    """The engine's own PaddedBackend with no model behind it: its promote, remove_row and
    decode_step_batched run on stand-in rows and a stand-in model, so its mask bookkeeping
    is the reference the lab's three functions are compared with."""
    import contextlib

    b = PaddedBackend.__new__(PaddedBackend)
    b.model, b.device, b.cache_arg = _Model(), torch.device("cpu"), "past_key_values"
    b.storage = b.block_manager = b.decode_layer = None
    b.staging, b.row_ids, b.cache = {}, [], None
    b.mask = torch.zeros(0, 0, dtype=torch.long)
    b.trim_on_remove, b.attention_backends = trim, contextlib.nullcontext
    return b


CONTRACT4 = {
    "splice_in": "splice_in(mask, n, kv_length) returns (the new mask (B+1, max(L, n)), grow, "
                 "row_pad): the batch left-padded by grow = max(0, n - L) columns, the new row "
                 "of n ones left-padded by row_pad = max(0, L - n), L the mask's own width "
                 "(never kv_length, R3).",
    "remove": "remove(mask, i, trim) returns (the mask without row i, keep: the rows kept in "
              "order, first: the leading columns dropped, which with trim are the ones that "
              "are padding in every remaining row, and without trim none).",
    "next_positions": "next_positions(mask) is (B, 1): each row's count of real tokens, the "
                      "position its next token takes.",
}


def _mask_canon(value):
    from .differential import WrongKind

    if type(value) is not torch.Tensor:
        raise WrongKind(f"{show(value)}, not a tensor")
    return value.tolist()


def _int_canon(value):
    from .differential import WrongKind

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = int(value)
    if type(value) is not int:
        raise WrongKind(f"{show(value)}, not an int")
    return value


def _machine():
    from .differential import Differential, WrongKind, choose

    def splice_canon(got):
        try:
            mask, grow, pad = got
        except (TypeError, ValueError):
            raise WrongKind(f"{show(got)}, not (mask, grow, row_pad)") from None
        return (_mask_canon(mask), _int_canon(grow), _int_canon(pad))

    def remove_canon(got):
        try:
            mask, keep, first = got
        except (TypeError, ValueError):
            raise WrongKind(f"{show(got)}, not (mask, keep, first)") from None
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else keep
        if not isinstance(keep, (list, tuple, range)) or any(type(k) is not int for k in keep):
            raise WrongKind(f"keep={show(keep)}, not a list of row indices")
        return (_mask_canon(mask), list(keep), _int_canon(first))

    def positions_canon(got):
        if isinstance(got, torch.Tensor) and got.dim() == 2 and got.shape[1] == 1:
            return got.tolist()
        raise WrongKind(f"{show(got)}, not a (B, 1) tensor")

    class Machine(Differential):
        splice_in: object
        remove: object
        next_positions: object
        OPS = ((4, "join"), (3, "leave"), (4, "decode"))

        def setup(self, arg) -> None:
            self.trim, _ = choose((False, True), arg)
            self.ref = stand_in_backend(self.trim)
            self.rows = 0

        def _req(self, rid):
            return type("Req", (), {"request_id": rid})()

        def _desc(self, mask) -> str:
            return f"mask={mask.tolist()}"

        def op_join(self, arg):
            """A prefilled row of n tokens joins (the first one becomes the batch)."""
            b, L = self.ref.mask.shape if self.ref.row_ids else (0, 0)
            n, _ = choose((L, L, L + 1, L - 1, 1, 2, L + 3, 5), arg) if b else choose((1, 2, 3, 5), arg)
            n = max(1, n)
            self.rows += 1
            rid = f"r{self.rows}"
            self.ref.staging[rid] = _Row(n, self.rows)
            if not b:  # the first row is the batch: the backend builds it, no splice_in
                self.ref.promote(self._req(rid))
                self.steps.append(f"a first row of {n} tokens is the batch: mask "
                                  f"{self.ref.mask.tolist()}")
                return
            before, kv = self.ref.mask.clone(), self.ref.kv_length
            self.call(f"splice_in({self._desc(before)}, n={n}, kv_length={kv})",
                      lambda: self._spliced(rid, before, n),
                      lambda: self.splice_in(before.clone(), n, kv), ref_canon=lambda v: v,
                      sub_canon=splice_canon, sentence=CONTRACT4["splice_in"],
                      where=f"splice_in; {WHERE}")

        def _spliced(self, rid, before, n):
            self.ref.promote(self._req(rid))
            L, W = before.shape[1], self.ref.mask.shape[1]
            return (self.ref.mask.tolist(), W - L, W - n)

        def op_leave(self, arg):
            if len(self.ref.row_ids) < 2:  # the last row's removal needs no bookkeeping
                return self.op_join(arg)
            i, _ = choose(range(len(self.ref.row_ids)), arg)
            before = self.ref.mask.clone()
            rid = self.ref.row_ids[i]
            self.call(f"remove({self._desc(before)}, i={i}, trim={self.trim})",
                      lambda: self._removed(rid, i, before),
                      lambda: self.remove(before.clone(), i, self.trim), ref_canon=lambda v: v,
                      sub_canon=remove_canon, sentence=CONTRACT4["remove"],
                      where=f"remove; {WHERE}")

        def _removed(self, rid, i, before):
            self.ref.remove_row(self._req(rid))
            keep = [j for j in range(before.shape[0]) if j != i]
            return (self.ref.mask.tolist(), keep, before.shape[1] - self.ref.mask.shape[1])

        def op_decode(self, arg):
            if not self.ref.row_ids:
                return self.op_join(arg)
            before = self.ref.mask.clone()
            reqs = [self._req(r) for r in self.ref.row_ids]
            self.call(f"next_positions({self._desc(before)})",
                      lambda: self._decoded(reqs),
                      lambda: self.next_positions(before.clone()), ref_canon=lambda v: v,
                      sub_canon=positions_canon, sentence=CONTRACT4["next_positions"],
                      where=f"next_positions; {WHERE}")

        def _decoded(self, reqs):
            self.ref.decode_step_batched(reqs, [0] * len(reqs))
            return self.ref.model.positions

    return Machine


@guarded_check(60, where=WHERE)
def check_against_the_engine(splice_in, remove, next_positions, hidden) -> None:
    """Hidden: the three functions beside the engine's own PaddedBackend (its promote,
    remove_row and decode step, run on stand-in rows without a model) on random sequences
    of rows joining, leaving and decoding, drawn from the instructor's secret, with and
    without trim: rows as wide as the batch, one wider, one narrower, the longest one
    leaving. Every call's result must equal what the backend computed from the same mask."""
    from .differential import run

    run(_machine(), hidden, "lab4/padded", piece="your splice_in / remove / next_positions",
        reference="the engine's PaddedBackend", where=WHERE,
        bind={"splice_in": splice_in, "remove": remove, "next_positions": next_positions},
        examples=80, steps=24)


# what the graded cell defines and may use (allowlist.py; grading runs it alone)
CELL = Cell(names=("splice_in", "remove", "next_positions"),
            provided=lambda: {"torch": torch, "F": F},
            modules={"torch": TORCH, "F": TORCH_F},
            module_imports={"torch": ("torch", TORCH), "torch.nn.functional": ("F", TORCH_F)})


def ENGINE_CODE():  # noqa: N802 - read by similarity.py beside the other labs' `reference`
    """The engine's own code for this lab's three functions: PaddedBackend's splice-in,
    removal and decode step (what a copy would copy)."""
    return [(PaddedBackend, ("promote", "remove_row", "decode_step_batched"), "PaddedBackend")]


def hidden_plan(hidden, label: str = "plan") -> list:
    """A mixed workload drawn from the instructor's secret: the longest prompt leaves
    first, shorter rows keep decoding and later ones splice in (mask wider than kv_length)."""
    from .common import secret_rng

    rng = secret_rng(hidden.seed, f"lab4/{label}")
    long = (list(range(1, rng.randint(25, 45))), rng.randint(1, 2))
    rows = [(list(range(50 + 7 * i, 50 + 7 * i + rng.randint(2, 12))), rng.randint(4, 12))
            for i in range(rng.randint(3, 5))]
    return [long] + rows

"""Sampling: how one row's logits become one token.

`SamplingParams` is what a client asks for; `Sampler` turns each row's logits
into one token (the scheduler asks it once per forward, for all its rows). Two
properties matter for a serving engine:

* **Greedy is argmax, nothing else** (temperature 0), so the engine's tokens can
  be compared with Hugging Face `generate(do_sample=False)` exactly (SPEC B2).
* **Seeded sampling is per request.** Each request owns a `torch.Generator`
  seeded once; a row draws from its own generator and from nothing else, so the
  tokens a request gets do not depend on who else shares the batch, nor on the
  order of rows in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (argmax)


@dataclass
class SamplingParams:
    """What a client asks for. Validated at construction (A2)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 -> greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose mass >= top_p
    top_k: int = 0  # 0 -> off; else keep the k most likely tokens
    seed: int | None = None  # None -> derived from the engine seed and the arrival order
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids besides EOS
    ignore_eos: bool = False  # benchmarks: run to max_tokens even past EOS

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"SamplingParams: {msg}")

        need(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
             and self.max_tokens >= 1, f"max_tokens={self.max_tokens!r}; use an int >= 1")
        need(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
             f"temperature={self.temperature!r}; use a number in [0, 100] (0 = greedy)")
        need(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
             f"top_p={self.top_p!r}; use a number in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k={self.top_k!r}; use an int >= 0 (0 = off)")
        need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and 0 <= self.seed < 2**63),
             f"seed={self.seed!r}; use an int in [0, 2**63) or None")
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be ints >= 0")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below MIN_TEMPERATURE: 1e-46 is 0 in float32, and dividing
        logits by it gives NaN; so tiny temperatures mean argmax (as vLLM does, 1e-5)."""
        return self.temperature < MIN_TEMPERATURE


class Sampler:
    """Picks each row's next token from its logits; a row uses its own params and generator.

    `sample` is what a tick calls: every row of a forward in ONE batched call and ONE copy
    to the host (SPEC D5). On a GPU the per-row version costs two or three host
    synchronisations per row (`.item()`, `bool(...)`); 64 rows, ~200 syncs a tick, each
    a wait for the whole queue of kernels. `sample_row` is the same choice for one row,
    written out plainly: the reference the batched one is tested against, token for token.
    """

    @staticmethod
    def sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        """One row (V,) -> one token id."""
        if bool(torch.isnan(logits).any()):  # argmax would pick some token anyway: refuse
            raise ValueError(NAN_LOGITS)
        if p.greedy:
            return int(torch.argmax(logits).item())
        logits = logits.float()
        if not bool(torch.isfinite(logits).any()):
            raise ValueError(NO_FINITE_LOGIT)
        # Shift so the largest logit is 0 *before* dividing: a tiny temperature (1e-40)
        # then sends the others to -inf (probability 0) instead of inf - inf = NaN.
        logits = (logits - logits.max()) / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            # drop a token once the mass *before* it already reaches top_p
            drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= p.top_p
            # the most likely token always stays: a top_p that rounds to 0 in float32
            # (1e-300) would otherwise drop every token and divide 0 by 0
            drop[0] = False
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
            probs = probs / probs.sum()
        # The generator lives on the CPU, so sample there: same stream on any device.
        return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())

    @staticmethod
    def sample(logits: torch.Tensor, params: list[SamplingParams],
               gens: list[torch.Generator | None]) -> list[int | str]:
        """Every row of `logits` (B, V) at once -> per row its token id, or the reason it
        cannot be sampled (a string: NaN logits, no finite logit), so that row alone fails.

        The same tokens as `sample_row`, row for row: each step is the per-row one done
        over the rows together (a row's max, its temperature, its k-th largest logit, its
        own nucleus), and the draw is the one `torch.multinomial` makes for one sample,
        written out: argmax(p / q) with q ~ Exp(1) drawn from the row's own generator,
        V numbers (the exponential race; the Gumbel-max trick with the logs taken away).
        A row's tokens therefore still depend on nothing but its own generator.

            logits (B, V) --argmax--------------------------------------> greedy rows
                          --[sampled rows] (S, V): shift, / T, top-k, softmax, top-p
                            -> p (S, V); q (S, V) from S generators -> argmax(p / q)
            tokens (B,) + bad-row flags (B,)  --ONE copy to the host--> list
        """
        B, V = logits.shape
        dev = logits.device
        bad = torch.isnan(logits).any(dim=-1).long()  # (B,) 1: NaN; 2 (below): no finite logit
        tokens = logits.argmax(dim=-1)  # (B,): the greedy rows' answer
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows, device=dev)  # (S,)
            x = logits.index_select(0, idx).float()  # (S, V)
            none_finite = ~torch.isfinite(x).any(dim=-1)  # (S,)
            bad[idx] = torch.where(bad[idx] == 1, 1, none_finite.long() * 2)
            temp = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32,
                                device=dev)  # (S,)
            x = (x - x.max(dim=-1, keepdim=True).values) / temp[:, None]
            ks = [params[i].top_k if 0 < params[i].top_k < V else 0 for i in rows]
            if any(ks):  # the k-th largest logit of each row that keeps k (others: -inf)
                top = torch.topk(x, max(ks), dim=-1).values  # (S, k_max), descending
                k = torch.tensor([max(k, 1) - 1 for k in ks], device=dev)  # (S,)
                kth = top.gather(1, k[:, None])  # (S, 1)
                # rows that keep every token: no threshold. masked_fill, not `kth[mask] =`:
                # a boolean index makes a GPU send the mask's count to the host first
                kth = kth.masked_fill(torch.tensor(ks, device=dev)[:, None] == 0, float("-inf"))
                x = x.masked_fill(x < kth, float("-inf"))
            probs = torch.softmax(x, dim=-1)  # (S, V)
            nucleus = [j for j, i in enumerate(rows) if params[i].top_p < 1.0]
            if nucleus:
                n = torch.tensor(nucleus, device=dev)
                top_p = torch.tensor([params[rows[j]].top_p for j in nucleus],
                                     dtype=torch.float32, device=dev)  # (P,)
                sorted_p, order = torch.sort(probs[n], dim=-1, descending=True)  # (P, V)
                drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p[:, None]
                drop[:, 0] = False  # the most likely token always stays (see sample_row)
                sorted_p = sorted_p.masked_fill(drop, 0.0)
                kept = torch.zeros_like(sorted_p).scatter_(1, order, sorted_p)
                probs[n] = kept / kept.sum(dim=-1, keepdim=True)
            # Exp(1) noise, V numbers per row from the row's own (CPU) generator, as
            # `torch.multinomial(p, 1, generator=g)` draws it: the same stream on any device
            q = torch.stack([torch.empty(V, dtype=torch.float32).exponential_(1, generator=gens[i])
                             for i in rows])  # (S, V), on the CPU
            tokens[idx] = (probs / q.to(dev)).argmax(dim=-1)
        out = torch.stack([tokens, bad]).tolist()  # (2, B): the one copy to the host
        return [t if b == 0 else (NAN_LOGITS if b == 1 else NO_FINITE_LOGIT)
                for t, b in zip(*out)]


NAN_LOGITS = "the model produced NaN logits for this row"
NO_FINITE_LOGIT = "the model produced no finite logit for this row"


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g

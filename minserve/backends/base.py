"""What the scheduler asks of a backend (SPEC B1).

A backend owns the model's KV for every row the scheduler has admitted, and
runs the forward passes. The scheduler never touches a tensor of KV itself; it
only says which rows exist and which tokens go in:

    rows in `prefilling`                     rows in `active` (the decode batch)
    ─────────────────────                    ───────────────────────────────────
    begin_prefill(req)                       decode_step_batched(reqs, tokens) -> (B, V)
    prefill_chunk(req, start, end) -> (V,)   remove_row(req)
    promote(req)  ─────── splice-in ───────> (row joins the batch; SPEC C3)

Contract, for every implementation:

* `prefill_chunk(req, start, end)` computes the KV of `prompt[start:end]`;
  `start` is always the number of prompt tokens whose KV the row already has
  (cached prefix + earlier chunks). It returns the logits after the last of
  those tokens, shape (V,), float32.
* `decode_step_batched(reqs, tokens)` appends one token per row (row i gets
  `tokens[i]` at position `req.num_tokens - 1`) and returns logits (B, V) in the
  order of `reqs`. Any subset of the decode batch may be given, in any order.
* `forward_mixed(decode, tokens, chunks)` (Version B, `mixed_batch` prefill; only
  backends with `supports_mixed_batch`) does both in ONE forward: a token for each
  decode row and `prompt[start:end]` for each `(req, start, end)` chunk; it returns
  the decode logits (B, V) and, per chunk, the (V,) logits if it was the prompt's
  final chunk, else None.
* `prefill_together(pieces)` (backends with `supports_batched_prefill`) pushes several
  rows' `(req, start, end)` prompt pieces through ONE forward; per piece it returns
  the (V,) logits if it was the prompt's final piece, else None.
* `remove_row(req)` forgets a row wherever it is (staging or decode batch).
* `kv_length` is a backend *metric* (its KV width), never scheduler state (R3).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from ..request import Request


def unsupported_features(model_config: Any, backend: str, max_model_len: int) -> list[str]:
    """What a backend cannot compute for a model, in words (empty: it runs token-exact).

    The Llama family and its look-alikes (Qwen2/3, Phi3, Gemma, Olmo2, Granite) run on
    both backends (tests/test_architectures.py). Two attention variants are not built:

    * a sliding window smaller than the context, on both backends: a query at position
      p may see only keys p-W+1..p (HF's rule). The paged backend's attention is plain
      causal, and HF's cache keeps only the last W-1 tokens of a windowed layer, which
      the padded backend's row splicing cannot line up. A window of at least
      `max_model_len` hides nothing (no row gets longer: the engine refuses
      prompt + max_tokens > max_model_len), so that case runs as is (Mistral's 4096);
    * attention logit soft-capping (Gemma2's `tanh(s / c) * c` on every score), on the
      paged backend (the padded one runs HF's own attention, which applies it).
    """
    found = []
    window = getattr(model_config, "sliding_window", None)
    layer_types = getattr(model_config, "layer_types", None) or []
    windowed = window is not None and (not layer_types or "sliding_attention" in layer_types)
    if windowed and window < max_model_len:
        found.append(f"sliding-window attention (sliding_window={window} < max_model_len="
                     f"{max_model_len}; pass max_model_len <= {window} to run it)")
    softcap = getattr(model_config, "attn_logit_softcapping", None)
    if softcap and backend == "paged":
        found.append(f"attention logit soft-capping (attn_logit_softcapping={softcap}; "
                     "use backend='padded')")
    return found


def refuse_unsupported(model: torch.nn.Module, backend: str, max_model_len: int | None) -> None:
    """Raise at construction, naming the feature, if `backend` cannot run `model`:
    an unsupported pair fails at once instead of on every row at run time."""
    context = max_model_len or int(model.config.max_position_embeddings)
    missing = unsupported_features(model.config, backend, context)
    if missing:
        raise ValueError(f"backend={backend!r} cannot run {type(model).__name__}: it needs "
                         f"{' and '.join(missing)}")


class Backend(ABC):
    name: str = "base"
    supports_mixed_batch: bool = False  # forward_mixed is built (EngineConfig checks it)
    supports_batched_prefill: bool = False  # prefill_together is built
    # Where a row's decode KV goes. False (padded): in the backend's own tensors; only the
    # prompt's blocks are pooled. True (paged): into the block pool, one block per
    # `block_size` tokens, so admission counts blocks for prompt + max_tokens (G3) and a
    # decode step may need a new block (P6).
    kv_grows_in_pool: bool = False

    @abstractmethod
    def begin_prefill(self, req: Request) -> None:
        """Open a staging row for `req`; load the KV of its cached prefix, if any
        (`req.num_cached_tokens` tokens, whose blocks the block manager has given it)."""

    @abstractmethod
    def prefill_chunk(self, req: Request, start: int, end: int) -> torch.Tensor:
        """Compute KV for prompt[start:end]; return the last position's logits, (V,)."""

    @abstractmethod
    def promote(self, req: Request) -> None:
        """Splice the fully prefilled staging row into the decode batch."""

    @abstractmethod
    def decode_step_batched(self, reqs: list[Request], token_ids: list[int]) -> torch.Tensor:
        """One forward for these rows, one new token each; logits (B, V) in `reqs` order."""

    def forward_mixed(self, decode: list[Request], tokens: list[int],
                      chunks: list[tuple[Request, int, int]]) -> tuple[torch.Tensor, list]:
        """Version B: decode rows and prefill chunks in one forward (see the contract)."""
        raise NotImplementedError(f"the {self.name} backend has no mixed-batch forward; "
                                  "use backend='paged' for prefill_mode='mixed_batch'")

    def prefill_together(self, pieces: list[tuple[Request, int, int]]) -> list:
        """Several rows' prompt pieces in one forward (see the contract)."""
        raise NotImplementedError(f"the {self.name} backend prefills one row at a time")

    @abstractmethod
    def remove_row(self, req: Request) -> None:
        """Drop the row's KV (staging or batch). Unknown rows are ignored."""

    def reset(self) -> None:
        """Forget every row, staging and batch, without checks: the scheduler's last resort
        after a fault may have broken the bookkeeping (`Scheduler.fail_all`). Both
        backends here override it; one that keeps no row state needs nothing."""

    @property
    @abstractmethod
    def kv_length(self) -> int:
        """Width of the KV in tokens (padded: the batch's padded width; paged: max row length)."""

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Rows in the decode batch."""

    def snapshot(self) -> dict[str, Any]:
        """Plain data for stats and figures (no tensors that alias internal state)."""
        return {"name": self.name, "kv_length": self.kv_length, "num_rows": self.num_rows}

    def check_invariants(self) -> None:
        """Assert the backend's own bookkeeping is self-consistent (R3)."""


def model_forward_kwargs(model: torch.nn.Module) -> str:
    """Name of the KV-cache argument of `model.forward`.

    transformers 5.x renames `past_key_values` to `cache` (the old name is
    deprecated); use whichever this installed version takes.
    """
    import inspect

    inner = getattr(model, "model", model)
    params = inspect.signature(inner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"

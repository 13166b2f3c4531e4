"""The building blocks of a benchmark run, shared by `minserve bench` (cli.py) and
`--suite docs` (suite.py): load the model once, build the engine and the workload,
replay it against minserve and its peers, print and package the results.

Both commands import from here; neither imports the other (no cycle).
"""

from __future__ import annotations

from typing import Any

from .report import comparison, markdown_table, session_table
from .targets import RunResult
from .workload import BenchRequest, Workload, make_workload

PEERS = ("static", "continuous")


def load(args) -> tuple[Any, Any]:
    """(model, tokenizer) once; the engine and the peers share the model object."""
    import torch

    if args.tiny:
        from ..models import tiny_llama

        return tiny_llama(eos_token_id=0).to(args.device), None
    from ..models import load_model

    torch.manual_seed(0)
    return load_model(args.model, args.dtype, args.device)


def make_engine(args, model, tokenizer):
    from .. import Engine, EngineConfig

    cfg = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                       max_batch_size=args.max_batch_size, backend=args.backend,
                       policy=args.policy, prefill_chunk_size=args.prefill_chunk_size,
                       prefill_mode=getattr(args, "prefill_mode", ""),
                       max_queue_size=args.max_queue_size,
                       enable_prefix_caching=args.prefix_caching)
    return Engine(cfg, model=model, tokenizer=tokenizer)


def build_workload(args, tokenizer, vocab_size: int, max_model_len: int | None = None,
                   **override) -> Workload:
    kw = dict(rate=args.rate, burstiness=args.burstiness, concurrency=args.concurrency,
              prompt_len=args.prompt_len, output_len=args.output_len, sessions=args.sessions,
              seed=args.seed, shared_prefix=args.shared_prefix, max_model_len=max_model_len,
              tokenizer=tokenizer if args.prompts == "text" else None,
              vocab=(min(100, vocab_size // 4), vocab_size))
    n = override.pop("num_requests", args.num_requests)
    kw.update(override)
    return make_workload(n, **kw)


def run_targets(args, workload: Workload, engine, model, tokenizer,
                peers: list[str]) -> list[RunResult]:
    from .peers import HFContinuousTarget, HFStaticTarget
    from .targets import EngineTarget, OpenAITarget

    if args.url:
        targets = [OpenAITarget(args.url, args.served_model, args.api, args.ignore_eos,
                                tokenizer, name=args.target_name or args.url)]
    else:
        targets = [EngineTarget(engine, args.ignore_eos)]
    for peer in peers:
        cls = HFStaticTarget if peer == "static" else HFContinuousTarget
        targets.append(cls(model, args.max_batch_size, args.ignore_eos))
    runs = []
    for k, target in enumerate(targets):
        try:
            # A few tiny requests first, off the record: first calls pay one-off costs
            # (thread pools, allocator, lazy imports) that belong to no steady state.
            target.run(warmup_workload(workload), progress=False)
            runs.append(target.run(workload, args.progress))
        except Exception as e:
            if k == 0:  # the target under test itself failed: that is the answer
                raise
            print(f"peer {target.name} failed and is left out: {type(e).__name__}: {e}")
    return runs


def warmup_workload(workload: Workload) -> Workload:
    """Two short requests cut from the workload's first (same kind of prompt)."""
    r = workload.requests[0]
    reqs = [BenchRequest(i, r.session, None, r.prompt_ids[:16], 4) for i in range(2)]
    return Workload(reqs, concurrency=2)


def peer_names(args) -> list[str]:
    spec = args.peers if args.peers is not None else ("none" if args.url else ",".join(PEERS))
    peers = [] if spec in ("", "none") else [s.strip() for s in spec.split(",")]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise SystemExit(f"--peers: unknown {bad}; use {','.join(PEERS)} or none")
    return peers


def print_runs(title: str, workload: Workload, runs: list[RunResult]) -> None:
    print(f"\n== {title}: {workload.describe()}")
    print(markdown_table(runs))
    for run in runs:
        s = run.summary()
        if s["refusals_by_gate"]:
            print(f"{run.target}: refused by gate {s['refusals_by_gate']}")
    if len(workload.settings.get("sessions", {})) > 1:
        print(session_table(runs[0], workload.settings["sessions"]))


def payload(workload: Workload, runs: list[RunResult], extra: dict | None = None) -> dict:
    return {"workload": workload.settings, "describe": workload.describe(),
            "comparison": comparison(runs), "runs": [r.to_dict() for r in runs], **(extra or {})}

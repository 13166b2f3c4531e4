"""The GPU benchmark's own code runs (on the CPU, a tiny shape): every path it measures
gives its figure and the profile of a tick comes out, so that the short time a GPU is lent
is spent measuring, not debugging the script (minserve/bench/gpu.py, docs/gpu.md)."""

from __future__ import annotations

from minserve.bench import gpu


def test_the_gpu_bench_measures_every_path_and_profiles_a_tick_on_a_cpu_too():
    res = gpu.run(["tiny"], "cpu", "float32", requests=2, batch=2, quick=True)
    row = res["shapes"]["tiny"]
    for name in gpu.PATHS:  # minserve's paths must run (HF's may report an error)
        assert isinstance(row[name], float) and row[name] > 0, (name, row[name])
    assert set(row["profile"]) == set(gpu.PROFILED)
    for p in row["profile"].values():
        assert p["wall_ms"] > 0 and p["gpu_busy_share"] is None  # no GPU: no busy share
    md = gpu.markdown(res)
    assert all(name in md for name in gpu.PATHS) and "busy share" in md


def test_busy_time_is_the_union_of_the_device_intervals():
    assert gpu.busy_us([]) == 0
    assert gpu.busy_us([(0, 10)]) == 10
    # overlapping (two streams), nested, touching, out of order: each instant once
    assert gpu.busy_us([(20, 25), (0, 10), (5, 15), (21, 22), (25, 30)]) == 25
    assert gpu.busy_us([(0, 100), (10, 20), (30, 40)]) == 100


def kineto_like_events():
    """What `_parse_kineto_results` (torch/autograd/profiler.py) makes of one tick with
    two kernels on two streams that overlap: each CPU operator carries its kernel's time
    (`append_kernel`), each kernel is a device event of its own, the launches and a sync
    are CPU runtime events, a `record_function` range shows on the GPU as an annotation."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def ev(name, start, end, device=DeviceType.CPU, **kw):
        return FunctionEvent(id=0, name=name, thread=1, start_us=start, end_us=end, stack=[],
                             input_shapes=[], use_device="cuda", device_type=device, **kw)

    mm, add = ev("aten::mm", 0, 30), ev("aten::add", 30, 40)
    mm.append_kernel("gemm", 0, 10.0)
    add.append_kernel("add_kernel", 0, 4.0)
    return [mm, add, ev("cudaLaunchKernel", 5, 9), ev("cuLaunchKernelEx", 32, 35),
            ev("cudaStreamSynchronize", 40, 120), ev("aten::empty", 1, 2),
            ev("gemm", 100, 110, DeviceType.CUDA), ev("add_kernel", 105, 109, DeviceType.CUDA),
            ev("tick", 90, 200, DeviceType.CUDA, is_user_annotation=True)]


def test_a_profiled_tick_counts_each_kernel_once_with_its_launches_and_syncs():
    """GPU-busy time is when at least one kernel runs (100..110 here: 10 us of 200), not
    the sum of `self_device_time_total` over `key_averages()`, which counts each kernel
    with its CPU operator AND as itself (and a `record_function` range as busy)."""
    from torch.autograd.profiler_util import EventList

    events = EventList(kineto_like_events(), use_device="cuda")
    events._build_tree()  # CPU children under their parents, as the profiler does
    old = sum(e.self_device_time_total for e in events.key_averages())
    assert old == 10 + 4 + 10 + 4 + 110  # what the tick's busy share was computed from
    got = gpu.tick_figures(events, ticks=1, wall_s=200e-6, on_gpu=True)
    assert got == {"wall_ms": 0.2, "gpu_busy_ms": 0.01, "gpu_busy_share": 0.05,
                   "launches_per_tick": 2.0, "syncs_per_tick": 1.0}
    assert gpu.tick_figures(events, ticks=2, wall_s=100e-6, on_gpu=False)["gpu_busy_ms"] is None


def test_hf_continuous_batching_is_stopped_even_when_it_fails():
    """Its generation thread must not outlive its measurement: left running it would use
    the GPU (and the shared model) while minserve's paths run and capture CUDA graphs."""
    import types

    import pytest

    calls = []

    class Manager:
        def warmup(self):
            calls.append("warmup")

        def start(self):
            calls.append("start")

        def add_request(self, ids, request_id, max_new_tokens):
            pass

        def get_result(self, timeout):
            return None  # nothing comes back

        def stop(self, **kw):
            calls.append("stop")

    model = types.SimpleNamespace(init_continuous_batching=lambda **kw: Manager())
    with pytest.raises(RuntimeError, match="returned nothing"):
        gpu.hf_continuous(model, [[1, 2, 3]], [4], 2, "cpu")
    assert calls == ["warmup", "start", "stop"]


def test_a_path_that_fails_leaves_the_other_figures(monkeypatch):
    """On a GPU lent for minutes, one path raising (a first run of CUDA-only code) must not
    cost the figures of the others, nor the table at the end."""
    real_path, real_profile = gpu.minserve_path, gpu.profile_tick

    def path(*a, cfg, **kw):
        if cfg is gpu.PATHS["minserve paged"]:
            raise RuntimeError("boom")
        return real_path(*a, cfg=cfg, **kw)

    def profile(model, batch, device, dtype, cfg, *a, **kw):
        if cfg is gpu.PATHS["minserve compact"]:
            raise RuntimeError("bang")
        return real_profile(model, batch, device, dtype, cfg, *a, **kw)

    monkeypatch.setattr(gpu, "minserve_path", path)
    monkeypatch.setattr(gpu, "profile_tick", profile)
    res = gpu.run(["tiny"], "cpu", "float32", requests=2, batch=2, quick=True)
    row = res["shapes"]["tiny"]
    assert row["minserve paged"] == "error: RuntimeError: boom"
    assert row["profile"]["minserve compact"] == "error: RuntimeError: bang"
    assert isinstance(row["minserve compact+graphs"], float)
    assert isinstance(row["profile"]["minserve padded"], dict)
    md = gpu.markdown(res)
    assert "boom" in md and "bang" in md


def test_the_gpu_check_scripts_bench_command_parses():
    """scripts/gpu_check.sh's own command line, as the lent GPU will run it (with and
    without REQUESTS): `gpu --out DIR` once failed there before anything ran, argparse
    reading `--out` as an ambiguous short form of another experiment's options."""
    import shlex
    from pathlib import Path

    from minserve.bench.cli import parser

    script = (Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh").read_text()
    command = script.split("-m minserve.bench", 1)[1].split("2>&1 \\\n    | tee")[0]
    words = shlex.split(command.replace("\\\n", " "))
    for extra in ([], ["--requests", "32", "--shapes", "llama-3.2-1b"]):
        argv = [w for w in words if "$" not in w or w == "$out"] + extra  # REQUESTS, SHAPES
        args = parser().parse_args([a.replace("$out", "gpu-out") for a in argv])
        assert (args.experiment, args.device, args.out) == ("gpu", "cuda", "gpu-out")
        assert (args.requests, args.shapes) == ((32, ["llama-3.2-1b"]) if extra else (None, None))

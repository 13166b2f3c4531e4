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

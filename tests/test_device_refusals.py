"""What Apple's MPS lacks is refused at construction, with the reason (SPEC D1).

No Mac needed: `EngineConfig(device="mps", ...)` is checked without asking torch whether
MPS exists (that is `models.resolve_device`'s job, when the engine loads a model), and
the engine's own check, for a `device="auto"` that resolves to MPS, is driven by
standing in for the machine's answer.
"""

from __future__ import annotations

import pytest
import torch

from minserve import Engine, EngineConfig


@pytest.mark.parametrize("device", ["mps", "cuda", "cuda:1"])
def test_the_c_decode_kernel_is_refused_off_the_cpu(device):
    with pytest.raises(ValueError, match=r"decode_attention='kernel' runs on the CPU .*"
                                         r"use decode_attention='torch' or 'auto'"):
        EngineConfig(device=device, backend="paged", decode_attention="kernel")
    # "auto" (the server's default) picks the kernel only where it runs: not refused
    EngineConfig(device=device, backend="paged", decode_attention="auto")


def test_bfloat16_on_mps_is_refused_and_float16_and_float32_are_not():
    with pytest.raises(ValueError, match=r"dtype='bfloat16' on mps: .*macOS 14.*use "
                                         r"dtype='float16' or 'float32'"):
        EngineConfig(device="mps", dtype="bfloat16")
    for dtype in ("float16", "float32"):
        EngineConfig(device="mps", dtype=dtype)
    EngineConfig(device="cpu", dtype="bfloat16")  # the CPU and CUDA have it
    EngineConfig(device="cuda", dtype="bfloat16")


def test_every_reason_is_given_at_once():
    with pytest.raises(ValueError) as e:
        EngineConfig(device="mps", dtype="bfloat16", backend="paged", decode_attention="kernel")
    assert "decode_attention='kernel'" in str(e.value) and "bfloat16" in str(e.value)


@pytest.mark.parametrize("knobs", [{"dtype": "bfloat16"},
                                   {"backend": "paged", "decode_attention": "kernel"}])
def test_auto_resolving_to_mps_is_refused_before_the_model_loads(monkeypatch, knobs):
    """On a Mac, `device="auto"` becomes mps in the engine: the same refusals apply
    there, before any weights are read (here the machine's answer is stood in for, and
    loading a model fails the test)."""
    import minserve.engine as engine_mod

    monkeypatch.setattr(engine_mod, "resolve_device", lambda device: torch.device("mps"))

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the device was checked")

    monkeypatch.setattr(engine_mod, "load_model", no_load)
    config = EngineConfig(**knobs)  # device="auto": nothing to refuse yet
    with pytest.raises(ValueError, match="on mps|not on mps"):
        Engine(config)


def test_a_model_passed_in_is_checked_on_the_device_it_is_on(tiny_model):
    """A model passed in brings its device (`device="auto"` is never resolved then): the
    kernel is refused for a model that is not on the CPU (here on torch's "meta" device,
    which any machine has), and allowed for one that is."""
    import copy

    config = EngineConfig(backend="paged", decode_attention="kernel", num_blocks=16)
    with pytest.raises(ValueError, match="runs on the CPU .* not on meta"):
        Engine(config, model=copy.deepcopy(tiny_model).to("meta"))
    assert Engine(config, model=tiny_model).device.type == "cpu"


def test_every_lesson_builds_its_engines_on_the_cpu_and_says_why():
    """The lessons run on the CPU wherever they are opened (a Mac's `auto` would pick
    MPS): every EngineConfig and load_model in their code names device "cpu", and each
    lesson's introduction says why."""
    import ast
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "notebooks"
    lessons = sorted(root.glob("[0-9][0-9]_*.ipynb"))
    assert len(lessons) >= 8
    for path in lessons:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        assert "*Why the CPU.*" in "".join(cells[0]["source"]), path.name
        calls = 0
        for cell in cells:
            if cell["cell_type"] != "code":
                continue
            code = "\n".join(line for line in "".join(cell["source"]).splitlines()
                             if not line.lstrip().startswith(("%", "!")))
            for node in ast.walk(ast.parse(code)):
                name = getattr(getattr(node, "func", None), "id", None)
                if isinstance(node, ast.Call) and name in ("EngineConfig", "load_model"):
                    calls += 1
                    device = [k.value for k in node.keywords if k.arg == "device"]
                    if name == "load_model" and len(node.args) >= 3:
                        device = [node.args[2]]
                    assert [getattr(d, "value", None) for d in device] == ["cpu"], \
                        (path.name, ast.unparse(node))
        assert calls, f"{path.name} builds no engine"

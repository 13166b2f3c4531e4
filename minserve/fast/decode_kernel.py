"""The C decode attention (decode_kernel.c): built on first use, called through ctypes.

`EngineConfig(decode_attention=...)` picks who computes a decode step's attention on
the paged backend:

    "torch"   paged._attend: gather the rows' blocks, two batched matmuls. The readable
              version, and the reference (EngineConfig's default: the lessons use it).
    "kernel"  decode_kernel.c reads each row's blocks where they lie in the pool;
              refused at construction, with the reason, where it cannot run.
    "auto"    the kernel where it can run (CPU, float32, a C compiler), else "torch"
              (`minserve serve`'s default).

Only decode (one new token per row) goes through it; prompt chunks keep PyTorch's
fused attention. The two agree to float rounding (the sums run in another order);
tests/test_decode_kernel.py checks the kernel against `paged._attend` on ragged block
tables and token-exact against Hugging Face `generate`. docs/benchmarks.md, "Decode
attention", measures both.

Building: `cc -O3 -march=native -fopenmp -shared -fPIC` into `$MINSERVE_CACHE_DIR/kernels/`
(about a second), under a name that hashes the source, the compiler and the CPU, so a
cache directory shared between machines never hands one CPU another's instructions.
The `.so` has no Python or torch headers in it: plain C functions taking pointers.
ctypes releases the GIL while they run, as torch's own operators do.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_kernel.c")
MODES = ("torch", "kernel", "auto")
FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC"]
# Tried in this order until one builds: this CPU's vector instructions (-march=native)
# and threads (-fopenmp: the .so then uses the OpenMP runtime torch has already loaded,
# the same thread pool), then without either.
EXTRA_FLAGS = (["-march=native", "-fopenmp"], ["-march=native"], ["-fopenmp"], [])


def unsupported_reason(dtype: torch.dtype, device: torch.device, head_dim: int) -> str | None:
    """Why the kernel cannot run attention of this kind (None: it can)."""
    if torch.device(device).type != "cpu":
        return f"it runs on the CPU, not {torch.device(device).type}"
    if dtype != torch.float32:
        return f"it computes in float32, not {str(dtype).removeprefix('torch.')}"
    if head_dim % 8:
        return f"head_dim={head_dim} is not a multiple of 8"
    return None


class DecodeKernel:
    """The C functions, bound: `attend(q, k, v, tables, lengths, scale, block_size)` and
    `linear(x, weight, bias)`. Each runs on torch's intra-op thread count
    (`torch.get_num_threads()`, read at every call, as torch's own operators do)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: calls release the GIL
        P, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        common = [P, P, P, P, i32, i32, i32, i32, i64, i32, i32]
        self._scores, self._values = lib.decode_scores, lib.decode_values
        self._scores.argtypes = common + [ctypes.c_float, P, i32]
        self._values.argtypes = common + [P, i32]
        self._linear = lib.rows_linear
        self._linear.argtypes = [P, P, P, i32, i32, i32, P, i32]
        self._scores.restype = self._values.restype = self._linear.restype = None

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               tables: torch.Tensor, lengths: torch.Tensor, scale: float,
               block_size: int) -> torch.Tensor:
        """q (B, H, D); one layer's pools (H_kv, num_blocks * S, D); tables (B, M) int64
        block ids (every id < num_blocks: the C code does not check); lengths (B,) int64,
        each <= M * S -> out (B, H, D), each query head attending over its row's tokens."""
        B, H, D = q.shape
        H_kv, num_slots, _ = k_pool.shape
        M = tables.shape[1]
        q = q.contiguous()
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and q.dtype == torch.float32
        assert tables.dtype == lengths.dtype == torch.int64 and tables.is_contiguous()
        dims = (B, H, H_kv, D, num_slots, block_size, M)
        scores = torch.empty(B, H, M * block_size)  # (B, H, L): -inf past each row's end
        threads = torch.get_num_threads()
        self._scores(q.data_ptr(), k_pool.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
                     *dims, scale, scores.data_ptr(), threads)
        probs = torch.softmax(scores, dim=-1)  # (B, H, L)
        out = torch.empty(B, H, D)
        self._values(probs.data_ptr(), v_pool.data_ptr(), tables.data_ptr(),
                     lengths.data_ptr(), *dims, out.data_ptr(), threads)
        return out  # (B, H, D)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (N, in) @ weight (out, in).T + bias (out,) -> (N, out), float32 on the CPU:
        F.linear, read the way a few rows read fastest (decode_kernel.c, `rows_linear`)."""
        rows, n_in = x.shape
        n_out = weight.shape[0]
        x = x.contiguous()
        assert weight.shape[1] == n_in and weight.is_contiguous() and x.dtype == torch.float32
        assert bias is None or (bias.shape == (n_out,) and bias.is_contiguous())
        y = torch.empty(rows, n_out)
        self._linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                     rows, n_out, n_in, y.data_ptr(), torch.get_num_threads())
        return y  # (N, out)


def kernel_for(mode: str, storage) -> DecodeKernel | None:
    """The kernel `EngineConfig.decode_attention` asks for, over a pool of `storage`'s
    kind: None for "torch", and for "auto" where it cannot run; "kernel" raises saying why."""
    if mode == "torch":
        return None
    reason = unsupported_reason(storage.dtype, storage.device, storage.head_dim)
    if reason is None:
        try:
            return load()
        except RuntimeError as e:
            reason = str(e)
    if mode == "kernel":
        raise ValueError(f"decode_attention='kernel' cannot run here: {reason}; "
                         "use decode_attention='torch' (or 'auto')")
    from ..failures import log

    log.info("decode attention in PyTorch: the C kernel cannot run here (%s)", reason)
    return None


def load() -> DecodeKernel:
    """The kernel, built on first use (then cached on disk and in this process).
    Raises RuntimeError saying why when there is no C compiler or the build fails."""
    return _load(_compiler())


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    return cc


@functools.cache  # one build per compiler and process; the .so is immutable
def _load(cc: str) -> DecodeKernel:
    from ..models import cache_root

    src = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    except OSError as e:  # not there, not executable
        raise RuntimeError(f"the C compiler {cc} does not run: {e}") from None
    key = hashlib.sha256(src + version.encode() + _cpu_id().encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"decode_kernel-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent)) / target.name
        errors = []
        for extra in EXTRA_FLAGS:
            run = subprocess.run([cc, *FLAGS, *extra, str(SOURCE), "-o", str(tmp)],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                break
            errors.append(run.stderr.strip().splitlines()[-1:] or ["(no message)"])
        else:
            shutil.rmtree(tmp.parent, ignore_errors=True)
            raise RuntimeError(f"{cc} could not build {SOURCE.name}: {errors[-1][0]}")
        os.replace(tmp, target)  # atomic: a concurrent build never sees half a file
        shutil.rmtree(tmp.parent, ignore_errors=True)
    return DecodeKernel(target)


def _cpu_id() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's model and flags."""
    ident = platform.machine() + platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                ident += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return ident

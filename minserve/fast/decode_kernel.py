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

Building: `cc -O3 -march=native -fopenmp -ffp-contract=fast -shared -fPIC` into `$MINSERVE_CACHE_DIR/kernels/`
(about a second), under a name that hashes the source, the flags, the compiler and the CPU, so a
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
from typing import NamedTuple

import torch

SOURCE = Path(__file__).with_name("decode_kernel.c")
MODES = ("torch", "kernel", "auto")
# -ffp-contract=fast: a * b + c as one fused multiply-add where the CPU has one. ISO C
# modes (-std=c11) turn that off, and the matmul's inner loop then takes two instructions
# for each one: 1.1-1.2x slower at 8-32 rows here. Rounds once instead of twice.
FLAGS = ["-O3", "-std=c11", "-ffp-contract=fast", "-shared", "-fPIC"]
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


LAYER_FIELDS = ("ln1", "qkv", "qkv_bias", "o", "o_bias", "ln2", "gate_up", "gate_up_bias",
                "down", "down_bias", "k_pool", "v_pool")
PLAIN_FIELDS = ("q", "k", "v", "o", "gate", "up", "down")  # Layer's q_w ... down_w


class Layer(ctypes.Structure):
    """decode_kernel.c's `Layer`: one decoder layer's weights and KV pools, as pointers."""

    _fields_ = [(name, ctypes.c_void_p)
                for name in (*LAYER_FIELDS, *(f"{p}_w" for p in PLAIN_FIELDS))]


class Step(ctypes.Structure):
    """decode_kernel.c's `Step`: one decode step's sizes, rows and scratch, as pointers."""

    _fields_ = [*((name, ctypes.c_int) for name in ("N", "E", "H", "H_kv", "D", "I", "S", "M",
                                                   "threads")),
                ("num_slots", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                *((name, ctypes.c_void_p) for name in ("x", "cos", "sin", "slots", "tables",
                                                      "lens", "h", "qkv", "q", "att", "scores",
                                                      "gu", "act"))]


class Panels(NamedTuple):
    """A weight (out, in) packed for `DecodeKernel.linear`: `data` (ceil(out / PW), in, PW)
    float32, panel p holding output columns p*PW .. p*PW+PW-1 side by side for each input
    (decode_kernel.c, part 2), the last panel padded with zeros."""

    data: torch.Tensor
    out_features: int
    in_features: int


class DecodeKernel:
    """The C functions, bound: `attend(q, k, v, tables, lengths, scale, block_size)`,
    `pack(weight)`, `linear(x, packed, bias)` and `one_row(x, weight, bias)`,
    `rms_norm(x, weight, eps)`, `decode_layers(...)`, and the
    pieces of a step of more rows (`step`, `attend_step`). Each
    runs on torch's intra-op thread count (`torch.get_num_threads()`, read at every call,
    as torch's own operators do)."""

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
        self._one_row = lib.one_row_linear
        self._one_row.argtypes = [P, P, P, i32, i32, P, i32]
        self._pack = lib.pack_panels
        self._pack.argtypes = [P, i32, i32, P]
        lib.panel_width.restype = i32
        self.panel_width = lib.panel_width()  # PW: output columns a panel holds
        self._norm = lib.rms_norm
        self._norm.argtypes = [P, P, i32, i32, ctypes.c_float, P]
        self._layers = lib.decode_layers
        self._layers.argtypes = [ctypes.POINTER(Layer), i32, ctypes.POINTER(Step)]
        self._exp = lib.exp_floats
        self._exp.argtypes = [P, i64, P]
        self._attend_step = lib.decode_attend
        self._attend_step.argtypes = [ctypes.POINTER(Step), P, P, P, P]
        self._silu_mul = lib.silu_mul
        self._silu_mul.argtypes = [P, i32, i32, P, i32]
        for f in (self._scores, self._values, self._linear, self._pack, self._norm, self._layers,
                  self._attend_step, self._exp, self._one_row, self._silu_mul):
            f.restype = None

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

    def pack(self, weight: torch.Tensor) -> Panels:
        """weight (out, in), float32 on the CPU -> a copy in the panels `linear` reads
        (decode_kernel.c, `pack_panels`): (ceil(out / PW), in, PW), PW = `panel_width`."""
        n_out, n_in = weight.shape
        assert weight.dtype == torch.float32 and weight.device.type == "cpu"
        weight = weight.detach().contiguous()
        data = torch.empty(-(-n_out // self.panel_width), n_in, self.panel_width)
        self._pack(weight.data_ptr(), n_out, n_in, data.data_ptr())
        return Panels(data, n_out, n_in)

    def linear(self, x: torch.Tensor, weight: Panels,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (N, in) @ W (out, in).T + bias (out,) -> (N, out), float32 on the CPU, with W
        as `pack` returned it: F.linear, read the way a decode step's rows read fastest
        (decode_kernel.c, `rows_linear`)."""
        rows, n_in = x.shape
        n_out = weight.out_features
        x = x.contiguous()
        assert weight.in_features == n_in and x.dtype == torch.float32
        assert bias is None or (bias.shape == (n_out,) and bias.is_contiguous())
        y = torch.empty(rows, n_out)
        self._linear(x.data_ptr(), weight.data.data_ptr(),
                     None if bias is None else bias.data_ptr(),
                     rows, n_out, n_in, y.data_ptr(), torch.get_num_threads())
        return y  # (N, out)

    def one_row(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (1, in) @ weight (out, in).T + bias -> (1, out), weight as it is (contiguous
        float32): each weight row read once, in order (decode_kernel.c, `row_linear`)."""
        n_out, n_in = weight.shape
        x = x.contiguous()
        assert x.shape == (1, n_in) and x.dtype == weight.dtype == torch.float32
        assert weight.is_contiguous() and (bias is None or bias.is_contiguous())
        y = torch.empty(1, n_out)
        self._one_row(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                      n_out, n_in, y.data_ptr(), torch.get_num_threads())
        return y  # (1, out)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """HF's LlamaRMSNorm of x (N, E), float32: weight * x / sqrt(mean(x^2) + eps)
        (into `out`, contiguous (N, E), when given)."""
        x = x.contiguous()
        y = torch.empty_like(x) if out is None else out
        self._norm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, y.data_ptr())
        return y

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        """exp of every float of x, float32, the way the kernel's softmax and SiLU take it
        (decode_kernel.c, `exp8`): to check it against torch.exp."""
        x = x.contiguous()
        assert x.dtype == torch.float32
        y = torch.empty_like(x)
        self._exp(x.data_ptr(), x.numel(), y.data_ptr())
        return y

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up (N, 2I) float32, gate then up -> silu(gate) * up (N, I), into `out`
        (contiguous (N, I)) when given, through the kernel's exp (decode_kernel.c,
        `silu_mul`). For a decode step's rows (`CompactLlama.decode_rows`): one call, and
        threads only from 64 rows of 1,536 on. PyTorch's `F.silu` and `mul_` are two
        parallel regions a layer: at 8 rows of SmolLM2 they took 0.7-1.3 ms of a 27 ms
        tick (30 layers, quiet, 2 threads), this 0.35-0.8 ms."""
        gate_up = gate_up.contiguous()
        N, two_i = gate_up.shape
        assert gate_up.dtype == torch.float32 and two_i % 2 == 0
        y = torch.empty(N, two_i // 2) if out is None else out
        assert y.is_contiguous() and y.shape == (N, two_i // 2)
        self._silu_mul(gate_up.data_ptr(), N, two_i // 2, y.data_ptr(), torch.get_num_threads())
        return y

    def attend_step(self, step: Step, qkv: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A decode step's attention block between its q/k/v and o matmuls
        (decode_kernel.c, part 4): RoPE, the rows' new K/V into the pools, then softmax
        of the scores over the rows' values -> out (N, H, D). qkv (N, (H + 2 H_kv) D)
        contiguous; the step's scores scratch is overwritten."""
        assert qkv.is_contiguous() and qkv.shape[0] == step.N and out.is_contiguous()
        self._attend_step(ctypes.byref(step), qkv.data_ptr(), k_pool.data_ptr(),
                          v_pool.data_ptr(), out.data_ptr())
        return out

    @staticmethod
    def layer_table(layers: list[dict], pools: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> ctypes.Array:
        """The C `Layer` array of a forward's layers: each a dict of "ln1", "ln2" (weight
        tensors), "qkv", "o", "gate_up", "down" (objects with `.panels`, the weight as
        `pack` returns it, and `.bias`, contiguous or None) and "plain" (None, or the
        weights by PLAIN_FIELDS name as HF keeps them, contiguous, read at one row), with
        its layer's (K, V) pools. Pointers only: the
        tensors must outlive the array (the runner and the storage hold them)."""
        def ptr(t):
            return None if t is None else t.data_ptr()

        table = (Layer * len(layers))()
        for entry, w, (k_pool, v_pool) in zip(table, layers, pools):
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(entry, name, ptr(w[name].panels.data))
                setattr(entry, name + "_bias", ptr(w[name].bias))
            entry.ln1, entry.ln2 = ptr(w["ln1"]), ptr(w["ln2"])
            entry.k_pool, entry.v_pool = ptr(k_pool), ptr(v_pool)
            plain = w.get("plain")  # the HF weights, (out, in), for one row; else panels
            if plain is not None:
                for name in PLAIN_FIELDS:
                    setattr(entry, f"{name}_w", ptr(plain[name]))
        return table

    def decode_layers(self, table: ctypes.Array, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                      lengths: torch.Tensor, heads: int, kv_heads: int, intermediate: int,
                      block_size: int, num_slots: int, eps: float, scale: float) -> None:
        """Every layer of `table` for the rows of x (N, E), updated in place: cos, sin
        (N, D) at the rows' positions; slots (N,) where each row's new K/V goes; tables
        (N, M) and lengths (N,) int64 as `attend` takes them (every id < the pool's
        blocks: the C code does not check)."""
        step, _bufs = self.step(x, cos, sin, slots, tables, lengths, heads, kv_heads,
                                intermediate, block_size, num_slots, eps, scale)
        self._layers(table, len(table), ctypes.byref(step))  # _bufs: alive till here

    @staticmethod
    def step(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
             tables: torch.Tensor, lengths: torch.Tensor, heads: int, kv_heads: int,
             intermediate: int, block_size: int, num_slots: int, eps: float,
             scale: float) -> tuple[Step, dict[str, torch.Tensor]]:
        """The C `Step` of a decode step of the rows of x (N, E), and its scratch tensors
        by name. The Step holds pointers only: the caller keeps every tensor passed here,
        and the scratch, alive as long as it uses the Step."""
        N, E = x.shape
        D = cos.shape[1]
        M = tables.shape[1]
        for t in (x, cos, sin, slots, tables, lengths):
            assert t.is_contiguous() and t.device.type == "cpu"
        assert x.dtype == cos.dtype == sin.dtype == torch.float32
        assert slots.dtype == tables.dtype == lengths.dtype == torch.int64
        scratch = {"h": (N, E), "qkv": (N, (heads + 2 * kv_heads) * D), "q": (N, heads, D),
                   "att": (N, heads, D), "scores": (N, heads, M * block_size),
                   "gu": (N, 2 * intermediate), "act": (N, intermediate)}
        bufs = {name: torch.empty(shape) for name, shape in scratch.items()}
        step = Step(N=N, E=E, H=heads, H_kv=kv_heads, D=D, I=intermediate, S=block_size, M=M,
                    threads=torch.get_num_threads(), num_slots=num_slots, eps=eps, scale=scale,
                    x=x.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
                    slots=slots.data_ptr(), tables=tables.data_ptr(), lens=lengths.data_ptr(),
                    **{name: t.data_ptr() for name, t in bufs.items()})
        return step, bufs


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
    flags = repr((FLAGS, EXTRA_FLAGS)).encode()  # a change of flags is a new build
    key = hashlib.sha256(src + flags + version.encode() + _cpu_id().encode()).hexdigest()[:16]
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

"""A compact forward for the Llama family: the model step written out, in one file.

Why this exists. The paged backend can run Hugging Face's own model (`model_runner="hf"`):
no forked model code, every architecture transformers knows. But on a CPU a decode
step of a small model is not only arithmetic. SmolLM2-135M has 30 layers; HF's
forward goes through a dozen `nn.Module` calls per layer, each with hook checks and
keyword plumbing, plus per forward a mask builder and the rotary module, per layer the
AttentionInterface lookup, separate q/k/v and gate/up projections, and transposes
and `.contiguous()` copies between them. All of that is on top of the weight matmuls
(~20 ms per step at batch 1 on a quiet 2-core machine, ~50 ms at batch 8-16):
docs/benchmarks.md, "Compact forward", measures both paths and that floor.

This file is the same math with the plumbing taken out, in the style of nano-vllm
(github.com/GeeeekExplorer/nano-vllm) and vLLM's model files:

* the weights are taken once from the loaded HF model: q, k and v stacked into one
  (H + 2*H_kv) * D x E matrix, gate and up into one 2*I x E matrix, so a layer does
  4 weight matmuls instead of 7 (one larger matmul beats several small ones, and
  saves their per-op overhead); each matmul reads its weight the way that is fastest
  for the rows it has (`Linear`: a C matmul on weights packed in panels up to 64
  rows, a decode step; oneDNN above, a prompt);
* RoPE's cos/sin are computed once for every position up to `max_model_len` (with
  HF's own rope init function, so rope scaling such as "llama3" or "linear" comes out
  the same) and looked up by position: no rotary module per forward;
* q and k are rotated together, as one (N, H + H_kv, D) tensor;
* attention is `paged.paged_attention` called directly with the forward's block
  tables (`PagedForward`): no AttentionInterface, no per-layer cache objects, and the
  GQA grouping is done there without copying K/V per query head;
* logits are computed only for the tokens that are sampled (a decode row's token, a
  prompt's last token): the output head (V x E, the largest matmul for a small model)
  never runs on the other positions.

HF's model stays the oracle: tests/test_compact.py checks this forward token-exact
against `generate` and its logits allclose against the HF path. Anything it does not
compute (another architecture, a rope type that changes with the length) is refused
at construction with the reason; `model_runner="hf"` runs those.

The token layout is the paged backend's: the forward's new tokens are one flat
sequence of N tokens (B rows x T tokens, or a mixed batch's decode tokens and chunks
side by side, B = 1), so every tensor here is (N, ...) until attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backends.paged import PagedForward, paged_attention
from . import decode_kernel

# HF model_type -> its layers are Llama's (pre-norm RMSNorm, RoPE, SiLU-gated MLP),
# differing only in biases: Qwen2 has q/k/v biases, Mistral a sliding window (the paged
# backend refuses a window smaller than the context before we get here).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Rope types whose cos/sin depend only on the position (not on the current length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported_reasons(config) -> list[str]:
    """Why `CompactLlama` cannot run a model with this HF config (empty: it can)."""
    reasons = []
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        reasons.append(f"model_type={config.model_type!r} (compact runs {SUPPORTED_MODEL_TYPES})")
    if getattr(config, "hidden_act", "silu") != "silu":
        reasons.append(f"hidden_act={config.hidden_act!r} (compact runs 'silu')")
    rope = _rope_parameters(config)
    if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
        reasons.append(f"rope_type={rope.get('rope_type')!r} (compact runs {STATIC_ROPE_TYPES})")
    return reasons


def runner_for(mode: str, model: torch.nn.Module, max_model_len: int) -> CompactLlama | None:
    """The runner `EngineConfig.model_runner` asks for: None for "hf" (the HF model's own
    forward), and for "auto" where compact cannot run the model; "compact" refuses such
    a model (`CompactLlama` raises saying why)."""
    if mode == "compact" or (mode == "auto" and not unsupported_reasons(model.config)):
        return CompactLlama(model, max_model_len)
    return None


def rows_kernel_for(weight: torch.Tensor) -> decode_kernel.DecodeKernel | None:
    """The C kernel whose `linear` multiplies a decode step's rows (decode_kernel.c,
    `rows_linear`) for a model with this kind of weight: float32 on the CPU, where a C compiler builds
    it; else None (oneDNN or F.linear do every matmul)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    try:
        return decode_kernel.load()
    except RuntimeError as e:
        from ..failures import log

        log.info("compact forward without its C matmul for a few rows: %s", e)
        return None


def _rope_parameters(config) -> dict:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
                or {})


class CompactLlama:
    """The Llama-family forward over the paged KV pool: `forward(ids, positions, ctx, keep)`.

    Built from a loaded HF `*ForCausalLM`; keeps its own fused, prepacked copies of the
    projection weights and the output head (`Linear`; for SmolLM2-135M ~135 M floats,
    540 MB in fp32), a second copy of them packed in panels for the C matmul of a decode
    step (540 MB more), and shares the rest (embedding, norms) with the HF model.
    `kernel`: the C kernel for decode steps ("auto": built where it runs,
    `rows_kernel_for`; None: oneDNN for every matmul, and no panels).
    """

    # Decode steps of up to this many rows run every layer in C (`decode_in_c`), its
    # matmuls included; more rows go through `decode_rows`. Both run the same C matmul,
    # attention and SiLU; they differ by the ~7 calls a layer `decode_rows` makes from
    # Python. Median ticks of SmolLM2 with `decode_in_c` against `decode_rows` (2
    # threads, 5 rounds each way, alternating, one process, quiet): 26.4 against 26.9 ms
    # at 8 rows, 39.6 against 40.3 at 16, 72.2 against 76.0 at 32, but 145 against 133 at
    # 64. At 1 row it took 20.4 ms against 22.1.
    STEP_IN_C_ROWS = 32
    # Rows of a forward (a prompt's tokens) that go through a layer's matmuls together:
    # a (512, 2I) block of the MLP is 6 MB for SmolLM2; oneDNN ran 512 rows of its four
    # matmuls at ~215 GFLOP/s here, 2,764 rows at once at ~186.
    ROW_BLOCK = 512

    def __init__(self, model: torch.nn.Module, max_model_len: int,
                 kernel: decode_kernel.DecodeKernel | None | str = "auto") -> None:
        cfg = model.config
        reasons = unsupported_reasons(cfg)
        if reasons:
            raise ValueError(f"model_runner='compact' cannot run {type(model).__name__}: "
                             f"{'; '.join(reasons)}. Use model_runner='hf'")
        self.num_heads = cfg.num_attention_heads  # H
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads  # H_kv
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads  # D
        self.eps = cfg.rms_norm_eps
        inner = model.model  # LlamaModel: embed_tokens, layers, norm, rotary_emb
        self.embed = inner.embed_tokens.weight  # (V, E)
        self.final_norm = inner.norm.weight  # (E,)
        if kernel == "auto":
            kernel = rows_kernel_for(self.embed)
        self.kernel = kernel
        self.layers = [self._fuse(layer, kernel) for layer in inner.layers]
        head = model.get_output_embeddings()  # Linear E -> V (tied to the embedding or not)
        self.head = Linear(head.weight, head.bias, kernel, plain=True)  # (V, E): packed copies
        self.cos, sin = self._rope_tables(inner.rotary_emb, max_model_len)  # (P, D) each
        # RoPE rotates x = [x1 | x2] into x * cos + [-x2 | x1] * sin (HF's rotate_half).
        # The same, with the minus sign moved into a table: x * cos + roll(x) * sin_signed,
        # roll(x) = [x2 | x1] and sin_signed = [-sin1 | sin2]: 4 operators instead of 7,
        # and the same floats (a negation is exact).
        half = sin.shape[-1] // 2
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # (P, D)
        self.scale = self.head_dim ** -0.5
        self._table = None  # (storage, C layer table) for decode_in_c, built on first use

    @staticmethod
    @torch.no_grad()
    def _fuse(layer: torch.nn.Module, kernel=None) -> dict[str, torch.Tensor | None]:
        """One decoder layer's weights, with q/k/v and gate/up stacked row-wise."""
        att, mlp = layer.self_attn, layer.mlp

        def cat_bias(*linears):
            if all(lin.bias is None for lin in linears):
                return None
            return torch.cat([lin.bias if lin.bias is not None
                              else lin.weight.new_zeros(lin.out_features) for lin in linears])

        hf = {"q": att.q_proj, "k": att.k_proj, "v": att.v_proj, "o": att.o_proj,
              "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
        return {
            # HF's own weights, (out, in), read row after row by a step of one row (no copy)
            "plain": ({n: lin.weight.detach() for n, lin in hf.items()} if kernel is not None
                      and all(Linear.plain_ok(lin.weight) for lin in hf.values()) else None),
            "ln1": layer.input_layernorm.weight,  # (E,)
            "qkv": Linear(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),
                          cat_bias(att.q_proj, att.k_proj, att.v_proj), kernel),
            # ^ ((H + 2*H_kv) * D, E): rows 0..H*D-1 make q, then k, then v
            "o": Linear(att.o_proj.weight, att.o_proj.bias, kernel, plain=True),  # (E, H*D)
            "ln2": layer.post_attention_layernorm.weight,  # (E,)
            "gate_up": Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                              cat_bias(mlp.gate_proj, mlp.up_proj), kernel),  # (2I, E)
            "down": Linear(mlp.down_proj.weight, mlp.down_proj.bias, kernel, plain=True),  # (E, I)
        }

    @staticmethod
    @torch.no_grad()
    def _rope_tables(rotary_emb: torch.nn.Module, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions 0..max_len-1, each (max_len, D), from HF's own rotary
        module (its inv_freq and attention scaling already include any rope scaling)."""
        inv_freq = rotary_emb.inv_freq.float()  # (D/2,)
        pos = torch.arange(max_len, dtype=torch.float32, device=inv_freq.device)  # (P,)
        freqs = pos[:, None] * inv_freq[None, :]  # (P, D/2): as HF computes it, per element
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D): HF's "rotate_half" layout
        scaling = getattr(rotary_emb, "attention_scaling", 1.0)
        return emb.cos() * scaling, emb.sin() * scaling  # float32; cast per forward, as HF does

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """HF's LlamaRMSNorm: x / rms(x) * w, normalised in float32 as HF does. For fp32
        `F.rms_norm` gives HF's result bit for bit, in one operator instead of six."""
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx: PagedForward,
                logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """ids, positions (B, T) -> float32 logits (B, K, V) at the kept positions
        (`logits_to_keep`: the last k per row, or indices into T), as the HF path returns."""
        B, T = ids.shape
        if self._in_c(ctx, B, T, logits_to_keep):
            if B <= self.STEP_IN_C_ROWS:
                return self.decode_in_c(ids, positions, ctx)
            return self.decode_rows(ids, positions, ctx)
        N = B * T
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        R = self.ROW_BLOCK
        x = F.embedding(ids.reshape(N), self.embed)  # (N, E): flat tokens, row after row
        pos = positions.reshape(N)
        cos = self.cos[pos].unsqueeze(1).to(x.dtype)  # (N, 1, D): broadcasts over heads
        sin = self.sin_signed[pos].unsqueeze(1).to(x.dtype)
        for i, w in enumerate(self.layers):
            # A prompt's thousands of tokens go through each matmul R rows at a time, so
            # the rows and what is made of them stay in cache: a prefill of 2,764 tokens
            # (32 prompts) took 0.88x the time of one pass over all of them (medians of 4,
            # interleaved, 2 threads), the same math. Attention takes every token at once.
            # --- attention block: x + o_proj(attention(rope(q), rope(k), v)) -------------
            qks, vs = [], []
            for s in range(0, N, R):
                h = self._rms_norm(x[s:s + R], w["ln1"])  # (r, E)
                qkv = w["qkv"](h)  # (r, (H + 2*H_kv) * D)
                qk = qkv[:, :(H + H_kv) * D].view(-1, H + H_kv, D)  # q heads then k heads
                qks.append(qk * cos[s:s + R] + qk.roll(D // 2, dims=-1) * sin[s:s + R])  # RoPE
                vs.append(qkv[:, (H + H_kv) * D:])  # (r, H_kv * D)
            qk = qks[0] if len(qks) == 1 else torch.cat(qks)  # (N, H + H_kv, D)
            v = vs[0] if len(vs) == 1 else torch.cat(vs)  # (N, H_kv * D)
            q = qk[:, :H].view(B, T, H, D).transpose(1, 2)  # (B, H, T, D): the HF layout
            k = qk[:, H:].view(B, T, H_kv, D).transpose(1, 2)  # (B, H_kv, T, D)
            v = v.view(B, T, H_kv, D).transpose(1, 2)  # (B, H_kv, T, D)
            o = paged_attention(ctx, i, q, k, v, self.scale).reshape(N, H * D)  # (N, H*D)
            for s in range(0, N, R):
                x_r = x[s:s + R]  # (r, E): a view, updated in place
                x_r += w["o"](o[s:s + R])
                # --- MLP block: x + down(silu(gate(h)) * up(h)) --------------------------
                gate_up = w["gate_up"](self._rms_norm(x_r, w["ln2"]))  # (r, 2I)
                gate, up = gate_up.chunk(2, dim=-1)  # (r, I) each
                x_r += w["down"](F.silu(gate).mul_(up))
        # --- output head, only where a token is sampled ----------------------------------
        x = x.view(B, T, -1)  # (B, T, E)
        if isinstance(logits_to_keep, int):
            x = x[:, -logits_to_keep:]  # (B, k, E)
        else:
            x = x[:, logits_to_keep]  # (B, K, E)
        x = self._rms_norm(x, self.final_norm)  # (B, K, E)
        return self.head(x.reshape(-1, x.shape[-1])).view(*x.shape[:2], -1).float()  # (B, K, V)


    # --- a decode step of a few rows, every layer in C -----------------------------------
    def _in_c(self, ctx: PagedForward, B: int, T: int, logits_to_keep) -> bool:
        """Whether this forward is a decode step run with C between its matmuls: one
        token for each row, with the engine's decode attention in C (the group has
        `lengths`: decode_attention="kernel"/"auto"; with "torch" the loop below keeps
        PyTorch's attention, as that knob asks). Up to `STEP_IN_C_ROWS` rows
        `decode_in_c` runs it, more rows `decode_rows`."""
        return (self.kernel is not None and T == 1 and logits_to_keep == 1
                and len(ctx.groups) == 1 and ctx.groups[0].lengths is not None)

    def decode_in_c(self, ids: torch.Tensor, positions: torch.Tensor,
                    ctx: PagedForward) -> torch.Tensor:
        """The forward below for a decode step of a few rows, with every layer in one C
        call (decode_kernel.c, part 3): the same math, without the ~25 PyTorch operators a
        layer costs between its four matmuls. ids, positions (B, 1) -> logits (B, 1, V)."""
        B = ids.shape[0]
        g = ctx.groups[0]
        if self._table is None or self._table[0] is not ctx.storage:  # pointers, once per pool
            pools = [ctx.storage.flat(i) for i in range(len(self.layers))]
            self._table = (ctx.storage, self.kernel.layer_table(self.layers, pools))
        x = F.embedding(ids.reshape(B), self.embed)  # (B, E): a copy, updated in place
        pos = positions.reshape(B)
        self.kernel.decode_layers(
            self._table[1], x, self.cos[pos], self.sin_signed[pos], ctx.write_slots,
            g.read_blocks, g.lengths, self.num_heads, self.num_kv_heads,
            self.layers[0]["down"].shape[1], ctx.storage.block_size,
            ctx.storage.flat(0)[0].shape[1], self.eps, self.scale)
        x = self.kernel.rms_norm(x, self.final_norm, self.eps)  # (B, E)
        return self.head(x).view(B, 1, -1)  # (B, 1, V), float32

    def decode_rows(self, ids: torch.Tensor, positions: torch.Tensor,
                    ctx: PagedForward) -> torch.Tensor:
        """The forward below for a decode step of more rows than `decode_in_c` takes: the
        four matmuls of each layer stay `Linear`'s (the C matmul on panels up to
        `Linear.PANEL_ROWS` rows, oneDNN above), and what lies between them is 4 C calls
        (decode_kernel.c, part 4: the norms, RoPE, the K/V write, scores, softmax and
        values in one, and SiLU times up) and the residual adds instead of the loop's ~25
        PyTorch operators. ids, positions (B, 1) -> logits (B, 1, V)."""
        B = ids.shape[0]
        g, K = ctx.groups[0], self.kernel
        H, D = self.num_heads, self.head_dim
        x = F.embedding(ids.reshape(B), self.embed)  # (B, E): a copy, updated in place
        pos = positions.reshape(B)
        cos, sin = self.cos[pos], self.sin_signed[pos]  # (B, D) each; `step` points into them
        step, buf = K.step(x, cos, sin, ctx.write_slots,
                           g.read_blocks, g.lengths, H, self.num_kv_heads,
                           self.layers[0]["down"].shape[1], ctx.storage.block_size,
                           ctx.storage.flat(0)[0].shape[1], self.eps, self.scale)
        for i, w in enumerate(self.layers):
            k_pool, v_pool = ctx.storage.flat(i)  # (H_kv, num_slots, D) each
            h = K.rms_norm(x, w["ln1"], self.eps, out=buf["h"])  # (B, E)
            att = K.attend_step(step, w["qkv"](h), k_pool, v_pool, buf["att"])  # (B, H, D)
            x += w["o"](att.view(B, H * D))  # (B, E)
            h = K.rms_norm(x, w["ln2"], self.eps, out=buf["h"])
            act = K.silu_mul(w["gate_up"](h), out=buf["act"])  # (B, 2I) -> (B, I)
            x += w["down"](act)
        x = K.rms_norm(x, self.final_norm, self.eps)  # (B, E)
        return self.head(x).view(B, 1, -1)  # (B, 1, V), float32


class Linear:
    """`x (N, in) -> x @ W.T + b (N, out)`, what `F.linear` computes, each batch read the
    way that is fastest for it.

    Up to `PANEL_ROWS` rows (a decode step): the C matmul of decode_kernel.c
    (`rows_linear`), on a copy of W packed once into panels of 16 or 32 output columns,
    each read as one sequential stream, the rows' sums in registers. There a matmul's
    time is mostly the time to read W: on the reference AMD EPYC it ran SmolLM2's
    matmuls in 0.6-0.9x oneDNN's time at 1-64 rows (`minserve bench linear`). A row
    alone, where W is the model's own tensor (`plain`), reads W as it is, row after
    row (`DecodeKernel.one_row`), 5-10 % faster than the panels there.

    More rows (a prompt, a mixed batch): oneDNN with the weight reordered ONCE into its
    blocked layout (the op PyTorch's own compiler emits for a frozen linear layer on CPU,
    `mkldnn._linear_pointwise`, and the kind of kernel vLLM's CPU build calls), which ran
    SmolLM2's linear layers 1.2-1.7x faster than `F.linear` at 33-512 rows on 2 threads
    (docs/benchmarks.md, "Linear layers").

    Same product, other summation orders: logits agree to float rounding, not bit for
    bit (the oracle tests compare tokens). Without oneDNN or the C kernel (a GPU, a build
    without them, another dtype) it is plain `F.linear`. Memory: each copy is the size
    of W (540 MB each for SmolLM2-135M in fp32).
    """

    PACK_FOR_BATCH = 16  # the layout oneDNN picks for M = 16 rows served B = 1..64 best here
    PANEL_ROWS = 64  # rows up to which the C matmul beat oneDNN here (bench linear)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernel: decode_kernel.DecodeKernel | None = None, plain: bool = False) -> None:
        """`plain`: W is the model's own tensor, kept alive by it: a row alone reads it as
        it is (`DecodeKernel.one_row`) instead of the panels. Not for a fused weight
        built for this Linear (holding it would keep a third copy)."""
        self.weight, self.bias = weight, bias  # (out, in), (out,) or None
        self.shape = tuple(weight.shape)  # (out, in)
        self.packed = self.panels = None
        self.plain = weight.detach() if plain and kernel is not None and self.plain_ok(weight) \
            else None
        plain_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.kernel = kernel if plain_cpu else None
        if self.kernel is not None:  # a copy in panels, for the C matmul
            self.panels = self.kernel.pack(weight)
            self.bias = None if bias is None else bias.detach().contiguous()
        if plain_cpu and torch.backends.mkldnn.is_available():
            # a copy in oneDNN's blocked layout
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                  self.PACK_FOR_BATCH)
            self.weight = None  # the plain one stays with the HF model (and `plain`, if asked)

    @staticmethod
    def plain_ok(weight: torch.Tensor) -> bool:
        """Whether the C kernel can read this weight as it is (one row's matmul)."""
        return (weight.device.type == "cpu" and weight.dtype == torch.float32
                and weight.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and self.plain is not None and x.shape[0] == 1:
            return self.kernel.one_row(x, self.plain, self.bias)
        if self.kernel is not None and x.shape[0] <= self.PANEL_ROWS:
            return self.kernel.linear(x, self.panels, self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                  "none", [], "")

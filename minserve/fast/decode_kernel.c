/* A decode step's two costly parts in C: minserve's one C file.

   1. Attention over block tables, read in place (`decode_scores`, `decode_values`).
   2. The weight matmuls of a step of a few rows (`rows_linear`).
   3. A whole decode step of a few rows (`decode_layers`).
   4. What lies between the matmuls of a decode step of more rows (`decode_rope_scores`,
      `decode_values_of`, `rms_norm`).

   1. What it computes is `paged._attend` for T = 1 (one new token per row), the readable
   PyTorch version and the reference this kernel is tested against
   (tests/test_decode_kernel.py). Why it exists: on a CPU that version spends most of
   its time in copies and in call overhead, not in arithmetic. It gathers every row's
   blocks into a padded (H_kv, B, L, D) tensor per layer (a copy of the whole history),
   then runs two batched matmuls whose B * H_kv small products (3 x 64 @ 64 x L) cost
   far more per call than their floating-point work. Here each row's keys and values
   are read where they lie in the pool, once, with no padding, and the G query heads
   that share a KV head share each load. PagedAttention's CUDA kernel and vLLM's CPU
   one do the same (Kwon et al., SOSP 2023). Softmax stays in PyTorch, between the two
   functions: its vectorised exp is as exact as HF's.

   Layouts (float32, C order), as kv_storage.KVBlockStorage keeps them:

       pool      (H_kv, num_blocks * S, D)  one layer's K (or V); token t of a row is
                                             slot table[t / S] * S + t % S
       q         (B, H, D)                  query head h reads KV head h / G, G = H / H_kv
       tables    (B, M) int64               each row's block table, padded with any valid id
       lens      (B,) int64                 tokens each row holds (its own token included)
       scores    (B, H, M * S)              -inf past a row's length, so softmax ignores it
       probs     (B, H, M * S)              softmax(scores)
       out       (B, H, D)

   D must be a multiple of 8: the inner loops work on 8 floats at a time (`v8`, one AVX
   register; GCC and Clang map the vector type onto whatever the CPU has).

   2. See `rows_linear` below: at one to a few dozen rows a matmul's speed is the memory's.

   Threads: each function takes a thread count (torch's, passed by decode_kernel.py) and
   splits its independent work over that many OpenMP threads when built with -fopenmp
   (torch's own OpenMP runtime, already loaded, runs them). At 1 thread, or built
   without OpenMP, the loops run as written. Built once on first use with the machine's
   C compiler (decode_kernel.py); nothing here is CUDA-only, and without a compiler the
   engine runs the PyTorch versions. */

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));  /* 8 floats */
typedef float v4 __attribute__((vector_size(16)));

static inline v8 load8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }

static inline float hsum8(v8 x) {  /* a tree of adds, not a chain of 7 dependent ones */
    v4 lo = {x[0], x[1], x[2], x[3]}, hi = {x[4], x[5], x[6], x[7]}, s = lo + hi;
    return (s[0] + s[2]) + (s[1] + s[3]);
}

static inline float dot(const float *a, const float *b, int D) {
    v8 acc = {0};
    for (int d = 0; d < D; d += 8) acc += load8(a + d) * load8(b + d);
    return hsum8(acc);
}

/* scores[b, h, t] = scale * q[b, h] . K[h / G][slot of token t of row b], t < lens[b] */
void decode_scores(const float *q, const float *k_pool, const int64_t *tables,
                   const int64_t *lens, int B, int H, int H_kv, int D, int64_t num_slots,
                   int S, int M, float scale, float *scores, int threads) {
    const int G = H / H_kv;
    const int64_t L = (int64_t)M * S;
    /* every (row, KV head) pair writes its own G rows of scores: split them over threads */
    #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(dynamic)
    for (int bh = 0; bh < B * H_kv; bh++) {
        const int b = bh / H_kv, hk = bh % H_kv;
        const int64_t len = lens[b];
        const float *kh = k_pool + (int64_t)hk * num_slots * D;  /* this head's slots */
        const float *qh = q + ((int64_t)b * H + hk * G) * D;      /* (G, D) */
        float *out = scores + ((int64_t)b * H + hk * G) * L;      /* (G, L) */
        for (int g = 0; g < G; g++)
            for (int64_t t = len; t < L; t++) out[g * L + t] = -INFINITY;
        for (int j = 0; (int64_t)j * S < len; j++) {   /* block j of the row's table */
            const float *kb = kh + tables[(int64_t)b * M + j] * S * D;  /* (S, D) */
            const int n = len - (int64_t)j * S < S ? (int)(len - (int64_t)j * S) : S;
            for (int g = 0; g < G; g++) {
                const float *qv = qh + g * D;
                float *o = out + g * L + (int64_t)j * S;
                int s = 0;
                for (; s + 4 <= n; s += 4) {  /* 4 keys at a time: 4 independent sums */
                    const float *k0 = kb + s * D;
                    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                    for (int d = 0; d < D; d += 8) {
                        const v8 qd = load8(qv + d);
                        a0 += qd * load8(k0 + d);
                        a1 += qd * load8(k0 + D + d);
                        a2 += qd * load8(k0 + 2 * D + d);
                        a3 += qd * load8(k0 + 3 * D + d);
                    }
                    o[s] = hsum8(a0) * scale;
                    o[s + 1] = hsum8(a1) * scale;
                    o[s + 2] = hsum8(a2) * scale;
                    o[s + 3] = hsum8(a3) * scale;
                }
                for (; s < n; s++) o[s] = dot(qv, kb + s * D, D) * scale;
            }
        }
    }
}

/* out[b, h] = sum over t < lens[b] of probs[b, h, t] * V[h / G][slot of token t of row b] */
void decode_values(const float *probs, const float *v_pool, const int64_t *tables,
                   const int64_t *lens, int B, int H, int H_kv, int D, int64_t num_slots,
                   int S, int M, float *out, int threads) {
    const int G = H / H_kv;
    const int64_t L = (int64_t)M * S;
    #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(dynamic)
    for (int bh = 0; bh < B * H; bh++) {  /* every (row, query head) writes its own D floats */
        const int b = bh / H, h = bh % H;
        const int64_t len = lens[b];
        const float *vh = v_pool + (int64_t)(h / G) * num_slots * D;
        const float *p = probs + ((int64_t)b * H + h) * L;  /* (L,) */
        float *o = out + ((int64_t)b * H + h) * D;          /* (D,) */
        for (int d0 = 0; d0 < D; d0 += 64) {  /* 64 floats of the output, in registers */
            const int w = D - d0 < 64 ? D - d0 : 64;
            v8 acc[8] = {{0}};
            for (int j = 0; (int64_t)j * S < len; j++) {
                const float *vb = vh + tables[(int64_t)b * M + j] * S * D + d0;
                const int n = len - (int64_t)j * S < S ? (int)(len - (int64_t)j * S) : S;
                for (int s = 0; s < n; s++) {
                    const float pw = p[(int64_t)j * S + s];
                    for (int i = 0; i < w / 8; i++) acc[i] += pw * load8(vb + s * D + 8 * i);
                }
            }
            memcpy(o + d0, acc, sizeof(float) * w);
        }
    }
}


/* ---- 2. The weight matmuls of a decode step -----------------------------------------

   y (N, O) = x (N, I) @ W (O, I)^T (+ bias (O,)): what F.linear computes, for the N = 1..32
   rows of a decode step (fast/compact.py's `Linear` calls it there, oneDNN above), on a
   copy of W packed once into panels (`pack_panels`).

   Why. At one row a matmul reads each weight once and does 2 flops per 4 bytes read: the
   memory sets its time. At 8-32 rows each weight loaded feeds 8-32 multiply-adds, so
   the arithmetic must keep up with the reads too. On the 2-core AMD EPYC of the
   reference runs, oneDNN's prepacked linear read SmolLM2's weights at 17-22 GB/s at
   1-8 rows, against 26-29 GB/s for a plain sum of them (`minserve bench floor`,
   `minserve bench linear`). Here:

     * W is copied once into panels of PW output columns (PW = 32 with AVX-512, 16
       without): panel p holds, for each input i, the PW weights W[p*PW .. p*PW+PW-1, i]
       side by side. Reading a panel is one sequential stream, the pattern the CPU's
       prefetcher follows best.

           Wp (O/PW, I, PW)   panel p: i=0 [w w ... w]  i=1 [w w ... w]  ...  (PW each)

     * a tile of MR rows of x (MR <= MAXR: 12 with AVX-512, 6 without) times one panel
       keeps its MR x PW sums in 2*MR vector registers. For each input i: two vector loads
       of the panel, MR broadcasts of x[m, i] (the rows sit in the L1 cache), 2*MR
       multiply-adds. The panel is read from memory once, by the first tile; a second
       tile of rows finds it in the L2 cache (SmolLM2's largest panel is 192 KB).

           y[m, p*PW + j] = sum_i x[m, i] * Wp[p, i, j]    (j over the 2 vectors)

   Threads split the panels into contiguous ranges: each still one stream.

   Numerics: each output is one float32 sum over i in order, another order than oneDNN's
   or MKL's (which split i): equal to float rounding, not bit for bit
   (tests/test_compact.py compares tokens with HF and logits to 1e-4). */

#if defined(__AVX512F__)
#define PW 32    /* a panel: 2 registers of 16 floats */
#define MAXR 12  /* 24 sums + 2 weights + 1 broadcast of AVX-512's 32 registers */
#else
#define PW 16    /* 2 registers of 8 floats (AVX); other CPUs split the type as they must */
#define MAXR 6   /* 12 sums + 2 weights + 1 broadcast of AVX's 16 registers */
#endif

typedef float vp __attribute__((vector_size(PW / 2 * sizeof(float))));  /* half a panel */

static inline vp loadp(const float *p) { vp x; memcpy(&x, p, sizeof x); return x; }

int panel_width(void) { return PW; }

/* Wp (ceil(O / PW), I, PW) = W (O, I) in panels; the last panel's missing columns are 0 */
void pack_panels(const float *W, int O, int I, float *Wp) {
    const int P = (O + PW - 1) / PW;
    for (int p = 0; p < P; p++)
        for (int i = 0; i < I; i++)
            for (int j = 0; j < PW; j++) {
                const int o = p * PW + j;
                Wp[((int64_t)p * I + i) * PW + j] = o < O ? W[(int64_t)o * I + i] : 0.0f;
            }
}

/* One tile: rows x[0..MR-1] (ldx apart) times panel w -> y[m, 0..cols-1] (ldy apart),
   + bias, or += that (`accumulate`: the residual stream's add, fused). Inlined with MR a
   constant, so the loops over m unroll and the 2*MR sums stay in registers. */
static inline __attribute__((always_inline)) void tile(
        const float *x, int64_t ldx, const float *w, int I, const float *bias, int cols,
        float *y, int64_t ldy, int accumulate, const int MR) {
    vp a[MAXR], b[MAXR];
    for (int m = 0; m < MR; m++) { a[m] = (vp){0}; b[m] = (vp){0}; }
    for (int i = 0; i < I; i++) {
        const vp w0 = loadp(w + (int64_t)i * PW), w1 = loadp(w + (int64_t)i * PW + PW / 2);
        for (int m = 0; m < MR; m++) {
            const float s = x[m * ldx + i];
            a[m] += s * w0;
            b[m] += s * w1;
        }
    }
    for (int m = 0; m < MR; m++) {
        float out[PW];
        memcpy(out, &a[m], sizeof a[m]);
        memcpy(out + PW / 2, &b[m], sizeof b[m]);
        float *ym = y + m * ldy;
        for (int j = 0; j < cols; j++) {
            const float v = out[j] + (bias ? bias[j] : 0.0f);
            ym[j] = accumulate ? ym[j] + v : v;
        }
    }
}

#define TILE(MR) tile(xs, I, w, I, bs, cols, ys, O, accumulate, MR)

/* y = x @ W^T + bias, or y += that, with W packed by pack_panels */
static void linear_rows(const float *x, const float *Wp, const float *bias, int N, int O,
                        int I, float *y, int accumulate, int threads) {
    const int P = (O + PW - 1) / PW;
    #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
    for (int p = 0; p < P; p++) {  /* static: each thread a contiguous range of panels */
        const float *w = Wp + (int64_t)p * I * PW;
        const float *bs = bias ? bias + p * PW : NULL;
        const int cols = O - p * PW < PW ? O - p * PW : PW;
        for (int n = 0; n < N;) {
            /* tiles of MAXR rows; a rest of more than MAXR split in two near-equal tiles */
            int r = N - n;
            if (r > MAXR) r = (r >= 2 * MAXR || r % MAXR == 0) ? MAXR : (r + 1) / 2;
            const float *xs = x + (int64_t)n * I;
            float *ys = y + (int64_t)n * O + p * PW;
            switch (r) {
                case 1: TILE(1); break;
                case 2: TILE(2); break;
                case 3: TILE(3); break;
                case 4: TILE(4); break;
                case 5: TILE(5); break;
#if MAXR > 6
                case 6: TILE(6); break;
                case 7: TILE(7); break;
                case 8: TILE(8); break;
                case 9: TILE(9); break;
                case 10: TILE(10); break;
                case 11: TILE(11); break;
#endif
                default: TILE(MAXR); break;
            }
            n += r;
        }
    }
}

void rows_linear(const float *x, const float *Wp, const float *bias, int N, int O, int I,
                 float *y, int threads) {
    linear_rows(x, Wp, bias, N, O, I, y, 0, threads);
}


/* ---- 3. A whole decode step of a few rows ------------------------------------------

   For the one to three rows of a small decode step (fast/compact.py, `decode_in_c`), every
   decoder layer of the compact forward, written out. Why: at a few rows a layer's
   time is its 4 matmuls streaming the weights (2 above) plus, between them, some 25
   small PyTorch operators (two RMSNorms, RoPE, the KV write, softmax, SiLU, the residual
   adds, views and copies), each costing microseconds of dispatch for a few hundred
   floats of work: about a tenth of the step. Here they are loops over those floats,
   and the whole step is one call from Python.

   Per layer, the rows' residual stream x (N, E) updated in place:

       h = rms_norm(x) * ln1
       qkv = h @ Wqkv^T (+ b)                 (N, (H + 2 H_kv) D): q heads, k heads, v heads
       q, k = rope(q), rope(k)                x cos + roll(x, D/2) sin_signed (compact.py)
       pools[slot of each row] = k, v         written first: a token attends to itself
       a = softmax(scale q.K) V               decode_scores / decode_values (1 above)
       x += a @ Wo^T (+ b)
       h = rms_norm(x) * ln2
       g | u = h @ Wgu^T (+ b)                (N, 2I)
       x += (silu(g) * u) @ Wdown^T (+ b)

   Numerics: every sum in float32 but in another order than PyTorch's (the RMSNorm's
   mean, the softmax's sum, the matmuls), and expf where PyTorch has its vectorised exp:
   equal to float rounding. tests/test_decode_kernel.py checks the step against the
   Python forward, and token for token against HF `generate`. */

typedef struct {  /* one decoder layer as CompactLlama keeps it; a missing bias is NULL */
    const float *ln1, *qkv, *qkv_bias, *o, *o_bias, *ln2, *gate_up, *gate_up_bias, *down,
        *down_bias;
    float *k_pool, *v_pool;  /* the layer's (H_kv, num_slots, D) pools */
} Layer;

typedef struct {  /* one step: sizes, the rows, scratch the caller allocated */
    int N, E, H, H_kv, D, I, S, M, threads;
    int64_t num_slots;
    float eps, scale;
    float *x;                              /* (N, E) the residual stream, in and out */
    const float *cos, *sin;                /* (N, D) at each row's position (sin signed) */
    const int64_t *slots, *tables, *lens;  /* (N,) write slots, (N, M) blocks, (N,) lengths */
    float *h, *qkv, *q, *att, *scores, *gu, *act;
    /* (N, E), (N, (H+2H_kv)D), (N, H, D), (N, H, D), (N, H, M*S), (N, 2I), (N, I) */
} Step;

/* y[n] = w * (x[n] / sqrt(mean(x[n]^2) + eps)), HF's LlamaRMSNorm in float32 */
void rms_norm(const float *x, const float *w, int N, int E, float eps, float *y) {
    for (int n = 0; n < N; n++) {
        const float *xn = x + (int64_t)n * E;
        float *yn = y + (int64_t)n * E;
        v8 acc = {0};
        int i = 0;
        for (; i + 8 <= E; i += 8) { const v8 v = load8(xn + i); acc += v * v; }
        float sq = hsum8(acc);
        for (; i < E; i++) sq += xn[i] * xn[i];
        const float r = 1.0f / sqrtf(sq / (float)E + eps);
        for (int j = 0; j < E; j++) yn[j] = w[j] * (xn[j] * r);
    }
}

/* out = x * cos + roll(x, D/2) * sin, one head of D floats (compact.py's RoPE) */
static void rope(const float *x, const float *cos, const float *sin, int D, float *out) {
    const int half = D / 2;
    for (int d = 0; d < D; d++) out[d] = x[d] * cos[d] + x[(d + half) % D] * sin[d];
}

/* q heads into st->q (N, H, D), roped; k (roped) and v into the pools at each row's slot */
static void rope_and_write(const Step *st, const float *qkv, float *k_pool, float *v_pool) {
    const int H = st->H, H_kv = st->H_kv, D = st->D, QKV = (H + 2 * H_kv) * D;
    for (int n = 0; n < st->N; n++) {
        const float *row = qkv + (int64_t)n * QKV;
        const float *c = st->cos + (int64_t)n * D, *s = st->sin + (int64_t)n * D;
        const int64_t slot = st->slots[n];
        for (int h = 0; h < H; h++)
            rope(row + h * D, c, s, D, st->q + ((int64_t)n * H + h) * D);
        for (int hk = 0; hk < H_kv; hk++) {
            float *k_dst = k_pool + ((int64_t)hk * st->num_slots + slot) * D;
            float *v_dst = v_pool + ((int64_t)hk * st->num_slots + slot) * D;
            rope(row + (H + hk) * D, c, s, D, k_dst);
            memcpy(v_dst, row + (H + H_kv + hk) * D, sizeof(float) * D);
        }
    }
}

/* part 4's (below): the attention block around the softmax, which this part shares */
void decode_rope_scores(const Step *st, const float *qkv, float *k_pool, float *v_pool);
void decode_values_of(const Step *st, const float *probs, const float *v_pool, float *att);

static void decode_layer(const Layer *w, const Step *st) {
    const int N = st->N, E = st->E, H = st->H, H_kv = st->H_kv, D = st->D, I = st->I;
    const int QKV = (H + 2 * H_kv) * D;
    const int64_t L = (int64_t)st->M * st->S;
    rms_norm(st->x, w->ln1, N, E, st->eps, st->h);
    linear_rows(st->h, w->qkv, w->qkv_bias, N, QKV, E, st->qkv, 0, st->threads);
    decode_rope_scores(st, st->qkv, w->k_pool, w->v_pool);
    for (int64_t r = 0; r < (int64_t)N * H; r++) {  /* softmax over each (row, head)'s L */
        float *p = st->scores + r * L, mx = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < L; t++) mx = p[t] > mx ? p[t] : mx;
        for (int64_t t = 0; t < L; t++) { p[t] = expf(p[t] - mx); sum += p[t]; }
        for (int64_t t = 0; t < L; t++) p[t] /= sum;
    }
    decode_values_of(st, st->scores, w->v_pool, st->att);
    linear_rows(st->att, w->o, w->o_bias, N, E, H * D, st->x, 1, st->threads);
    rms_norm(st->x, w->ln2, N, E, st->eps, st->h);
    linear_rows(st->h, w->gate_up, w->gate_up_bias, N, 2 * I, E, st->gu, 0, st->threads);
    for (int n = 0; n < N; n++)
        for (int i = 0; i < I; i++) {
            const float g = st->gu[(int64_t)n * 2 * I + i], u = st->gu[(int64_t)n * 2 * I + I + i];
            st->act[(int64_t)n * I + i] = g / (1.0f + expf(-g)) * u;
        }
    linear_rows(st->act, w->down, w->down_bias, N, E, I, st->x, 1, st->threads);
}

void decode_layers(const Layer *layers, int num_layers, const Step *st) {
    for (int l = 0; l < num_layers; l++) decode_layer(&layers[l], st);
}


/* ---- 4. Between the matmuls of a decode step of more rows ----------------------------

   From about 4 rows on, oneDNN's prepacked matmul beats the C loop of part 2, so a step
   of more rows keeps its matmuls in oneDNN (fast/compact.py, `decode_rows`) and does
   the attention block between them here: RoPE, the K/V write and the scores
   (`decode_rope_scores`), then, after PyTorch's softmax, the values (`decode_values_of`),
   with `rms_norm` (above) for the norms. The softmax and the MLP's SiLU stay PyTorch's
   there: at 8-32 rows a scalar expf over every (row, head, key) or (row, feature) cost
   more than the operators it saved. `st` carries the sizes, the rows and the q and
   scores scratch; its x, h, qkv, att, gu and act are not read by these. */

/* RoPE, the new K/V into this layer's pools, and the scores (into st->scores) */
void decode_rope_scores(const Step *st, const float *qkv, float *k_pool, float *v_pool) {
    rope_and_write(st, qkv, k_pool, v_pool);
    decode_scores(st->q, k_pool, st->tables, st->lens, st->N, st->H, st->H_kv, st->D,
                  st->num_slots, st->S, st->M, st->scale, st->scores, st->threads);
}

/* att (N, H, D) = probs (N, H, M*S) @ the rows' V */
void decode_values_of(const Step *st, const float *probs, const float *v_pool, float *att) {
    decode_values(probs, v_pool, st->tables, st->lens, st->N, st->H, st->H_kv, st->D,
                  st->num_slots, st->S, st->M, att, st->threads);
}

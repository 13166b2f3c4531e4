/* A decode step's two costly parts in C: minserve's one C file.

   1. Attention over block tables, read in place (`decode_scores`, `decode_values`).
   2. The weight matmuls of a decode step (`rows_linear`, on weights packed in panels).
   3. A whole decode step of a few rows (`decode_layers`).
   4. What lies between the matmuls of a decode step of more rows (`decode_attend`,
      `rms_norm`).

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

typedef int32_t v8i __attribute__((vector_size(32)));

/* exp of 8 floats, for the softmax and SiLU of parts 3 and 4: Cephes' expf, vectorised.
   x = k ln2 + r with k an integer and |r| <= ln2/2 (ln2 in two parts, so k ln2 is exact
   to float precision), exp(r) by a degree-7 polynomial, then 2^k put in the exponent
   bits. Relative error under 1e-7 (PyTorch's own vectorised exp, Sleef's: under 7e-8);
   tests/test_decode_kernel.py compares it with torch.exp over the float range. x is
   clamped to [-87.3, 88.3] first: below, exp(x) comes out about 1e-38 instead of a
   denormal or 0 (a softmax's sum is at least 1, so such a term changes nothing); above,
   about 2e38 instead of inf (SiLU's g / (1 + exp(-g)) is then -0 either way). A NaN
   stays NaN. */
static inline v8 exp8(v8 x) {
    const v8 lo = (v8){0} - 87.3f, hi = (v8){0} + 88.3f;
    const v8i below = x < lo, above = x > hi;  /* -1 where true, 0 where not */
    x = (v8)(((v8i)x & ~below) | ((v8i)lo & below));
    x = (v8)(((v8i)x & ~above) | ((v8i)hi & above));
    const v8 magic = (v8){0} + 12582912.0f;   /* 1.5 * 2^23: adding it rounds to an integer */
    const v8 k = (x * 1.44269504088896341f + magic) - magic;  /* round(x / ln2) */
    const v8 r = (x - k * 0.693359375f) - k * -2.12194440e-4f;  /* x - k ln2, |r| <= 0.35 */
    v8 p = (v8){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;                  /* exp(r) */
    const v8i e = (__builtin_convertvector(k, v8i) + 127) << 23;  /* 2^k as a float's bits */
    return p * (v8)e;
}

/* y[i] = exp8(x[i] - shift) for n floats (y may be x) -> their sum: 8 at a time, then the
   last 1-7 through the same exp, padded */
static float exp_shifted(const float *x, int64_t n, float shift, float *y) {
    v8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 e = exp8(load8(x + i) - shift);
        memcpy(y + i, &e, sizeof e);
        acc += e;
    }
    float sum = hsum8(acc);
    if (i < n) {
        float tail[8] = {0};
        memcpy(tail, x + i, sizeof(float) * (size_t)(n - i));
        const v8 e = exp8(load8(tail) - shift);
        memcpy(tail, &e, sizeof e);
        for (int64_t j = i; j < n; j++) { y[j] = tail[j - i]; sum += tail[j - i]; }
    }
    return sum;
}

/* y = exp8(x) for n floats (tests compare it with torch.exp) */
void exp_floats(const float *x, int64_t n, float *y) { exp_shifted(x, n, 0.0f, y); }

/* softmax of n floats in place (n >= 1); the largest subtracted first, as PyTorch does */
static void softmax_inplace(float *p, int64_t n) {
    float mx = p[0];
    for (int64_t t = 1; t < n; t++) mx = p[t] > mx ? p[t] : mx;
    const float sum = exp_shifted(p, n, mx, p);
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; j++) p[j] *= inv;
}

static inline float dot(const float *a, const float *b, int D) {
    v8 acc = {0};
    for (int d = 0; d < D; d += 8) acc += load8(a + d) * load8(b + d);
    return hsum8(acc);
}

/* The G query heads qh (G, D) that share one KV head, over one row's first `len` keys
   (its block table `table`, the head's slots `kh`) -> out (G, L): out[g, t] = scale *
   q_g . K[t], t < len. Block after block, each block's keys serve all G heads. */
static void kv_head_scores(const float *qh, const float *kh, const int64_t *table,
                           int64_t len, int G, int D, int S, int64_t L, float scale,
                           float *out) {
    for (int j = 0; (int64_t)j * S < len; j++) {   /* block j of the row's table */
        const float *kb = kh + table[j] * S * D;  /* (S, D) */
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

#if defined(__AVX512F__)
#define VW 64  /* output floats in registers per pass: 3 heads x 8 sums of AVX-512's 32 */
#else
#define VW 32  /* 3 heads x 4 sums of AVX's 16 registers */
#endif

/* o (NG, D) (rows D apart) = sum over t < len of p[g, t] * V[t] for NG <= 3 query heads
   of one KV head (probabilities (NG, L), rows L apart): each value vector is loaded once
   for the NG heads. NG is a constant where this is inlined, so the sums stay in registers. */
static inline __attribute__((always_inline)) void heads_values_n(
        const int NG, const float *p, int64_t L, const float *vh, const int64_t *table,
        int64_t len, int D, int S, float *o) {
    for (int d0 = 0; d0 < D; d0 += VW) {  /* VW floats of each head's output */
        const int w = D - d0 < VW ? D - d0 : VW;
        v8 acc[3][VW / 8] = {{{0}}};
        for (int j = 0; (int64_t)j * S < len; j++) {
            const float *vb = vh + table[j] * S * D + d0;
            const int n = len - (int64_t)j * S < S ? (int)(len - (int64_t)j * S) : S;
            for (int s = 0; s < n; s++) {
                const int64_t t = (int64_t)j * S + s;
                for (int i = 0; i < w / 8; i++) {
                    const v8 v = load8(vb + s * D + 8 * i);
                    for (int g = 0; g < NG; g++) acc[g][i] += p[g * L + t] * v;
                }
            }
        }
        for (int g = 0; g < NG; g++) memcpy(o + g * D + d0, acc[g], sizeof(float) * w);
    }
}

/* o (G, D) for the G query heads of one KV head, 3 at a time (`heads_values_n`) */
static void heads_values(const float *p, int64_t L, const float *vh, const int64_t *table,
                         int64_t len, int G, int D, int S, float *o) {
    for (int g = 0; g < G; g += 3) {
        const float *pg = p + g * L;
        float *og = o + g * D;
        switch (G - g < 3 ? G - g : 3) {
        case 1: heads_values_n(1, pg, L, vh, table, len, D, S, og); break;
        case 2: heads_values_n(2, pg, L, vh, table, len, D, S, og); break;
        default: heads_values_n(3, pg, L, vh, table, len, D, S, og); break;
        }
    }
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
        kv_head_scores(qh, kh, tables + (int64_t)b * M, len, G, D, S, L, scale, out);
    }
}

/* out[b, h] = sum over t < lens[b] of probs[b, h, t] * V[h / G][slot of token t of row b] */
void decode_values(const float *probs, const float *v_pool, const int64_t *tables,
                   const int64_t *lens, int B, int H, int H_kv, int D, int64_t num_slots,
                   int S, int M, float *out, int threads) {
    const int G = H / H_kv;
    const int64_t L = (int64_t)M * S;
    /* every (row, KV head) pair writes its G query heads' D floats */
    #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(dynamic)
    for (int bh = 0; bh < B * H_kv; bh++) {
        const int b = bh / H_kv, hk = bh % H_kv;
        const int64_t first = (int64_t)b * H + hk * G;  /* its first query head's (b, h) */
        heads_values(probs + first * L, L, v_pool + (int64_t)hk * num_slots * D,
                     tables + (int64_t)b * M, lens[b], G, D, S, out + first * D);
    }
}


/* ---- 2. The weight matmuls of a decode step -----------------------------------------

   y (N, O) = x (N, I) @ W (O, I)^T (+ bias (O,)): what F.linear computes, for the N = 2..64
   rows of a decode step (fast/compact.py's `Linear` calls it there, oneDNN above), on a
   copy of W packed once into panels (`pack_panels`). One row reads W as it is
   (`row_linear`, below).

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

/* One row: y (O,) = W (O, I) x (I,) + bias, or y += that, W as it is (out, in), each
   weight row read once, start to end, one row after the other, into two vector sums. At
   one row nothing is reused, so a panel buys nothing, and on the reference EPYC this
   plain order read the weights 5-10 % faster than the panels at one row (1 thread:
   30.5-31.1 against 34.2-38.9 ms for SmolLM2's weights, interleaved). The compact
   forward passes the HF model's own weights here, so it costs no copy. */
static void row_linear(const float *x, const float *W, const float *bias, int O, int I,
                       float *y, int accumulate, int threads) {
    #pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
    for (int o = 0; o < O; o++) {
        const float *w = W + (int64_t)o * I;
        v8 a = {0}, c = {0};
        int i = 0;
        for (; i + 16 <= I; i += 16) {
            a += load8(w + i) * load8(x + i);
            c += load8(w + i + 8) * load8(x + i + 8);
        }
        float v = hsum8(a + c);
        for (; i < I; i++) v += w[i] * x[i];
        v += bias ? bias[o] : 0.0f;
        y[o] = accumulate ? y[o] + v : v;
    }
}

void one_row_linear(const float *x, const float *W, const float *bias, int O, int I, float *y,
                    int threads) {
    row_linear(x, W, bias, O, I, y, 0, threads);
}

void rows_linear(const float *x, const float *Wp, const float *bias, int N, int O, int I,
                 float *y, int threads) {
    linear_rows(x, Wp, bias, N, O, I, y, 0, threads);
}


/* ---- 3. A whole decode step of a few rows ------------------------------------------

   For the 1 to 32 rows of a decode step (fast/compact.py, `decode_in_c`, up to
   `STEP_IN_C_ROWS`), every decoder layer of the compact forward, written out. Why: at a
   few rows a layer's time is its 4 matmuls streaming the weights (2 above) plus, between
   them, some 25 small PyTorch operators (two RMSNorms, RoPE, the KV write, softmax, SiLU,
   the residual adds, views and copies), each costing microseconds of dispatch for a few
   hundred floats of work: about a tenth of the step. Here they are loops over those floats,
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
        *down_bias;  /* qkv, o, gate_up, down: packed in panels (part 2) */
    float *k_pool, *v_pool;  /* the layer's (H_kv, num_slots, D) pools */
    /* the same weights as the HF model keeps them, (out, in), for a step of one row
       (`row_linear`); all NULL: the panels at one row too */
    const float *q_w, *k_w, *v_w, *o_w, *gate_w, *up_w, *down_w;
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

/* part 4's (below): the attention block between the q/k/v and o matmuls */
void decode_attend(const Step *st, const float *qkv, float *k_pool, float *v_pool, float *att);

/* silu(g) * u for the rows' gate | up (N, 2I) -> act (N, I), 8 at a time through exp8
   (part 4's step of more rows calls it too, `DecodeKernel.silu_mul`) */
void silu_mul(const float *gu, int N, int I, float *act, int threads) {
    /* threads only where there is work enough to pay for waking them (64 rows of 1,536) */
    #pragma omp parallel for num_threads(threads) if(threads > 1 && (int64_t)N * I >= 98304)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (int64_t)n * 2 * I, *u = g + I;
        float *a = act + (int64_t)n * I;
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            const v8 gv = load8(g + i);
            const v8 y = gv / (1.0f + exp8((v8){0} - gv)) * load8(u + i);
            memcpy(a + i, &y, sizeof y);
        }
        for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* bias + offset, or NULL where there is no bias */
static inline const float *at(const float *bias, int offset) { return bias ? bias + offset : NULL; }

static void decode_layer(const Layer *w, const Step *st) {
    const int N = st->N, E = st->E, H = st->H, H_kv = st->H_kv, D = st->D, I = st->I;
    const int QKV = (H + 2 * H_kv) * D, T = st->threads;
    const int one = N == 1 && w->q_w;  /* one row: the plain weights, row after row */
    rms_norm(st->x, w->ln1, N, E, st->eps, st->h);
    if (one) {  /* q, k, v side by side in st->qkv, as the fused matmul writes them */
        row_linear(st->h, w->q_w, w->qkv_bias, H * D, E, st->qkv, 0, T);
        row_linear(st->h, w->k_w, at(w->qkv_bias, H * D), H_kv * D, E, st->qkv + H * D, 0, T);
        row_linear(st->h, w->v_w, at(w->qkv_bias, (H + H_kv) * D), H_kv * D, E,
                   st->qkv + (H + H_kv) * D, 0, T);
    } else {
        linear_rows(st->h, w->qkv, w->qkv_bias, N, QKV, E, st->qkv, 0, T);
    }
    decode_attend(st, st->qkv, w->k_pool, w->v_pool, st->att);
    if (one) row_linear(st->att, w->o_w, w->o_bias, E, H * D, st->x, 1, T);
    else linear_rows(st->att, w->o, w->o_bias, N, E, H * D, st->x, 1, T);
    rms_norm(st->x, w->ln2, N, E, st->eps, st->h);
    if (one) {
        row_linear(st->h, w->gate_w, w->gate_up_bias, I, E, st->gu, 0, T);
        row_linear(st->h, w->up_w, at(w->gate_up_bias, I), I, E, st->gu + I, 0, T);
    } else {
        linear_rows(st->h, w->gate_up, w->gate_up_bias, N, 2 * I, E, st->gu, 0, T);
    }
    silu_mul(st->gu, N, I, st->act, T);
    if (one) row_linear(st->act, w->down_w, w->down_bias, E, I, st->x, 1, T);
    else linear_rows(st->act, w->down, w->down_bias, N, E, I, st->x, 1, T);
}

void decode_layers(const Layer *layers, int num_layers, const Step *st) {
    for (int l = 0; l < num_layers; l++) decode_layer(&layers[l], st);
}


/* ---- 4. Between the matmuls of a decode step of more rows ----------------------------

   A step of more rows (fast/compact.py, `decode_rows`) keeps its matmuls in Python's
   hands (`compact.Linear`: part 2's C matmul up to 64 rows, oneDNN above) and does the
   attention block between the q/k/v and o matmuls here, in one call (`decode_attend`):
   RoPE and the K/V write, then for each (row, KV head) the scores of its G query heads,
   their softmax and their values, one after the other while the scores are in cache,
   with `rms_norm` and `silu_mul` (above) for the norms and the MLP's SiLU. `st` carries
   the sizes, the rows and the q and scores scratch; its x, h, qkv, gu and act are not
   read by these.

   The softmax runs over each row's `len` keys only (part 1's pads the rest with -inf
   for PyTorch's), with exp8's exp: to float rounding PyTorch's softmax. */

/* RoPE, the new K/V into this layer's pools, then att (N, H, D) = softmax(scale q.K) V */
void decode_attend(const Step *st, const float *qkv, float *k_pool, float *v_pool, float *att) {
    rope_and_write(st, qkv, k_pool, v_pool);
    const int H = st->H, H_kv = st->H_kv, D = st->D, S = st->S, M = st->M, G = H / H_kv;
    const int64_t L = (int64_t)M * S;
    /* every (row, KV head) pair writes its own G rows of scores and of att */
    #pragma omp parallel for num_threads(st->threads) if(st->threads > 1) schedule(dynamic)
    for (int bh = 0; bh < st->N * H_kv; bh++) {
        const int b = bh / H_kv, hk = bh % H_kv;
        const int64_t len = st->lens[b];
        const int64_t *table = st->tables + (int64_t)b * M;
        const int64_t first = (int64_t)b * H + hk * G;  /* its first query head's (b, h) */
        float *p = st->scores + first * L;             /* (G, L) */
        kv_head_scores(st->q + first * D, k_pool + (int64_t)hk * st->num_slots * D, table, len,
                       G, D, S, L, st->scale, p);
        for (int g = 0; g < G; g++) softmax_inplace(p + g * L, len);
        heads_values(p, L, v_pool + (int64_t)hk * st->num_slots * D, table, len, G, D, S,
                     att + first * D);
    }
}

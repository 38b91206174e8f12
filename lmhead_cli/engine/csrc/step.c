/* ---- the decoding step: every block of GPT-2 for a few rows of one new position, in one call ----

   Included at the end of kernels.c, so each variant compiles it with its own vector width. For B rows
   of T new positions each (B · T <= STEP_MAX_ROWS: a decoding step's rows, T = 1, or a short prompt's
   positions, B = 1), block by block:

       h = ln_1(x);  qkv = h · c_attn;  k, v -> the KV cache at positions past … past + T - 1;
       a = attention(q, cache[0 .. past + t], mask);  x = x + a · attn.c_proj;
       h = ln_2(x);  f = gelu_tanh(h · c_fc);  x = x + f · mlp.c_proj

   What the lean engine's torch path does in ~85 dispatched ops a block (engine/lean.py Block), here in
   plain loops and the products below, over the weights where the engine keeps them (nothing copied):
   float32 Conv1D matrices (in, out) as the checkpoint stores them, bfloat16 (out, in) rows, int8 rows
   with a float32 scale per row (engine/int8.py). Each product splits its output among the threads (an
   OpenMP region over torch's thread pool, as every kernel in this file); the norms, the GELU and the
   residual adds are a few thousand floats, done by the calling thread.

   Rounding: float32 and int8 run float32 throughout, as the torch path does. bfloat16 rounds to
   bfloat16 where the torch path holds a bfloat16 tensor (the norms' outputs, each product's output, the
   GELU's, the residual after each add, the attention's output), and runs attention in float32 over the
   float32 cache, as engine/lean.py's `attention_dtype` does: the same figures up to the order of sums. */

#define STEP_MAX_ROWS LMHEAD_STEP_MAX_ROWS

/* lmhead_layer (one block's weights) and lmhead_model (the blocks, embeddings, ln_f and head) are declared
   in kernels.h. */

static inline float step_param(const void *p, int64_t i, int kind) {
    return kind == LMHEAD_STEP_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* y[m] = layer_norm(x[m]) * w + b for B rows of D, in float32 with the statistics in double (torch's
   CPU layer norm: mean and biased variance, rstd = 1 / sqrt(var + eps)). */
static void step_norm(const float *x, float *y, int64_t B, int64_t D, const void *w, const void *b, float eps,
                      int kind) {
    for (int64_t m = 0; m < B; m++) {
        const float *xm = x + m * D;
        float *ym = y + m * D;
        double mean = 0.0, var = 0.0;
        for (int64_t d = 0; d < D; d++) mean += xm[d];
        mean /= (double)D;
        for (int64_t d = 0; d < D; d++) var += ((double)xm[d] - mean) * ((double)xm[d] - mean);
        float rstd = (float)(1.0 / sqrt(var / (double)D + (double)eps)), mu = (float)mean;
        for (int64_t d = 0; d < D; d++) {
            float v = (xm[d] - mu) * rstd * step_param(w, d, kind) + step_param(b, d, kind);
            ym[d] = kind == LMHEAD_STEP_BF16 ? round_bf16(v) : v;
        }
    }
}

#if LANES
/* tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|): scoring's exp_le0, within a few ulp (GPT-2's GELU
   here, Llama's SiLU in llama_step.c) */
static inline vf vtanh(vf u) {
    vf e = exp_le0(vmul(vabs(u), vbroadcast(-2.0f)));
    return vsign_of(vdiv(vsub(vbroadcast(1.0f), e), vadd(vbroadcast(1.0f), e)), u);
}
#endif

/* GELU, tanh form (GPT-2's gelu_new, torch's approximate="tanh"), in place over n floats. */
static void step_gelu(float *x, int64_t n, int kind) {
    const float c = 0.7978845608028654f, a = 0.044715f;
    int64_t i = 0;
#if LANES
    for (; i + LANES <= n; i += LANES) {
        vf v = vload(x + i);
        vf t = vtanh(vmul(vbroadcast(c), vfma(vmul(vbroadcast(a), v), vmul(v, v), v)));
        vstore(x + i, vmul(vmul(vbroadcast(0.5f), v), vadd(vbroadcast(1.0f), t)));
    }
#endif
    for (; i < n; i++) {
        float v = x[i];
        x[i] = 0.5f * v * (1.0f + tanhf(c * (v + a * v * v * v)));
    }
    if (kind == LMHEAD_STEP_BF16)
        for (i = 0; i < n; i++) x[i] = round_bf16(x[i]);
}

/* y (M, N) = x (M, K) · W (K, N) + bias (N) or 0, float32, W as GPT-2's Conv1D stores it (in, out):
   each thread takes a contiguous range of output columns and reads its part of four rows of W at a
   time, forward (one thread: the whole matrix in order), adding their contributions to its sums (M ×
   a chunk of columns, in L1: one load and one store of a sum per four weights). The chunk is the
   whole range for one row of x, narrower for more (the sums of every row must stay in L1). M and the
   rows of a step are constants in each instance up to MAX_ROWS rows, so that the compiler keeps x's
   values in registers; more rows (f32_kn_matvec) run the same loops with M a variable. */
#define KN_SUMS_FLOATS 4096 /* 16 KB of sums per thread */
#define KN_STEP 4           /* rows of W a pass over the sums takes */
static inline __attribute__((always_inline)) void kn_rows(const float *W, const float *x, float *sums,
                                                          int64_t K, int64_t N, const int64_t M, int64_t k,
                                                          int64_t c0, int64_t w, const int R) {
    /* sums[m * w + j] += sum_{i < R} W[(k + i) * N + c0 + j] * x[m * K + k + i], j < w */
    const float *wk = W + k * N + c0;
    float xs[STEP_MAX_ROWS][KN_STEP];
    for (int64_t m = 0; m < M; m++)
        for (int i = 0; i < R; i++) xs[m][i] = x[m * K + k + i];
    int64_t j = 0;
#if LANES
    /* each x value broadcast where it is used: with M a constant the compiler hoists the broadcasts out
       of the loop into registers; with M a variable they are one load each from xs */
    for (; j + LANES <= w; j += LANES) {
        vf a[KN_STEP];
        for (int i = 0; i < R; i++) {
            a[i] = vload(wk + i * N + j);
            _mm_prefetch((const char *)(wk + (i + 2 * KN_STEP) * N + j), _MM_HINT_T0);
        }
        for (int64_t m = 0; m < M; m++) {
            float *s = sums + m * w + j;
            vf t = vload(s);
            for (int i = 0; i < R; i++) t = vfma(a[i], vbroadcast(xs[m][i]), t);
            vstore(s, t);
        }
    }
#endif
    for (; j < w; j++)
        for (int64_t m = 0; m < M; m++)
            for (int i = 0; i < R; i++) sums[m * w + j] += wk[i * N + j] * xs[m][i];
}

static inline __attribute__((always_inline)) void kn_matvec(const float *W, const float *x, const float *bias,
                                                            float *y, int64_t K, int64_t N, const int64_t M,
                                                            int threads) {
#pragma omp parallel num_threads(threads)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(), T = omp_get_num_threads();
#endif
        int64_t lanes = LANES ? LANES : 1;
        int64_t n0 = N * t / T / lanes * lanes, n1 = t + 1 == T ? N : N * (t + 1) / T / lanes * lanes;
        int64_t width = KN_SUMS_FLOATS / M / lanes * lanes;
        float sums[KN_SUMS_FLOATS] __attribute__((aligned(64)));
        for (int64_t c0 = n0; c0 < n1; c0 += width) {
            int64_t c1 = c0 + width < n1 ? c0 + width : n1, w = c1 - c0, k = 0;
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < w; j++) sums[m * w + j] = bias ? bias[c0 + j] : 0.0f;
            for (; k + KN_STEP <= K; k += KN_STEP) kn_rows(W, x, sums, K, N, M, k, c0, w, KN_STEP);
            for (; k < K; k++) kn_rows(W, x, sums, K, N, M, k, c0, w, 1);
            for (int64_t m = 0; m < M; m++)
                memcpy(y + m * N + c0, sums + m * w, (size_t)w * sizeof(float));
        }
    }
}

#define KN_INSTANCE(MM) \
    static void kn_matvec_##MM(const float *W, const float *x, const float *bias, float *y, int64_t K, int64_t N, \
                               int threads) { kn_matvec(W, x, bias, y, K, N, MM, threads); }
KN_INSTANCE(1)
KN_INSTANCE(2)
KN_INSTANCE(3)
KN_INSTANCE(4)

/* y (N) = x (K) · W (K, N) + bias (N) or 0 for one row of x (a single stream's step): W's rows in
   KN_CHUNKS contiguous blocks, each summed into its own N sums (`part`: KN_CHUNKS × N floats), the
   threads taking the next block as they finish one (so a core the machine slows does fewer; see
   PIECE_ROWS), each block read in memory order KN_PASS rows at a time; then each thread adds the blocks'
   sums in block order over its own range of columns. The blocks, not the threads, fix the order of
   the sums: any thread count gives the same bits. Taking columns instead (kn_matvec) reads each row
   in pieces, four rows at a time: measured alone on GPT-2's shapes, the column split read 8-10 GB/s
   and this one 15 (2 threads, Zen 4, 4 KiB pages). */
#define KN_CHUNKS 16
/* Rows of W each pass over a block's sums takes (one load and one store of each sum per KN_PASS weights
   instead of per weight), the sums still added in row order, so the bits are those of one row a pass.
   Measured in a C harness over GPT-2's 48 body matrices on 2 MiB pages (AVX2 Zen 3, 2 threads, one
   process alternating): 10.1-12.4 ms against 14.4-14.5 one row a pass; 4 rows 12.6-13.5. */
#define KN_PASS 8
static void kn_vec(const float *W, const float *x, const float *bias, float *y, int64_t K, int64_t N, int threads,
                   float *part) {
#pragma omp parallel num_threads(threads)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(), T = omp_get_num_threads();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int c = 0; c < KN_CHUNKS; c++) {
            float *s = part + c * N;
            for (int64_t j = 0; j < N; j++) s[j] = 0.0f;
            int64_t k = K * c / KN_CHUNKS, k1 = K * (c + 1) / KN_CHUNKS;
#if LANES
            for (; k + KN_PASS <= k1; k += KN_PASS) { /* KN_PASS rows of W a pass: one load and store of s */
                const float *wk = W + k * N;
                vf xv[KN_PASS];
                for (int i = 0; i < KN_PASS; i++) xv[i] = vbroadcast(x[k + i]);
                int64_t j = 0;
                for (; j + LANES <= N; j += LANES) {
                    vf a = vload(s + j);
                    for (int i = 0; i < KN_PASS; i++) a = vfma(vload(wk + i * N + j), xv[i], a);
                    vstore(s + j, a);
                }
                for (; j < N; j++)
                    for (int i = 0; i < KN_PASS; i++) s[j] += wk[i * N + j] * x[k + i];
            }
#endif
            for (; k < k1; k++) {
                const float *wk = W + k * N;
                const float xk = x[k];
                int64_t j = 0;
#if LANES
                const vf xv = vbroadcast(xk);
                for (; j + LANES <= N; j += LANES) vstore(s + j, vfma(vload(wk + j), xv, vload(s + j)));
#endif
                for (; j < N; j++) s[j] += wk[j] * xk;
            }
        } /* the loop's implied barrier: every block summed */
        int64_t lanes = LANES ? LANES : 1, j = N * t / T / lanes * lanes,
                j1 = t + 1 == T ? N : N * (t + 1) / T / lanes * lanes;
#if LANES
        for (; j + LANES <= j1; j += LANES) { /* the same adds in the same order, LANES columns at a time */
            vf v = bias ? vload(bias + j) : vzero();
            for (int c = 0; c < KN_CHUNKS; c++) v = vadd(v, vload(part + c * N + j));
            vstore(y + j, v);
        }
#endif
        for (; j < j1; j++) {
            float v = bias ? bias[j] : 0.0f;
            for (int c = 0; c < KN_CHUNKS; c++) v += part[c * N + j];
            y[j] = v;
        }
    }
}

/* 1 to STEP_MAX_ROWS rows: up to MAX_ROWS with M a constant (x's values in registers), more in one pass
   whose column tiles hold every row's sums, so that each weight is read from memory once for all rows
   (in groups of MAX_ROWS a 16-row step read every matrix four times and took three times a 1-row one). */
static void f32_kn_matvec(const float *W, const float *x, const float *bias, float *y, int64_t K, int64_t N,
                          int64_t M, int threads, float *part) {
    void (*run[])(const float *, const float *, const float *, float *, int64_t, int64_t, int) =
        {kn_matvec_1, kn_matvec_2, kn_matvec_3, kn_matvec_4};
    if (M == 1 && part)
        kn_vec(W, x, bias, y, K, N, threads, part);
    else if (M > MAX_ROWS)
        kn_matvec(W, x, bias, y, K, N, M, threads);
    else
        run[M - 1](W, x, bias, y, K, N, threads);
}

/* x (M, K) float32 times W (K, N) float32 as GPT-2's Conv1D stores it, plus bias (N) or NULL -> y (M, N)
   float32, M from 1 to STEP_MAX_ROWS: the step's products, for the few positions of a prompt that the
   torch path reads (engine/lean.py Conv1D; BLAS's gemm packed each matrix again for every call, and a
   15-token prompt's products took twice a 16-row step's). One row of x runs kn_matvec_1 (the step's
   one-row product, kn_vec, needs its scratch). Returns -1 for an M it does not take. */
int LMHEAD_VARIANT(lmhead_f32_kn_matvec)(const float *W, const float *x, const float *bias, float *y, int64_t K,
                                         int64_t N, int64_t M, int threads) {
    if (M < 1 || M > STEP_MAX_ROWS) /* kn_rows holds x's values for at most STEP_MAX_ROWS rows */
        return -1;
    f32_kn_matvec(W, x, bias, y, K, N, M, threads, NULL);
    return 0;
}

/* Product i of a block: x (B, K) float32 -> y (B, N) float32, in the block's weight kind; `xb` and `yb`
   are bfloat16 scratch rows for LMHEAD_STEP_BF16 (whose kernel takes and gives bfloat16). Rows in groups of
   MAX_ROWS for the row kernels. Returns -1 where a kernel could not allocate its buffer. */
static int step_product(const lmhead_layer *l, int i, int kind, const float *x, float *y, int64_t B, int64_t K,
                        int64_t N, uint16_t *xb, uint16_t *yb, float *part, int threads) {
    if (kind == LMHEAD_STEP_F32) {
        f32_kn_matvec((const float *)l->w[i], x, (const float *)l->b[i], y, K, N, B, threads, part);
        return 0;
    }
    for (int64_t m0 = 0; m0 < B; m0 += MAX_ROWS) {
        int64_t M = B - m0 < MAX_ROWS ? B - m0 : MAX_ROWS;
        if (kind == LMHEAD_STEP_INT8) {
            if (LMHEAD_VARIANT(lmhead_int8_matvec)((const int8_t *)l->w[i], l->s[i], x + m0 * K, (const float *)l->b[i],
                                                   y + m0 * N, N, K, M, threads))
                return -1;
            continue;
        }
        for (int64_t j = 0; j < M * K; j++) xb[j] = f32_to_bf16(x[m0 * K + j]); /* x holds bfloat16 values */
        if (LMHEAD_VARIANT(lmhead_bf16_matvec)((const uint16_t *)l->w[i], xb, (const uint16_t *)l->b[i], yb, N, K, M,
                                               threads))
            return -1;
        for (int64_t j = 0; j < M * N; j++) y[m0 * N + j] = bf16_to_f32(yb[j]);
    }
    return 0;
}

/* The step's buffers on cache lines: kn_vec loads and stores a 64-byte vector of its sums per 64 bytes
   of weights, and a vector that straddles two lines costs two (malloc gives 16-byte alignment). */
static void *step_alloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* Attention of the T new positions of row b: their queries q (T rows of qkv, `qs` floats apart) over the
   row's cache (k, v: head h at h * csh, position t at t * hd) up to position past + T - 1, position t
   seeing keys 0 … past + t: through `mask` ((T, past + T) additive rows, msb apart) where it is given,
   else through `causal`, the same rows built once a call. A masked key's weight is exp(-inf) = 0, so
   each position's sums are those over its own keys alone. out: (T, H · hd). */
static int step_attend(const float *q, int64_t qs, const float *k, const float *v, int64_t csh, const float *mask,
                       int64_t msb, const float *causal, float *out, int64_t T, int64_t H, int64_t hd, int64_t past,
                       int threads) {
    return LMHEAD_VARIANT(lmhead_attend)(q, qs, hd, k, v, 0, csh, mask ? mask : causal, mask ? msb : past + T, out, T,
                                         H, past + T, hd, (float)(1.0 / sqrt((double)hd)), threads);
}

/* x (B · T, D) float32, the residual stream of B rows at T new positions each (row b's position past + t
   at x + (b · T + t) · D; bfloat16 values for LMHEAD_STEP_BF16), through the L blocks `layers`, in
   place. The KV cache: k, v float32 at k + l * csl + b * csb + h * csh + t * hd (t < past filled;
   positions past … past + T - 1 written here). mask: an additive (past + T) float32 row per new
   position, row b's position t at mask + (b · T + t) · msb, or NULL: no mask for one position, causal
   among the new positions for more. Returns 0, -1 where a buffer could not be allocated (x then partly
   updated: the caller raises), -2 for sizes it does not take (nothing done). */
int LMHEAD_VARIANT(lmhead_step)(const lmhead_layer *layers, int64_t L, int kind, float *x, int64_t B, int64_t T,
                                int64_t D, int64_t H, int64_t inner, float eps, float *kc, float *vc, int64_t csl,
                                int64_t csb, int64_t csh, int64_t past, const float *mask, int64_t msb, int threads) {
    if (B < 1 || T < 1 || B * T > STEP_MAX_ROWS || D % H) return -2;
    int64_t R = B * T, hd = D / H, widest = inner > 3 * D ? inner : 3 * D; /* R: the products' rows */
    float *h = step_alloc(sizeof(float) * (size_t)(R * D)), *big = step_alloc(sizeof(float) * (size_t)(R * widest)),
          *a = step_alloc(sizeof(float) * (size_t)(R * D));
    uint16_t *xb = step_alloc(sizeof(uint16_t) * (size_t)(MAX_ROWS * widest)),
             *yb = step_alloc(sizeof(uint16_t) * (size_t)(MAX_ROWS * widest));
    /* one row of float32: each block's sums over all of a product's columns (kn_vec) */
    float *part = kind == LMHEAD_STEP_F32 && R == 1 ? step_alloc(sizeof(float) * (size_t)(KN_CHUNKS * widest)) : NULL;
    /* several positions and no mask: each sees the cache and the new positions up to itself */
    float *causal = T > 1 && !mask ? step_alloc(sizeof(float) * (size_t)(T * (past + T))) : NULL;
    int failed = !(h && big && a && xb && yb && (part || kind != LMHEAD_STEP_F32 || R != 1) && (causal || T == 1 || mask));
    for (int64_t t = 0; causal && t < T; t++)
        for (int64_t j = 0; j < past + T; j++) causal[t * (past + T) + j] = j <= past + t ? 0.0f : -INFINITY;
    for (int64_t li = 0; li < L && !failed; li++) {
        const lmhead_layer *l = layers + li;
        float *kl = kc + li * csl, *vl = vc + li * csl;
        step_norm(x, h, R, D, l->ln1_w, l->ln1_b, eps, kind);
        if (step_product(l, 0, kind, h, big, R, D, 3 * D, xb, yb, part, threads)) { failed = 1; break; }
        for (int64_t r = 0; r < R; r++) /* k and v of each head into the cache at past + t */
            for (int64_t hh = 0; hh < H; hh++) {
                const float *qkv = big + r * 3 * D + hh * hd;
                int64_t at = (r / T) * csb + hh * csh + (past + r % T) * hd;
                memcpy(kl + at, qkv + D, (size_t)hd * sizeof(float));
                memcpy(vl + at, qkv + 2 * D, (size_t)hd * sizeof(float));
            }
        if (T == 1) { /* a decoding step: every row's one query in one call */
            if (LMHEAD_VARIANT(lmhead_attend)(big, 3 * D, hd, kl, vl, csb, csh, mask, msb, a, B, H, past + 1, hd,
                                              (float)(1.0 / sqrt((double)hd)), threads)) { failed = 1; break; }
        } else {
            for (int64_t b = 0; b < B && !failed; b++)
                failed = step_attend(big + b * T * 3 * D, 3 * D, kl + b * csb, vl + b * csb, csh,
                                     mask ? mask + b * T * msb : NULL, msb, causal, a + b * T * D, T, H, hd, past,
                                     threads) != 0;
            if (failed) break;
        }
        if (kind == LMHEAD_STEP_BF16)
            for (int64_t j = 0; j < R * D; j++) a[j] = round_bf16(a[j]);
        if (step_product(l, 1, kind, a, h, R, D, D, xb, yb, part, threads)) { failed = 1; break; }
        for (int64_t j = 0; j < R * D; j++) x[j] = kind == LMHEAD_STEP_BF16 ? round_bf16(x[j] + h[j]) : x[j] + h[j];
        step_norm(x, h, R, D, l->ln2_w, l->ln2_b, eps, kind);
        if (step_product(l, 2, kind, h, big, R, D, inner, xb, yb, part, threads)) { failed = 1; break; }
        step_gelu(big, R * inner, kind);
        if (step_product(l, 3, kind, big, h, R, inner, D, xb, yb, part, threads)) { failed = 1; break; }
        for (int64_t j = 0; j < R * D; j++) x[j] = kind == LMHEAD_STEP_BF16 ? round_bf16(x[j] + h[j]) : x[j] + h[j];
    }
    free(h), free(big), free(a), free(xb), free(yb), free(part), free(causal);
    return failed ? -1 : 0;
}

/* ---- a whole decoding step, token to logits, in one call ----

   What engine/lean.py's LeanGPT2.last_logits does for one new position of B rows, around the blocks
   above: the token and position embeddings, every block (lmhead_step), ln_f and the head, in the
   figures of the torch path (its embedding sums and roundings, the head's own kernel). Between the
   blocks' and the head's products, which stream the weights through every cache, the torch path
   dispatched some twenty ops and Python calls, each waiting on memory the products had evicted:
   measured on an AVX2 Zen 3, 1.0-1.5 ms of a token (an int8 token took 8.5 ms). */


/* Each of B rows' greedy record from its logits (B, V), by score's row kernel while they are fresh (strict:
   a logit that is not finite spoils the row): top_id (B) the top-1's id, top (3, B) the top-1's log p, the
   entropy and the top-1's logit. Returns the number of rows spoilt (0: every record made). */
static int step_record(const float *logits, int64_t B, int64_t V, int64_t *top_id, float *top, int threads) {
    int64_t zeros[STEP_MAX_ROWS] = {0}, rank[STEP_MAX_ROWS];
    float logprob[STEP_MAX_ROWS], varentropy[STEP_MAX_ROWS], margin[STEP_MAX_ROWS];
    int64_t bad = LMHEAD_VARIANT(lmhead_score_rows)(logits, zeros, B, V, logprob, rank, top + B, top_id, top,
                                                    varentropy, margin, 1, threads);
    for (int64_t b = 0; b < B && !bad; b++) top[2 * B + b] = logits[b * V + top_id[b]];
    return (int)bad;
}

/* logits (B, V) float32 for tokens ids (B) at positions pos (B; NULL: every row at `past`), writing each
   layer's key and value at `past` (the cache and mask as lmhead_step's). B is at most STEP_MAX_ROWS, and
   at most MAX_ROWS but for float32 (the head kernels' limits). With top_id (B) and top (3, B) given,
   each row's greedy record too, from score's row kernel while the logits are fresh (strict: a logit
   that is not finite spoils the row): its top-1 id, the top-1's log p, the entropy and the top-1's
   logit. Returns 0; the number of rows whose record is spoilt (the logits are whole: the caller
   records them itself); -1 where a buffer could not be allocated (the cache then partly written: the
   caller raises); -2 for a B, a token id or a position out of range (nothing written: the caller's
   torch path reports it). */
int LMHEAD_VARIANT(lmhead_decode)(const lmhead_model *m, const int64_t *ids, const int64_t *pos, int64_t B,
                                  float *kc, float *vc, int64_t csl, int64_t csb, int64_t csh, int64_t past,
                                  const float *mask, int64_t msb, float *logits, int64_t *top_id, float *top,
                                  int threads) {
    int64_t D = m->D, V = m->V;
    if (B < 1 || B > (m->kind == LMHEAD_STEP_F32 ? LMHEAD_F32_MAX_ROWS : MAX_ROWS) || B > STEP_MAX_ROWS) return -2;
    for (int64_t b = 0; b < B; b++) {
        int64_t p = pos ? pos[b] : past;
        if (ids[b] < 0 || ids[b] >= V || p < 0 || p >= m->n_pos) return -2;
    }
    float *x = step_alloc(sizeof(float) * (size_t)(B * D)), *h = step_alloc(sizeof(float) * (size_t)(B * D));
    int bf16 = m->kind == LMHEAD_STEP_BF16; /* the head's kernel takes and gives bfloat16 */
    uint16_t *xb = bf16 ? step_alloc(sizeof(uint16_t) * (size_t)(B * D)) : NULL,
             *yb = bf16 ? step_alloc(sizeof(uint16_t) * (size_t)(B * V)) : NULL;
    int status = x && h && ((xb && yb) || !bf16) ? 0 : -1;
    for (int64_t b = 0; b < B && !status; b++) { /* wte(ids) + wpe(pos), as the torch path adds them */
        float *xr = x + b * D;
        int64_t p = pos ? pos[b] : past;
        for (int64_t d = 0; d < D; d++) {
            float e = m->kind == LMHEAD_STEP_INT8 ? (float)((const int8_t *)m->wte)[ids[b] * D + d] * m->wte_s[ids[b]]
                                           : step_param(m->wte, ids[b] * D + d, m->kind);
            float v = e + step_param(m->wpe, p * D + d, m->kind);
            xr[d] = m->kind == LMHEAD_STEP_BF16 ? round_bf16(v) : v;
        }
    }
    if (!status)
        status = LMHEAD_VARIANT(lmhead_step)(m->layers, m->L, m->kind, x, B, 1, D, m->H, m->inner, m->eps, kc, vc,
                                             csl, csb, csh, past, mask, msb, threads) ? -1 : 0;
    if (!status) {
        step_norm(x, h, B, D, m->lnf_w, m->lnf_b, m->eps, m->kind);
        if (m->kind == LMHEAD_STEP_F32) {
            LMHEAD_VARIANT(lmhead_f32_matvec)((const float *)m->head, h, NULL, logits, V, D, B, threads);
        } else if (m->kind == LMHEAD_STEP_INT8) {
            status = LMHEAD_VARIANT(lmhead_int8_matvec)((const int8_t *)m->head, m->head_s, h, NULL, logits, V, D, B,
                                                        threads) ? -1 : 0;
        } else {
            for (int64_t j = 0; j < B * D; j++) xb[j] = f32_to_bf16(h[j]); /* h holds bfloat16 values */
            status = LMHEAD_VARIANT(lmhead_bf16_matvec)((const uint16_t *)m->head, xb, NULL, yb, V, D, B, threads)
                         ? -1 : 0;
            for (int64_t j = 0; !status && j < B * V; j++) logits[j] = bf16_to_f32(yb[j]);
        }
    }
    free(x), free(h), free(xb), free(yb);
    return !status && top_id ? step_record(logits, B, V, top_id, top, threads) : status;
}

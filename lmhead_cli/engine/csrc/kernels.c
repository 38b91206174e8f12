/* lmhead's CPU kernels: products that stream low-precision weights for the lean engine's decoding
   steps, one query's attention over the KV cache, and score's per-row figures.

   y[m, n] = scale[n] * sum_k W[n, k] * x[m, k] + bias[n]   for a few rows m (M <= MAX_ROWS)

   W is rows (N, K): int8 (with a float32 scale per row) or bfloat16 (no scale). No activation is
   rounded to 8 or 16 bits: int8 products take the activations as exact 23-bit integers through
   AVX-512 VNNI, bfloat16 ones multiply bfloat16 pairs exactly into float32 sums with AVX512-BF16, and
   elsewhere each weight is widened to float32 in registers. The weights are read once at their own
   width (a quarter or a half of float32's bytes), and the output rows are split among OpenMP threads
   (the same OpenMP runtime torch runs on: the extension links to it by soname).

   Built by `pip install` (setup.py) as part of the extension module lmhead_cli.engine._kernels: each
   variant_*.c file compiles this file once for one x86-64 instruction-set level (GCC's target
   pragma), with its public names suffixed by LMHEAD_VARIANT, and engine/kernels.py picks the best
   variant the CPU runs (module.c asks cpuid). Never -march=native: the same build runs on any x86-64
   CPU. No Python or torch headers: called through ctypes with the tensors' data pointers. */

#ifndef LMHEAD_VARIANT
#define LMHEAD_VARIANT(name) name##_base
#endif
#include "kernels.h" /* the interface, this variant's functions declared: each definition is held to it */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_ROWS LMHEAD_MAX_ROWS
#define ROW_BLOCK 4 /* weight rows per inner step: each activation vector load serves four of them */
/* Each row is a short stream (768 bytes of int8 in GPT-2), too short for the hardware prefetchers to
   follow: the kernels ask for the weights PREFETCH_BYTES ahead of each load themselves (one thread read
   at 8 GB/s without, 18 GB/s with, on the machine they were written on), a cache line of each row at
   a time, whatever the weights' width. One row of x reads rows one after another instead (one stream,
   which the prefetchers follow: DEFINE_ONE_ROW, f32_one_row). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
/* The fewest rows (or blocks of ROW_BLOCK rows) a thread takes at a time: the threads share the rows by
   OpenMP's guided schedule (each take a share of the rows left, halving as they run out, down to this),
   not a fixed half each. A core that the machine slows (a neighbour's process, a hypervisor's steal)
   then does less of the product instead of holding the other threads at its end: measured on this
   project's 2-core VM, one thread of a fixed split waited at the product's end for a third of the step.
   Guided rather than pieces of this size taken in turn (dynamic): long runs of rows, which the
   prefetchers follow; measured in one process on the AVX-512 EPYC host, random:gpt2's int8 step took
   5.35 ms guided against 5.94 in 64-row pieces (bfloat16: 8.08 against 8.23). Each row is still summed
   by one thread in one order, so the thread count and the schedule change no bit. 64 rows of GPT-2's
   768 float32 are 192 KB. */
#define PIECE_ROWS 64
#define PIECE_BLOCKS (PIECE_ROWS / ROW_BLOCK)
#endif

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest, ties to even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vbroadcast(float a) { return _mm512_set1_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b */
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vabs(vf a) { return _mm512_abs_ps(a); }
static inline vf vsign_of(vf a, vf b) { /* |a| with b's sign bit or-ed in (a >= 0) */
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_and_si512(
        _mm512_castps_si512(b), _mm512_set1_epi32((int)0x80000000u))));
}
static inline vf vpow2_times(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p * 2^n, rounded once */
static inline vf vi8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vbf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vbroadcast(float a) { return _mm256_set1_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); } /* c - a * b */
static inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline vf vsign_of(vf a, vf b) { return _mm256_or_ps(a, _mm256_and_ps(b, _mm256_set1_ps(-0.0f))); }
/* p * 2^n for integer n in [-150, 0] as two powers of two of at most half n each (both normal floats),
   so that the product rounds once into float32's subnormals, as AVX-512's scalef does */
static inline vf vpow2_times(vf p, vf n) {
    __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, p1), p2);
}
static inline vf vi8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vbf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#else
#define LANES 0
#endif

/* One weight type's kernel: W_T rows, LOAD_W widens LANES of them, SCALAR_W one. NAME##_rows takes
   1 to GROUP rows of x and runs an instance with M a constant, whose sums the compiler keeps in
   registers (with M a variable they were an array in memory, a load and a store per fma). GROUP is
   what fits the registers: 4 rows' sums of four weight rows, their four weights and x on AVX-512's
   32, 2 rows' on AVX2's 16 (3 rows measured slower there). The sums and their order are the same
   whatever the group: the same bits. Measured on AVX2 (Zen 3, 2 threads, alternating): GPT-2's head
   for 16 rows 17.2-20.9 ms against 25.8-29.8, for 4 rows 9.4-10.0 against 11.6-12.0; a 4-row step's
   body in int8 13.4-13.8 ms against 15.8-17.2, in bfloat16 14.3-14.6 against 18.0-20.5. */
#if LANES == 8
#define GROUP 2
#else
#define GROUP MAX_ROWS
#endif
#define DEFINE_MATVEC(NAME, W_T, LOAD_W, SCALAR_W)                                                   \
    static inline __attribute__((always_inline)) void NAME##_rows_m(                                 \
        const W_T *w, const float *x, float *acc, int64_t K, const int64_t M, int64_t r, int64_t rows) { \
        /* acc[m * ROW_BLOCK + j] = sum_k w[(r + j) * K + k] * x[m * K + k], j < rows */             \
        int64_t k = 0;                                                                             \
        for (int64_t i = 0; i < M * ROW_BLOCK; i++) acc[i] = 0.0f;                                  \
        if (LANES && rows == ROW_BLOCK) {                                                            \
            VECTOR_BODY(W_T, LOAD_W)                                                                \
        }                                                                                          \
        for (; k < K; k++)                                                                         \
            for (int64_t j = 0; j < rows; j++) {                                                   \
                float wv = SCALAR_W(w[(r + j) * K + k]);                                           \
                for (int64_t m = 0; m < M; m++) acc[m * ROW_BLOCK + j] += wv * x[m * K + k];        \
            }                                                                                      \
    }                                                                                              \
    static void NAME##_rows(const W_T *w, const float *x, float *acc, int64_t K, int64_t M, int64_t r, \
                            int64_t rows) { /* M <= GROUP (AVX2: no 3- or 4-row instance is built) */ \
        if (M == 1) NAME##_rows_m(w, x, acc, K, 1, r, rows);                                         \
        else if (M == 2 || GROUP == 2) NAME##_rows_m(w, x, acc, K, 2, r, rows);                      \
        else if (M == 3) NAME##_rows_m(w, x, acc, K, 3, r, rows);                                    \
        else NAME##_rows_m(w, x, acc, K, 4, r, rows);                                                \
    }

#if LANES
#define VECTOR_BODY(W_T, LOAD_W)                                                                   \
    vf s[MAX_ROWS][ROW_BLOCK];                                                                     \
    for (int64_t m = 0; m < M; m++)                                                                \
        for (int j = 0; j < ROW_BLOCK; j++) s[m][j] = vzero();                                     \
    const W_T *w0 = w + r * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;                           \
    for (; k + LANES <= K; k += LANES) {                                                           \
        vf a0 = LOAD_W(w0 + k), a1 = LOAD_W(w1 + k), a2 = LOAD_W(w2 + k), a3 = LOAD_W(w3 + k);     \
        if ((k * (int64_t)sizeof(W_T)) % 64 == 0) { /* each of the four rows asked for ahead, a line at a time */ \
            _mm_prefetch((const char *)(w0 + k) + PREFETCH_BYTES, _MM_HINT_T0);                     \
            _mm_prefetch((const char *)(w1 + k) + PREFETCH_BYTES, _MM_HINT_T0);                     \
            _mm_prefetch((const char *)(w2 + k) + PREFETCH_BYTES, _MM_HINT_T0);                     \
            _mm_prefetch((const char *)(w3 + k) + PREFETCH_BYTES, _MM_HINT_T0);                     \
        }                                                                                          \
        for (int64_t m = 0; m < M; m++) {                                                          \
            vf xv = vload(x + m * K + k);                                                          \
            s[m][0] = vfma(a0, xv, s[m][0]);                                                       \
            s[m][1] = vfma(a1, xv, s[m][1]);                                                       \
            s[m][2] = vfma(a2, xv, s[m][2]);                                                       \
            s[m][3] = vfma(a3, xv, s[m][3]);                                                       \
        }                                                                                          \
    }                                                                                              \
    for (int64_t m = 0; m < M; m++)                                                                \
        for (int j = 0; j < ROW_BLOCK; j++) acc[m * ROW_BLOCK + j] = vsum(s[m][j]);
#else
#define VECTOR_BODY(W_T, LOAD_W)
#endif

#define I8(v) ((float)(v))
#define F32(v) (v)
DEFINE_MATVEC(i8, int8_t, vi8, I8)
DEFINE_MATVEC(bf16, uint16_t, vbf16, bf16_to_f32)
DEFINE_MATVEC(f32, float, vload, F32)

/* y (M, N) = (x (M, K) · w (N, K) rows ᵀ) * s (N, or NULL: 1) + bias (N, or NULL: 0), float32 out, for
   int8 rows (`int8`) or float32 rows: the rows in blocks of ROW_BLOCK split among the threads. Each
   block meets every group of GROUP rows of x while it is in the cache (12 KB of float32 for GPT-2's
   768), so that w is read from memory once however many groups there are (float32's head takes up to
   LMHEAD_F32_MAX_ROWS rows: a batched step's; called a group at a time, w was read once a group). */
static inline __attribute__((always_inline)) void rows_matvec(const void *w, const int int8, const float *s,
                                                              const float *x, const float *bias, float *y,
                                                              int64_t N, int64_t K, int64_t M, int threads) {
    int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(guided, PIECE_BLOCKS)
    for (int64_t b = 0; b < blocks; b++) {
        float acc[MAX_ROWS * ROW_BLOCK];
        int64_t r = b * ROW_BLOCK, rows = N - r < ROW_BLOCK ? N - r : ROW_BLOCK;
        for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
            int64_t g = M - m0 < GROUP ? M - m0 : GROUP;
            if (int8)
                i8_rows((const int8_t *)w, x + m0 * K, acc, K, g, r, rows);
            else
                f32_rows((const float *)w, x + m0 * K, acc, K, g, r, rows);
            for (int64_t m = 0; m < g; m++)
                for (int64_t j = 0; j < rows; j++)
                    y[(m0 + m) * N + r + j] = acc[m * ROW_BLOCK + j] * (s ? s[r + j] : 1.0f) + (bias ? bias[r + j] : 0.0f);
        }
    }
}

/* y (N) = w (N, K) float32 rows · x (K) + bias (N) or 0, for one row of x (a single stream's step): each
   thread takes a contiguous range of rows and reads them one after another, one stream in memory order
   with four independent sums a row. Four rows at a time (rows_matvec) are four streams a row apart,
   which the prefetchers follow worse: measured alone on GPT-2's head shape, 9-11 GB/s against 14 on
   4 KiB pages (2 threads, Zen 4), where x's reuse across rows saves nothing (x stays in L1 either way). */
static void f32_one_row(const float *w, const float *x, const float *bias, float *y, int64_t N, int64_t K,
                        int threads) {
#pragma omp parallel for num_threads(threads) schedule(guided, PIECE_ROWS)
    for (int64_t r = 0; r < N; r++) {
        const float *wr = w + r * K;
        int64_t k = 0;
        float sum = 0.0f;
#if LANES
        vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
        for (; k + 4 * LANES <= K; k += 4 * LANES) {
            s0 = vfma(vload(wr + k), vload(x + k), s0);
            s1 = vfma(vload(wr + k + LANES), vload(x + k + LANES), s1);
            s2 = vfma(vload(wr + k + 2 * LANES), vload(x + k + 2 * LANES), s2);
            s3 = vfma(vload(wr + k + 3 * LANES), vload(x + k + 3 * LANES), s3);
        }
        for (; k + LANES <= K; k += LANES) s0 = vfma(vload(wr + k), vload(x + k), s0);
        sum = vsum(vadd(vadd(s0, s1), vadd(s2, s3)));
#endif
        for (; k < K; k++) sum += wr[k] * x[k];
        y[r] = sum + (bias ? bias[r] : 0.0f);
    }
}

/* One row of x over int8 or bfloat16 rows where no dot-product instruction takes them (AVX2, AVX-512
   without VNNI or BF16): as f32_one_row, each row of w read in memory order and widened to float32 in
   registers, four independent sums a row: out[r - r0] for rows r0 .. r1 - 1, times its scale s[r]
   (int8; NULL: 1). xf is x as float32 (bfloat16's widened once by the caller). The same sums in the
   same order whichever thread takes the rows. Measured on an AVX2 machine (Zen 3, 2 threads, one
   process alternating builds): a GPT-2 token's 49 int8 products 8.4-8.8 ms against 14.6-19.9 for four
   rows at a time with int8 not asked for ahead, bfloat16's 11.6-13.3 against 16.5-17.1. */
#define DEFINE_ONE_ROW(NAME, W_T, LOAD_W, SCALAR_W)                                                    \
    static void NAME##_one_row(const W_T *w, const float *s, const float *xf, float *out, int64_t K,    \
                               int64_t r0, int64_t r1) {                                                \
        for (int64_t r = r0; r < r1; r++) {                                                             \
            const W_T *wr = w + r * K;                                                                  \
            int64_t k = 0;                                                                              \
            float sum = 0.0f;                                                                           \
            ONE_ROW_BODY(LOAD_W)                                                                        \
            for (; k < K; k++) sum += SCALAR_W(wr[k]) * xf[k];                                          \
            out[r - r0] = s ? sum * s[r] : sum;                                                         \
        }                                                                                               \
    }
/* The one-row forms ask for the weights ONE_ROW_AHEAD bytes ahead as well: int8 and bfloat16 are
   consumed slower than the prefetchers fetch for a float32 stream (each weight is widened first), and
   waited for memory between. Measured (AVX2 Zen 3, int8, GPT-2's 124 MB of products): one thread in a C
   harness 12.9-13.9 GB/s against 11.3-11.9 without (17.5 from L2); the engine's 2 threads 7.5-8.0 ms a
   token's products against 7.8-8.4, bfloat16 12.6 against 13.3 (medians, alternating). float32's rows
   (f32_one_row) were slower with it (6.9-10.0 ms against 6.4-9.1 for the head): left without. */
#define ONE_ROW_AHEAD 1024
#if LANES
#define ONE_ROW_BODY(LOAD_W)                                                                           \
    vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();                                        \
    for (; k + 4 * LANES <= K; k += 4 * LANES) {                                                       \
        _mm_prefetch((const char *)(wr + k) + ONE_ROW_AHEAD, _MM_HINT_T0);                             \
        s0 = vfma(LOAD_W(wr + k), vload(xf + k), s0);                                                  \
        s1 = vfma(LOAD_W(wr + k + LANES), vload(xf + k + LANES), s1);                                  \
        s2 = vfma(LOAD_W(wr + k + 2 * LANES), vload(xf + k + 2 * LANES), s2);                          \
        s3 = vfma(LOAD_W(wr + k + 3 * LANES), vload(xf + k + 3 * LANES), s3);                          \
    }                                                                                                  \
    for (; k + LANES <= K; k += LANES) s0 = vfma(LOAD_W(wr + k), vload(xf + k), s0);                   \
    sum = vsum(vadd(vadd(s0, s1), vadd(s2, s3)));
#else
#define ONE_ROW_BODY(LOAD_W)
#endif
DEFINE_ONE_ROW(i8, int8_t, vi8, I8)
DEFINE_ONE_ROW(bf16, uint16_t, vbf16, bf16_to_f32)

/* x (M, K) float32, w (N, K) float32 rows, bias (N) float32 or NULL -> y (M, N) float32: the head's
   product over its rows (E's, when tied). One row of x reads each row of w in order (f32_one_row); more
   take four rows of w a step, each asked for PREFETCH_BYTES ahead, up to LMHEAD_F32_MAX_ROWS rows of x
   in one pass over w. */
int LMHEAD_VARIANT(lmhead_f32_matvec)(const float *w, const float *x, const float *bias, float *y, int64_t N,
                                      int64_t K, int64_t M, int threads) {
    if (M == 1)
        f32_one_row(w, x, bias, y, N, K, threads);
    else
        rows_matvec(w, 0, NULL, x, bias, y, N, K, M, threads);
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* int8 x int8 dot products with VNNI (vpdpbusd: 64 unsigned bytes times 64 signed bytes, four at a time,
   summed into 16 int32 lanes) over an activation row written exactly as integers: each row x_m becomes
   v = round(c_m * x), |v| <= STEPS, c_m = STEPS / max|x_m| (23 bits of the row's largest value), and
   u = v + OFFSET in [0, 2^24) is three unsigned bytes d_0 + 256 d_1 + 65536 d_2. Then
       sum_k q_k v_k = S_0 + 256 S_1 + 65536 S_2 - OFFSET * sum_k q_k,   S_i = sum_k d_i,k q_k,
   each S_i an exact int32 (|S_i| <= 255 * 127 * K < 2^31 for K <= VNNI_MAX_K), recombined in int64 and
   scaled once in double: y = (that / c_m) * s + bias. Three vpdpbusd per 64 weights and row of x, and
   one for sum_k q_k, where widening each weight to float takes twelve operations per 64. */
#define VNNI 1
#define STEPS 8000000.0 /* engine/int8.py's STEPS and OFFSET: the same digits torch._int_mm takes there */
#define OFFSET 0x808080
#define VNNI_MAX_K 65536

/* x (M, K) -> digits (M, 3, Kp) unsigned bytes (zero beyond K) and c (M); 0 if a row is not finite. */
static int i8_digits(const float *x, int64_t M, int64_t K, int64_t Kp, uint8_t *d, double *c) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        float top = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float a = xm[k] < 0 ? -xm[k] : xm[k];
            if (!(a <= 3.4028234663852886e38f)) return 0; /* NaN or infinity */
            top = a > top ? a : top;
        }
        c[m] = top > 0 ? STEPS / (double)top : 1.0;
        uint8_t *d0 = d + m * 3 * Kp, *d1 = d0 + Kp, *d2 = d1 + Kp;
        for (int64_t k = 0; k < Kp; k++) {
            int32_t u = OFFSET;
            if (k < K) {
                double t = c[m] * (double)xm[k];
                u += (int32_t)(t < 0 ? t - 0.5 : t + 0.5);
            } else {
                u = 0;
            }
            d0[k] = (uint8_t)u, d1[k] = (uint8_t)(u >> 8), d2[k] = (uint8_t)(u >> 16);
        }
    }
    return 1;
}

/* Rows r .. r + rows - 1 (rows <= RB) of q against M digit rows: M and RB are constants in each
   instance below, so that the 3 * M * RB sums stay in registers (AVX-512 has 32). */
static inline __attribute__((always_inline)) void i8_vnni_block(
        const int8_t *q, const uint8_t *d, const double *c, const float *s, const float *bias, float *y,
        int64_t N, int64_t K, int64_t Kp, const int64_t M, const int RB, int64_t r, int64_t rows) {
    __m512i S[MAX_ROWS][3][ROW_BLOCK], R[ROW_BLOCK], ones = _mm512_set1_epi8(1);
    for (int j = 0; j < RB; j++) {
        R[j] = _mm512_setzero_si512();
        for (int64_t m = 0; m < M; m++)
            for (int i = 0; i < 3; i++) S[m][i][j] = _mm512_setzero_si512();
    }
    for (int64_t k = 0; k < Kp; k += 64) {
        __mmask64 live = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        __m512i w[ROW_BLOCK];
        for (int j = 0; j < RB; j++) {
            w[j] = j < rows ? _mm512_maskz_loadu_epi8(live, q + (r + j) * K + k) : _mm512_setzero_si512();
            _mm_prefetch((const char *)(q + (r + j) * K + k) + PREFETCH_BYTES, _MM_HINT_T0);
            R[j] = _mm512_dpbusd_epi32(R[j], ones, w[j]);
        }
        for (int64_t m = 0; m < M; m++)
            for (int i = 0; i < 3; i++) {
                __m512i a = _mm512_loadu_si512((const void *)(d + (m * 3 + i) * Kp + k));
                for (int j = 0; j < RB; j++) S[m][i][j] = _mm512_dpbusd_epi32(S[m][i][j], a, w[j]);
            }
    }
    /* Reduced over constant bounds only: an index the compiler cannot resolve would keep every sum in
       memory inside the loop above. */
    int64_t sums[MAX_ROWS][3][ROW_BLOCK], rowsum[ROW_BLOCK];
    for (int j = 0; j < RB; j++) {
        rowsum[j] = _mm512_reduce_add_epi32(R[j]);
        for (int64_t m = 0; m < M; m++)
            for (int i = 0; i < 3; i++) sums[m][i][j] = _mm512_reduce_add_epi32(S[m][i][j]);
    }
    for (int64_t j = 0; j < rows; j++)
        for (int64_t m = 0; m < M; m++) {
            int64_t t = sums[m][0][j] + 256 * sums[m][1][j] + 65536 * sums[m][2][j] - (int64_t)OFFSET * rowsum[j];
            double v = (double)t / c[m] * (double)s[r + j] + (bias ? (double)bias[r + j] : 0.0);
            y[m * N + r + j] = (float)v;
        }
}

#define VNNI_INSTANCE(MM, RBB)                                                                         \
    static void i8_vnni_##MM(const int8_t *q, const uint8_t *d, const double *c, const float *s,       \
                             const float *bias, float *y, int64_t N, int64_t K, int64_t Kp, int threads) { \
        int64_t blocks = (N + RBB - 1) / RBB, piece = PIECE_ROWS / RBB;                                \
        _Pragma("omp parallel for num_threads(threads) schedule(guided, piece)")                      \
        for (int64_t b = 0; b < blocks; b++) {                                                         \
            int64_t r = b * RBB, rows = N - r < RBB ? N - r : RBB;                                     \
            i8_vnni_block(q, d, c, s, bias, y, N, K, Kp, MM, RBB, r, rows);                            \
        }                                                                                              \
    }
VNNI_INSTANCE(1, 1) /* one row of x: w's rows one at a time, one stream in memory order (see f32_one_row) */
VNNI_INSTANCE(2, 2)
VNNI_INSTANCE(3, 2)
VNNI_INSTANCE(4, 2)
#else
#define VNNI 0
#endif

/* x (M, K) float32, q (N, K) int8, s (N) float32, bias (N) float32 or NULL -> y (M, N) float32.
   Returns -1 if it could not allocate its buffer (nothing written then). */
int LMHEAD_VARIANT(lmhead_int8_matvec)(const int8_t *q, const float *s, const float *x, const float *bias, float *y,
                       int64_t N, int64_t K, int64_t M, int threads) {
#if VNNI
    if (K <= VNNI_MAX_K) {
        int64_t Kp = (K + 63) / 64 * 64;
        uint8_t *d = malloc((size_t)(M * 3 * Kp));
        double c[MAX_ROWS];
        if (!d) return -1;
        if (i8_digits(x, M, K, Kp, d, c)) { /* else a row is not finite: the float path, IEEE's NaN and inf */
            void (*run[])(const int8_t *, const uint8_t *, const double *, const float *, const float *,
                          float *, int64_t, int64_t, int64_t, int) = {i8_vnni_1, i8_vnni_2, i8_vnni_3, i8_vnni_4};
            run[M - 1](q, d, c, s, bias, y, N, K, Kp, threads);
            free(d);
            return 0;
        }
        free(d);
    }
#endif
    if (M == 1 && LANES) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t r = 0; r < N; r += PIECE_ROWS) {
            int64_t r1 = r + PIECE_ROWS < N ? r + PIECE_ROWS : N;
            i8_one_row(q, s, x, y + r, K, r, r1);
            if (bias)
                for (int64_t j = r; j < r1; j++) y[j] += bias[j];
        }
        return 0;
    }
    rows_matvec(q, 1, s, x, bias, y, N, K, M, threads);
    return 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* bfloat16 pairs with AVX512-BF16 (vdpbf16ps: 32 bfloat16 products, summed in pairs into 16 float32
   lanes; a bfloat16 product is exact in float32): one instruction per 32 weights, where widening them
   takes six. Like the rest of this file, M and RB are constants in each instance. */
#define DPBF16 1
static inline __attribute__((always_inline)) void bf16_dp_block(
        const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t N, int64_t K,
        const int64_t M, const int RB, int64_t r, int64_t rows) {
    __m512 S[MAX_ROWS][ROW_BLOCK];
    for (int64_t m = 0; m < M; m++)
        for (int j = 0; j < RB; j++) S[m][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __mmask32 live = K - k >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (K - k)) - 1);
        __m512bh a[ROW_BLOCK];
        for (int j = 0; j < RB; j++)
            a[j] = (__m512bh)(j < rows ? _mm512_maskz_loadu_epi16(live, w + (r + j) * K + k) : _mm512_setzero_si512());
        for (int j = 0; j < RB; j++)  /* 32 bfloat16: one cache line */
            _mm_prefetch((const char *)(w + (r + j) * K + k) + PREFETCH_BYTES, _MM_HINT_T0);
        for (int64_t m = 0; m < M; m++) {
            __m512bh b = (__m512bh)_mm512_maskz_loadu_epi16(live, x + m * K + k);
            for (int j = 0; j < RB; j++) S[m][j] = _mm512_dpbf16_ps(S[m][j], a[j], b);
        }
    }
    float sums[MAX_ROWS][ROW_BLOCK];
    for (int64_t m = 0; m < M; m++)
        for (int j = 0; j < RB; j++) sums[m][j] = _mm512_reduce_add_ps(S[m][j]);
    for (int64_t j = 0; j < rows; j++)
        for (int64_t m = 0; m < M; m++)
            y[m * N + r + j] = f32_to_bf16(sums[m][j] + (bias ? bf16_to_f32(bias[r + j]) : 0.0f));
}

#define DPBF16_INSTANCE(MM, RBB)                                                                        \
    static void bf16_dp_##MM(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y,    \
                             int64_t N, int64_t K, int threads) {                                       \
        int64_t blocks = (N + RBB - 1) / RBB, piece = PIECE_ROWS / RBB;                                 \
        _Pragma("omp parallel for num_threads(threads) schedule(guided, piece)")                       \
        for (int64_t b = 0; b < blocks; b++) {                                                          \
            int64_t r = b * RBB, rows = N - r < RBB ? N - r : RBB;                                      \
            bf16_dp_block(w, x, bias, y, N, K, MM, RBB, r, rows);                                       \
        }                                                                                               \
    }
/* One row of x: w's rows one at a time (see f32_one_row), each summed in four independent chains of
   vdpbf16ps (k = 0, 32, 64, 96 mod 128: K = 768 is 24 products, which one chain ran back to back at
   the instruction's latency), the chains added in a fixed order, so any thread count gives the same bits. */
static void bf16_dp_1(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t N,
                      int64_t K, int threads) {
#pragma omp parallel for num_threads(threads) schedule(guided, PIECE_ROWS)
    for (int64_t r = 0; r < N; r++) {
        const uint16_t *wr = w + r * K;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        int64_t k = 0;
        for (; k + 128 <= K; k += 128) {
            s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_loadu_si512(wr + k), (__m512bh)_mm512_loadu_si512(x + k));
            s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_loadu_si512(wr + k + 32), (__m512bh)_mm512_loadu_si512(x + k + 32));
            s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_loadu_si512(wr + k + 64), (__m512bh)_mm512_loadu_si512(x + k + 64));
            s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_loadu_si512(wr + k + 96), (__m512bh)_mm512_loadu_si512(x + k + 96));
        }
        for (; k < K; k += 32) {
            __mmask32 live = K - k >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (K - k)) - 1);
            s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_maskz_loadu_epi16(live, wr + k),
                                  (__m512bh)_mm512_maskz_loadu_epi16(live, x + k));
        }
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
        y[r] = f32_to_bf16(sum + (bias ? bf16_to_f32(bias[r]) : 0.0f));
    }
}
DPBF16_INSTANCE(2, 4)
DPBF16_INSTANCE(3, 4)
DPBF16_INSTANCE(4, 4)
#else
#define DPBF16 0
#endif

/* x (M, K) bfloat16 bits, w (N, K) bfloat16 bits, bias (N) bfloat16 bits or NULL -> y (M, N) bfloat16
   bits: float32 sums plus the bias, rounded once, as torch's bfloat16 addmv. Without AVX512-BF16 each
   thread widens x to float32 once and each weight is widened in registers. */
int LMHEAD_VARIANT(lmhead_bf16_matvec)(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y,
                       int64_t N, int64_t K, int64_t M, int threads) {
#if DPBF16
    void (*run[])(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int) =
        {bf16_dp_1, bf16_dp_2, bf16_dp_3, bf16_dp_4};
    run[M - 1](w, x, bias, y, N, K, threads);
    return 0;
#endif
    int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *xf = malloc(sizeof(float) * (size_t)(M * K));
        if (!xf) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t i = 0; xf && i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
        if (M == 1 && LANES) { /* one row of x: each row of w in memory order (DEFINE_ONE_ROW) */
#pragma omp for schedule(dynamic, 1)
            for (int64_t r = 0; r < N; r += PIECE_ROWS) {
                int64_t r1 = r + PIECE_ROWS < N ? r + PIECE_ROWS : N;
                float out[PIECE_ROWS];
                if (!xf) continue;
                bf16_one_row(w, NULL, xf, out, K, r, r1);
                for (int64_t j = r; j < r1; j++)
                    y[j] = f32_to_bf16(out[j - r] + (bias ? bf16_to_f32(bias[j]) : 0.0f));
            }
        } else {
#pragma omp for schedule(dynamic, PIECE_BLOCKS)
            for (int64_t b = 0; b < blocks; b++) {
                float acc[MAX_ROWS * ROW_BLOCK];
                int64_t r = b * ROW_BLOCK, rows = N - r < ROW_BLOCK ? N - r : ROW_BLOCK;
                if (!xf) continue;
                for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
                    int64_t g = M - m0 < GROUP ? M - m0 : GROUP;
                    bf16_rows(w, xf + m0 * K, acc, K, g, r, rows);
                    for (int64_t m = 0; m < g; m++)
                        for (int64_t j = 0; j < rows; j++) {
                            float b16 = bias ? bf16_to_f32(bias[r + j]) : 0.0f;
                            y[(m0 + m) * N + r + j] = f32_to_bf16(acc[m * ROW_BLOCK + j] + b16);
                        }
                }
            }
        }
        free(xf);
    }
    return failed ? -1 : 0;
}

/* ---- score's rows: log-probability, rank, entropy and top-1 of each row of logits, in two passes ----

   For each row z (V float32) and its token id: m = max z (its first index is the top-1) and m2 the
   second highest (m again when two tokens tie), then, with d = z - m and e = exp(d), S = sum e,
   W = sum e * d and Q = sum e * d^2 (all three in double):
       log p(id) = d[id] - log S,   top-1 log p = -log S,   entropy = log S - W / S,
       varentropy = Var_p[-log p] = Var_p[d] = Q / S - (W / S)^2,   margin = m - m2,
       rank = 1 + #{z > z[id]}.
   What head.score_rows computes in torch in some eight passes over the (N, V) logits and two (N, V)
   temporaries, here in two passes and none. A row whose max is not finite (a NaN, +inf, or every
   logit -inf) gets NaN figures and is counted in the return value; an id outside [0, V) returns -1
   at once, nothing else being trusted. */

#if LANES
/* e^d for d <= 0, float32, within about 1 ulp (Cephes' expf polynomial after d = n ln 2 + r); below
   -103 it is 0, as float32's exp underflows there. The same operations at either width, so AVX2 and
   AVX-512 give the same bits. */
static inline vf exp_le0(vf d) {
    d = vmax(d, vbroadcast(-104.0f));
    vf n = vround(vmul(d, vbroadcast(1.44269504088896341f)));
    vf r = vfnma(n, vbroadcast(0.693359375f), d);
    r = vfnma(n, vbroadcast(-2.12194440e-4f), r);
    vf p = vbroadcast(1.9875691500e-4f);
    p = vfma(p, r, vbroadcast(1.3981999507e-3f));
    p = vfma(p, r, vbroadcast(8.3334519073e-3f));
    p = vfma(p, r, vbroadcast(4.1665795894e-2f));
    p = vfma(p, r, vbroadcast(1.6666665459e-1f));
    p = vfma(p, r, vbroadcast(5.0000001201e-1f));
    p = vfma(vmul(p, r), r, vadd(r, vbroadcast(1.0f)));
    return vpow2_times(p, n); /* gradually to 0 below float32's range */
}
#endif

/* The two highest of m1 >= m2 with x taken in (a tie makes both the same). */
static inline void top2(float x, float *m1, float *m2) {
    if (x > *m1) *m2 = *m1, *m1 = x;
    else if (x > *m2) *m2 = x;
}

static int64_t score_row(const float *row, int64_t id, int64_t V, float *logprob, int64_t *rank,
                         float *entropy, int64_t *top_id, float *top_logprob, float *varentropy, float *margin,
                         int strict) {
    float m = -INFINITY, m2 = -INFINITY;
    int64_t k = 0, unordered = 0;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY), vm2 = vm, inf = _mm512_set1_ps(INFINITY);
    for (; k < V; k += 16) {
        __mmask16 live = V - k >= 16 ? 0xffff : (__mmask16)((1u << (V - k)) - 1);
        __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, row + k);
        unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) |
                     _mm512_cmp_ps_mask(strict ? _mm512_mask_abs_ps(x, live, x) : x, inf, _CMP_EQ_OQ);
        vm2 = _mm512_max_ps(vm2, _mm512_min_ps(vm, x)); /* each lane's two highest */
        vm = _mm512_max_ps(vm, x);
    }
    float lanes[16], lanes2[16];
    _mm512_storeu_ps(lanes, vm);
    _mm512_storeu_ps(lanes2, vm2);
    for (int j = 0; j < 16; j++) top2(lanes[j], &m, &m2), top2(lanes2[j], &m, &m2);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 vm = _mm256_set1_ps(-INFINITY), vm2 = vm, inf = _mm256_set1_ps(INFINITY);
    for (; k + 8 <= V; k += 8) {
        __m256 x = _mm256_loadu_ps(row + k);
        __m256 big = strict ? vabs(x) : x; /* strict: -inf too */
        unordered |= _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q),
                                                     _mm256_cmp_ps(big, inf, _CMP_EQ_OQ)));
        vm2 = _mm256_max_ps(vm2, _mm256_min_ps(vm, x)); /* each lane's two highest */
        vm = _mm256_max_ps(vm, x);
    }
    float lanes[8], lanes2[8];
    _mm256_storeu_ps(lanes, vm);
    _mm256_storeu_ps(lanes2, vm2);
    for (int j = 0; j < 8; j++) top2(lanes[j], &m, &m2), top2(lanes2[j], &m, &m2);
#endif
    for (; k < V; k++) { /* what the vectors left (every logit without them) */
        unordered |= isnan(row[k]) || row[k] == INFINITY || (strict && row[k] == -INFINITY);
        top2(row[k], &m, &m2);
    }
    if (unordered || !(m > -INFINITY)) {
        *logprob = *entropy = *top_logprob = *varentropy = *margin = NAN, *rank = 0, *top_id = -1;
        return 1;
    }
    float picked = row[id];
    double S = 0.0, W = 0.0, Q = 0.0;
    int64_t higher = 0, first = -1;
    k = 0;
#if defined(__AVX512F__)
    __m512d S0 = _mm512_setzero_pd(), S1 = S0, W0 = S0, W1 = S0, Q0 = S0, Q1 = S0;
    __m512 vmax = _mm512_set1_ps(m), vpicked = _mm512_set1_ps(picked);
    for (; k < V; k += 16) {
        __mmask16 live = V - k >= 16 ? 0xffff : (__mmask16)((1u << (V - k)) - 1);
        __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, row + k);
        higher += __builtin_popcount(_mm512_cmp_ps_mask(x, vpicked, _CMP_GT_OQ));
        if (first < 0) {
            __mmask16 at = _mm512_cmp_ps_mask(x, vmax, _CMP_EQ_OQ);
            if (at) first = k + __builtin_ctz(at);
        }
        __m512 d = _mm512_max_ps(_mm512_sub_ps(x, vmax), _mm512_set1_ps(-104.0f)); /* -inf: e = 0, e * d = 0 */
        __m512 e = exp_le0(d), ed = _mm512_mul_ps(e, d);
        S0 = _mm512_add_pd(S0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        S1 = _mm512_add_pd(S1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
        W0 = _mm512_add_pd(W0, _mm512_cvtps_pd(_mm512_castps512_ps256(ed)));
        W1 = _mm512_add_pd(W1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ed), 1))));
        __m512 edd = _mm512_mul_ps(ed, d);
        Q0 = _mm512_add_pd(Q0, _mm512_cvtps_pd(_mm512_castps512_ps256(edd)));
        Q1 = _mm512_add_pd(Q1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(edd), 1))));
    }
    S = _mm512_reduce_add_pd(_mm512_add_pd(S0, S1));
    W = _mm512_reduce_add_pd(_mm512_add_pd(W0, W1));
    Q = _mm512_reduce_add_pd(_mm512_add_pd(Q0, Q1));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256d S0 = _mm256_setzero_pd(), S1 = S0, W0 = S0, W1 = S0, Q0 = S0, Q1 = S0;
    __m256 vmax = _mm256_set1_ps(m), vpicked = _mm256_set1_ps(picked);
    for (; k + 8 <= V; k += 8) {
        __m256 x = _mm256_loadu_ps(row + k);
        higher += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(x, vpicked, _CMP_GT_OQ)));
        if (first < 0) {
            int at = _mm256_movemask_ps(_mm256_cmp_ps(x, vmax, _CMP_EQ_OQ));
            if (at) first = k + __builtin_ctz(at);
        }
        __m256 d = _mm256_max_ps(_mm256_sub_ps(x, vmax), _mm256_set1_ps(-104.0f)); /* -inf: e = 0, e * d = 0 */
        __m256 e = exp_le0(d), ed = _mm256_mul_ps(e, d), edd = _mm256_mul_ps(ed, d);
        S0 = _mm256_add_pd(S0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        S1 = _mm256_add_pd(S1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        W0 = _mm256_add_pd(W0, _mm256_cvtps_pd(_mm256_castps256_ps128(ed)));
        W1 = _mm256_add_pd(W1, _mm256_cvtps_pd(_mm256_extractf128_ps(ed, 1)));
        Q0 = _mm256_add_pd(Q0, _mm256_cvtps_pd(_mm256_castps256_ps128(edd)));
        Q1 = _mm256_add_pd(Q1, _mm256_cvtps_pd(_mm256_extractf128_ps(edd, 1)));
    }
    double sums[4];
    _mm256_storeu_pd(sums, _mm256_add_pd(S0, S1));
    S = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    _mm256_storeu_pd(sums, _mm256_add_pd(W0, W1));
    W = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    _mm256_storeu_pd(sums, _mm256_add_pd(Q0, Q1));
    Q = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    for (; k < V; k++) { /* the last few logits */
        float x = row[k], d = x - m;
        higher += x > picked;
        if (first < 0 && x == m) first = k;
        if (d > -104.0f) {
            float e = expf(d);
            S += e, W += (double)(e * d), Q += (double)(e * d * d);
        }
    }
#else
    for (; k < V; k++) {
        float x = row[k], d = x - m;
        higher += x > picked;
        if (first < 0 && x == m) first = k;
        if (d > -104.0f) {
            float e = expf(d);
            S += e, W += (double)(e * d), Q += (double)(e * d * d);
        }
    }
#endif
    double log_s = log(S), h = log_s - W / S, mean = W / S, var = Q / S - mean * mean;
    *logprob = (float)((double)(picked - m) - log_s);
    *top_logprob = (float)(-log_s);
    *entropy = (float)(h > 0.0 ? h : 0.0);
    *varentropy = (float)(var > 0.0 ? var : 0.0);
    *margin = m - m2; /* inf when no second token is possible */
    *rank = 1 + higher;
    *top_id = first;
    return 0;
}

/* z (N, V) float32 rows, ids (N) int64 -> logprob, entropy, top_logprob, varentropy, margin (N) float32,
   rank, top_id (N) int64. Returns how many rows are not finite (their figures NaN), or -1 for an id
   outside [0, V). `strict`: a row with a -inf logit counts as not finite too (a decoding step's record,
   whose figures torch's record marks not finite; scoring takes -inf as a token ruled out). One row
   (a decoding step's) runs on the calling thread: no parallel region to start and end. */
int64_t LMHEAD_VARIANT(lmhead_score_rows)(const float *z, const int64_t *ids, int64_t N, int64_t V, float *logprob,
                          int64_t *rank, float *entropy, int64_t *top_id, float *top_logprob, float *varentropy,
                          float *margin, int strict, int threads) {
    for (int64_t n = 0; n < N; n++)
        if (ids[n] < 0 || ids[n] >= V) return -1;
    int64_t bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : bad) if (N > 1)
    for (int64_t n = 0; n < N; n++)
        bad += score_row(z + n * V, ids[n], V, logprob + n, rank + n, entropy + n, top_id + n, top_logprob + n,
                         varentropy + n, margin + n, strict);
    return bad;
}

/* ---- one new position's attention over the KV cache (a decoding step) ----

   For each of the B*H heads (b, h), with q its query (hd), k_t and v_t the cached key and value of
   position t < T, and mask an additive (B, T) row or NULL:
       s_t = (q . k_t) * scale + mask[b, t],   p = softmax(s),   out = sum_t p_t v_t.
   What the lean engine's torch path does in a matmul, a scaling, a mask addition, a softmax and a
   second matmul per layer (each a dispatch with its own set-up, several times this work for one
   query), in float32, the sums in another order. The tensors are read where they lie: q[b, h] at
   q + b*qsb + h*qsh, the cache's rows of (b, h) at k + b*ksb + h*ksh (hd floats apart), mask[b] at
   mask + b*msb. out (B, H*hd), the (B, 1, D) layout the output projection takes. A NaN stays NaN
   (a max that skips it, then exp(NaN) in the sum). Returns -1 if the scores' buffer cannot be had. */
int LMHEAD_VARIANT(lmhead_attend)(const float *q, int64_t qsb, int64_t qsh, const float *k, const float *v, int64_t ksb,
                  int64_t ksh, const float *mask, int64_t msb, float *out, int64_t B, int64_t H, int64_t T,
                  int64_t hd, float scale, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc((size_t)(T > 0 ? T : 1) * sizeof(float));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < B * H; g++) {
            if (!s) continue;
            int64_t b = g / H, h = g % H;
            const float *qg = q + b * qsb + h * qsh, *kg = k + b * ksb + h * ksh, *vg = v + b * ksb + h * ksh;
            const float *mg = mask ? mask + b * msb : NULL;
            float m = -INFINITY;
            for (int64_t t = 0; t < T; t++) {
                float acc = 0.0f;
                const float *kt = kg + t * hd;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < hd; d++) acc += qg[d] * kt[d];
                s[t] = acc * scale + (mg ? mg[t] : 0.0f);
                m = s[t] > m ? s[t] : m;
            }
            float sum = 0.0f;
            for (int64_t t = 0; t < T; t++) {
                s[t] = expf(s[t] - m);
                sum += s[t];
            }
            float *og = out + g * hd;
            for (int64_t d = 0; d < hd; d++) og[d] = 0.0f;
            for (int64_t t = 0; t < T; t++) {
                const float p = s[t] / sum, *vt = vg + t * hd;
#pragma omp simd
                for (int64_t d = 0; d < hd; d++) og[d] += p * vt[d];
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}

#include "step.c" /* the decoding step, compiled in each variant with the kernels above */

#include "quants.c" /* GGUF's blocks: their products, compiled in each variant too */

#include "llama_step.c" /* Llama's decoding step, over the products above */

/* GGUF's quantised blocks (kernels.h lmhead_block_*): products y = W·x (+ bias) for rows of x (a decoding
   step's few, a prompt's many), W held as the file's own blocks and never dequantised whole. Two arithmetics:

   - lmhead_q8_0_matvec, Q8_0 weights with x float32 unrounded: each block's 32 products summed in
     float32 and scaled by its d, the dequantised matrix's product up to float32 rounding (also
     lmhead_gguf_matvec's for Q8_0 unrounded: one Q8_0 product, not two).
   - lmhead_gguf_matvec, Q4_0, Q8_0, Q4_K and Q6_K weights with llama.cpp's arithmetic: each row of x
     rounded per block to 8 bits (a Q8_0 block with a float scale for Q4_0 and Q8_0 weights, a Q8_K
     super-block with its sums of 16 for Q4_K and Q6_K), integer dot products per block (maddubs, or
     vpdpbusd where AVX-512 VNNI is there), each block's integer sum scaled in float32. A prompt's rows of
     x (more than a step's) against Q4_K and Q6_K take kq_row where AVX-512 VNNI is there: the same
     integer sums, each super-block unpacked once for 16 rows of x.

   Ported from llama.cpp (MIT licence, Copyright (c) 2023-2024 The ggml authors): the rounding of x from
   ggml/src/ggml-quants.c (nearest_int, quantize_row_q8_0_ref, quantize_row_q8_K_ref); the portable dots
   from ggml/src/ggml-cpu/quants.c (ggml_vec_dot_{q4_0_q8_0,q8_0_q8_0,q4_K_q8_K,q6_K_q8_K}_generic, their
   integer sums regrouped); the AVX2 dots from ggml/src/ggml-cpu/arch/x86/quants.c (the same functions'
   __AVX2__ branches and their helpers mul_sum_i8_pairs_float, bytes_from_nibbles_32, hsum_float_8,
   get_scale_shuffle_k4, get_scale_shuffle). Every integer sum is exact (no maddubs pair can saturate:
   |q| <= 63 against |a| <= 127), so the variants differ only in the order of the float32 sums.
   Included by kernels.c, once per variant. */

static inline float f16_to_f32(uint16_t h) { /* IEEE half to float, exactly (subnormals, inf, NaN kept) */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    float out;
    if (e == 0) {
        out = (float)mant * (1.0f / 16777216.0f); /* mant · 2^-24, exact */
        memcpy(&bits, &out, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((e + 112u) << 23) | (mant << 13);
    }
    memcpy(&out, &bits, 4);
    return out;
#endif
}

/* The rows of W shared by OpenMP's guided schedule: each thread takes a share of the rows left, halving
   as they run out, down to GGUF_PIECE rows, so that the threads read long runs of W and still end
   together when the machine slows one. 16-row pieces taken in turn read a cold Q4_K matrix at 17 GB/s on
   2 threads, no faster than one (each thread's reads broken every 18 KB); measured in one process on
   the AVX-512 EPYC host, a Q4_K_M step of TinyLlama's sizes took 18.3-20.6 ms guided, 18.5-20.7 static,
   19.4-20.0 in 512-row pieces, 22.0-22.6 in pieces of a quarter of the rows (a slow thread's last piece
   waited for), 22.6-22.7 in 64-row pieces. */
#define GGUF_PIECE 64

/* ---- Q8_0 with float activations ------------------------------------------------------------------- */

/* y[m, n] = Σ_b d(n, b) · Σ_i q(n, b, i) · x[m, 32b + i] (+ bias[n]): W (N, K) as Q8_0 blocks, x (M, K)
   float32, unrounded (the dequantised matrix's product, summed block by block). Rows of W in parallel. */
int LMHEAD_VARIANT(lmhead_q8_0_matvec)(const lmhead_block_q8_0 *w, const float *x, const float *bias, float *y,
                                       int64_t N, int64_t K, int64_t M, int threads) {
    const int64_t nb = K / LMHEAD_QK8_0;
#pragma omp parallel for num_threads(threads) schedule(guided, GGUF_PIECE)
    for (int64_t n = 0; n < N; n++) {
        const lmhead_block_q8_0 *row = w + n * nb;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.0f;
#if LANES
            vf a = vzero();
            for (int64_t b = 0; b < nb; b++) {
                vf s = vzero();
                for (int i = 0; i < LMHEAD_QK8_0; i += LANES) s = vfma(vi8(row[b].qs + i), vload(xm + b * LMHEAD_QK8_0 + i), s);
                a = vfma(vbroadcast(f16_to_f32(row[b].d)), s, a);
            }
            acc = vsum(a);
#else
            for (int64_t b = 0; b < nb; b++) {
                float s = 0.0f;
                for (int i = 0; i < LMHEAD_QK8_0; i++) s += (float)row[b].qs[i] * xm[b * LMHEAD_QK8_0 + i];
                acc += f16_to_f32(row[b].d) * s;
            }
#endif
            y[m * N + n] = acc + (bias ? bias[n] : 0.0f);
        }
    }
    return 0;
}

/* ---- x rounded per block (ggml-quants.c) ------------------------------------------------------------ */

static inline int nearest_int(float v) { /* round half to even, for |v| <= 4194303 (ggml's) */
    float t = v + 12582912.f;
    int i;
    memcpy(&i, &t, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

static inline int finite_abs(float v, float *a) { /* *a = |v|; 0 for NaN or infinity */
    *a = fabsf(v);
    return *a <= 3.4028234663852886e38f;
}

#if defined(__AVX512F__)
/* 16 values of x: |x| folded into *amax; 0 where one is NaN or infinite. */
static inline int amax16(const float *x, __m512 *amax) {
    const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x));
    *amax = _mm512_max_ps(*amax, v);
    return !_mm512_cmp_ps_mask(v, _mm512_set1_ps(3.4028234663852886e38f), _CMP_NLE_UQ);
}
/* 16 values of x times s, rounded half to even (the rounding mode's default, as nearest_int), at most
   127, stored as int8; their sum returned. */
static inline int round16(const float *x, float s, int8_t *q) {
    const __m512i v = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_set1_ps(s), _mm512_loadu_ps(x))),
                                       _mm512_set1_epi32(127));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(v));
    return _mm512_reduce_add_epi32(v);
}
#endif

/* x (K) as Q8_0 blocks with float scales, as quantize_row_q8_0_ref (but d not rounded to a half, and q
   rounded half to even as its AVX2 twin); 0 if x is not finite. */
static int act_q8_0(const float *x, int64_t K, lmhead_block_q8_0f *a) {
#if defined(__AVX512F__) /* the same figures, 16 values a step (a step's activations were rounded one by one) */
    for (int64_t b = 0; b < K / LMHEAD_QK8_0; b++, x += LMHEAD_QK8_0) {
        __m512 m = _mm512_setzero_ps();
        if (!amax16(x, &m) || !amax16(x + 16, &m)) return 0;
        const float d = _mm512_reduce_max_ps(m) / 127.0f, id = d ? 1.0f / d : 0.0f;
        a[b].d = d;
        round16(x, id, a[b].qs), round16(x + 16, id, a[b].qs + 16);
    }
    return 1;
#else
    for (int64_t b = 0; b < K / LMHEAD_QK8_0; b++, x += LMHEAD_QK8_0) {
        float amax = 0.0f, v;
        for (int j = 0; j < LMHEAD_QK8_0; j++) {
            if (!finite_abs(x[j], &v)) return 0;
            amax = v > amax ? v : amax;
        }
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        a[b].d = d;
        for (int j = 0; j < LMHEAD_QK8_0; j++) a[b].qs[j] = (int8_t)nearest_int(x[j] * id);
    }
    return 1;
#endif
}

/* x (K) as Q8_K super-blocks, as quantize_row_q8_K_ref; 0 if x is not finite. */
static int act_q8_K(const float *x, int64_t K, lmhead_block_q8_K *a) {
#if defined(__AVX512F__) /* the same figures, 16 values (one of bsums' groups) a step: one by one, a call took 3.7 µs more at
                            K = 2,048 and 10.2 µs more at 5,632 (about 0.5 ms of a TinyLlama-shaped Q4_K_M token) */
    for (int64_t b = 0; b < K / LMHEAD_QK_K; b++, x += LMHEAD_QK_K) {
        __m512 m = _mm512_setzero_ps();
        for (int j = 0; j < LMHEAD_QK_K; j += 16)
            if (!amax16(x + j, &m)) return 0;
        const float amax = _mm512_reduce_max_ps(m);
        if (!amax) {
            memset(&a[b], 0, sizeof a[b]);
            continue;
        }
        float max = 0.0f; /* the first value of the largest magnitude, with its sign (the scalar loop's) */
        for (int j = 0; j < LMHEAD_QK_K; j += 16) {
            const __mmask16 at = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
            if (at) {
                max = x[j + __builtin_ctz(at)];
                break;
            }
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < LMHEAD_QK_K; j += 16) a[b].bsums[j / 16] = (int16_t)round16(x + j, iscale, a[b].qs + j);
        a[b].d = 1 / iscale;
    }
    return 1;
#else
    for (int64_t b = 0; b < K / LMHEAD_QK_K; b++, x += LMHEAD_QK_K) {
        float amax = 0.0f, max = 0.0f, v;
        for (int j = 0; j < LMHEAD_QK_K; j++) {
            if (!finite_abs(x[j], &v)) return 0;
            if (v > amax) amax = v, max = x[j];
        }
        memset(a[b].bsums, 0, sizeof a[b].bsums);
        if (!amax) {
            a[b].d = 0.0f;
            memset(a[b].qs, 0, sizeof a[b].qs);
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < LMHEAD_QK_K; j++) {
            int q = nearest_int(iscale * x[j]);
            a[b].qs[j] = (int8_t)(q < 127 ? q : 127);
            a[b].bsums[j / 16] += a[b].qs[j];
        }
        a[b].d = 1 / iscale;
    }
    return 1;
#endif
}

/* ---- the dots: one row of W (nb blocks) against one row of rounded x ------------------------------- */

/* With AVX-512 VNNI a prompt's rows of x take kq_row below for the K-quants (a super-block unpacked once
   for 16 rows of x); a step's few rows, and every row elsewhere, dot_q4_K and dot_q6_K, one row of x at
   a time (at one row, kq_row's 512-bit unpacking cost a cold 5,632 × 2,048 Q4_K product 259-279 µs
   against 222-234, measured alternately in one process). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KQ_VNNI 1
#else
#define KQ_VNNI 0
#endif

#if defined(__AVX2__)
static inline __m256 mul_sum_us8_pairs_float(const __m256i ax, const __m256i sy) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(ax, sy)));
#endif
}
static inline __m256 mul_sum_i8_pairs_float(const __m256i x, const __m256i y) {
    return mul_sum_us8_pairs_float(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}
static inline float hsum_float_8(const __m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
static inline __m256i bytes_from_nibbles_32(const uint8_t *p) { /* low nibbles, then high nibbles */
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set1_epi8(0xF), _mm256_insertf128_si256(_mm256_castsi128_si256(t),
                                                                          _mm_srli_epi16(t, 4), 1));
}
static const uint8_t k4_shuffle[256] = { /* get_scale_shuffle_k4: scale 2i, 2i + 1 to 16 lanes */
    0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
    2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
    4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5,
    6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7,
    8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9,
    10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11,
    12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13,
    14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15};
static const uint8_t k6_shuffle[128] = { /* get_scale_shuffle: scale i to 8 lanes of 16 bits */
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7,
    8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11,
    12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15};
#endif

/* Q8_0 or (four_bit) Q4_0 weights against Q8_0 rows of x: one block of 32 at a time, its integer sum
   scaled by both blocks' d (ggml_vec_dot_q8_0_q8_0, ggml_vec_dot_q4_0_q8_0). */
static inline __attribute__((always_inline)) float dot_32(const void *vw, const void *va, int64_t nb,
                                                          const int four_bit) {
    const lmhead_block_q8_0 *w8 = vw;
    const lmhead_block_q4_0 *w4 = vw;
    const lmhead_block_q8_0f *a = va;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256 d = _mm256_set1_ps(f16_to_f32(four_bit ? w4[b].d : w8[b].d) * a[b].d);
        const __m256i qw = four_bit ? _mm256_sub_epi8(bytes_from_nibbles_32(w4[b].qs), _mm256_set1_epi8(8))
                                    : _mm256_loadu_si256((const __m256i *)w8[b].qs);
        acc = _mm256_fmadd_ps(d, mul_sum_i8_pairs_float(qw, _mm256_loadu_si256((const __m256i *)a[b].qs)), acc);
    }
    return hsum_float_8(acc);
#else
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t s = 0;
        for (int j = 0; j < LMHEAD_QK8_0 / 2; j++) {
            const int lo = four_bit ? (w4[b].qs[j] & 0x0F) - 8 : w8[b].qs[j];
            const int hi = four_bit ? (w4[b].qs[j] >> 4) - 8 : w8[b].qs[j + LMHEAD_QK8_0 / 2];
            s += lo * a[b].qs[j] + hi * a[b].qs[j + LMHEAD_QK8_0 / 2];
        }
        sum += (float)s * (f16_to_f32(four_bit ? w4[b].d : w8[b].d) * a[b].d);
    }
    return sum;
#endif
}
static float dot_q8_0(const void *vw, const void *va, int64_t nb) { return dot_32(vw, va, nb, 0); }
static float dot_q4_0(const void *vw, const void *va, int64_t nb) { return dot_32(vw, va, nb, 1); }

/* Q4_K's 6-bit scales and mins unpacked: bytes 0..7 the scales, 8..15 the mins (ggml's utmp steps). */
static inline void q4_K_scales(const uint8_t *packed, uint32_t utmp[4]) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    memcpy(utmp, packed, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
}

static float dot_q4_K(const void *vw, const void *va, int64_t nb) {
    const lmhead_block_q4_K *w = vw;
    const lmhead_block_q8_K *a = va;
    uint32_t utmp[4];
#if defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps();
    __m128 acc_m = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const float d = a[i].d * f16_to_f32(w[i].d), dmin = -a[i].d * f16_to_f32(w[i].dmin);
        q4_K_scales(w[i].scales, utmp);
        const uint8_t *q4 = w[i].qs;
        const int8_t *q8 = a[i].qs;
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
        const __m256i q8sums = _mm256_loadu_si256((const __m256i *)a[i].bsums);
        const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
        const __m128i prod = _mm_madd_epi16(_mm256_extracti128_si256(mins_and_scales, 1), q8s);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);
        const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
        const __m256i scales = _mm256_insertf128_si256(_mm256_castsi128_si256(sc128), sc128, 1);
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < LMHEAD_QK_K / 64; j++) {
            const __m256i scale_l = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)k4_shuffle + 2 * j));
            const __m256i scale_h = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)k4_shuffle + 2 * j + 1));
            const __m256i q4bits = _mm256_loadu_si256((const __m256i *)q4);
            q4 += 32;
            const __m256i q4l = _mm256_and_si256(q4bits, m4), q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
            const __m256i q8l = _mm256_loadu_si256((const __m256i *)q8), q8h = _mm256_loadu_si256((const __m256i *)(q8 + 32));
            q8 += 64;
            const __m256i p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, q8l));
            const __m256i p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, q8h));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    return hsum_float_8(acc) + _mm_cvtss_f32(acc_m);
#else
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        q4_K_scales(w[i].scales, utmp);
        const uint8_t *scales = (const uint8_t *)utmp, *mins = scales + 8, *q4 = w[i].qs;
        const int8_t *q8 = a[i].qs;
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < LMHEAD_QK_K / 64; j++, q4 += 32, q8 += 64) {
            int32_t lo = 0, hi = 0;
            for (int l = 0; l < 32; l++) lo += (q4[l] & 0xF) * q8[l], hi += (q4[l] >> 4) * q8[l + 32];
            sumi += scales[2 * j] * lo + scales[2 * j + 1] * hi;
        }
        for (int j = 0; j < LMHEAD_QK_K / 16; j++) summ += a[i].bsums[j] * mins[j / 2];
        sum += f16_to_f32(w[i].d) * a[i].d * (float)sumi - f16_to_f32(w[i].dmin) * a[i].d * (float)summ;
    }
    return sum;
#endif
}

static float dot_q6_K(const void *vw, const void *va, int64_t nb) {
    const lmhead_block_q6_K *w = vw;
    const lmhead_block_q8_K *a = va;
#if defined(__AVX2__)
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const float d = a[i].d * f16_to_f32(w[i].d);
        const uint8_t *q4 = w[i].ql, *qh = w[i].qh;
        const int8_t *q8 = a[i].qs;
        const __m256i q8sums = _mm256_loadu_si256((const __m256i *)a[i].bsums);
        const __m128i scales = _mm_loadu_si128((const __m128i *)w[i].scales);
        const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, _mm256_cvtepi8_epi16(scales)), 5);
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0, is = 0; j < LMHEAD_QK_K / 128; j++, is += 4) {
            const __m256i q4bits1 = _mm256_loadu_si256((const __m256i *)q4);
            const __m256i q4bits2 = _mm256_loadu_si256((const __m256i *)(q4 + 32));
            const __m256i q4bitsH = _mm256_loadu_si256((const __m256i *)qh);
            q4 += 64, qh += 32;
            const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
            const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
            const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
            const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
            const __m256i q4_0 = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
            const __m256i q4_1 = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
            const __m256i q4_2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
            const __m256i q4_3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);
            __m256i p16_0 = _mm256_maddubs_epi16(q4_0, _mm256_loadu_si256((const __m256i *)q8));
            __m256i p16_1 = _mm256_maddubs_epi16(q4_1, _mm256_loadu_si256((const __m256i *)(q8 + 32)));
            __m256i p16_2 = _mm256_maddubs_epi16(q4_2, _mm256_loadu_si256((const __m256i *)(q8 + 64)));
            __m256i p16_3 = _mm256_maddubs_epi16(q4_3, _mm256_loadu_si256((const __m256i *)(q8 + 96)));
            q8 += 128;
            const __m128i *shuffle = (const __m128i *)k6_shuffle + is;
            p16_0 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, _mm_loadu_si128(shuffle + 0))), p16_0);
            p16_1 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, _mm_loadu_si128(shuffle + 1))), p16_1);
            p16_2 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, _mm_loadu_si128(shuffle + 2))), p16_2);
            p16_3 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, _mm_loadu_si128(shuffle + 3))), p16_3);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16_0, p16_1));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16_2, p16_3));
        }
        sumi = _mm256_sub_epi32(sumi, q8sclsub);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_float_8(acc);
#else
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *ql = w[i].ql, *qh = w[i].qh;
        const int8_t *sc = w[i].scales, *q8 = a[i].qs;
        int32_t sumi = 0;
        for (int n = 0; n < LMHEAD_QK_K; n += 128, ql += 64, qh += 32, sc += 8, q8 += 128) {
            int32_t s[8] = {0};
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                s[is + 0] += (((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32) * q8[l];
                s[is + 2] += (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32) * q8[l + 32];
                s[is + 4] += (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * q8[l + 64];
                s[is + 6] += (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * q8[l + 96];
            }
            for (int k = 0; k < 8; k++) sumi += sc[k] * s[k];
        }
        sum += f16_to_f32(w[i].d) * a[i].d * (float)sumi;
    }
    return sum;
#endif
}

#if defined(__AVX2__)
/* dot_q4_K and dot_q6_K (ggml's AVX2 dots) for 2 to LMHEAD_GGUF_MAX_ROWS rows of x at once: each
   super-block of W's row unpacked once (its values and scales in registers, or L1 where 16 registers do
   not hold them), then each row of x takes the same integer sums and the same float32 operations in the
   same order, so each row's figure is the bits the one-row dot gives it (tests/test_gguf_kernels.py).
   A step's one row keeps the dot itself, which interleaves unpacking and sums and was 7-13% faster at one
   row. out[m · stride] = the row · a_m + bias. (`asum` is kq_row's, unused here.) */
static inline __attribute__((always_inline)) void k_dots(const char *row, const lmhead_block_q8_K *a,
                                                         const float *asum, int64_t nb, int64_t mt, float *out,
                                                         int64_t stride, float bias, const int six) {
    (void)asum;
    __m256 acc[LMHEAD_GGUF_MAX_ROWS];
    __m128 acc_m[LMHEAD_GGUF_MAX_ROWS];
    for (int64_t m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps(), acc_m[m] = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        __m256i q[8], sc[8], per16 = _mm256_setzero_si256(); /* Q6_K: its scales widened, for q − 32 */
        __m128i mins = _mm_setzero_si128();
        float wd, wdmin = 0.0f;
        if (six) {
            const lmhead_block_q6_K *w = (const lmhead_block_q6_K *)row + i;
            const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
            const uint8_t *q4 = w->ql, *qh = w->qh;
            const __m128i scales = _mm_loadu_si128((const __m128i *)w->scales);
            per16 = _mm256_cvtepi8_epi16(scales);
            for (int j = 0, is = 0; j < LMHEAD_QK_K / 128; j++, is += 4, q4 += 64, qh += 32) {
                const __m256i q4bits1 = _mm256_loadu_si256((const __m256i *)q4);
                const __m256i q4bits2 = _mm256_loadu_si256((const __m256i *)(q4 + 32));
                const __m256i q4bitsH = _mm256_loadu_si256((const __m256i *)qh);
                const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
                const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
                const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
                const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
                q[4 * j + 0] = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
                q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
                q[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
                q[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);
                const __m128i *shuffle = (const __m128i *)k6_shuffle + is;
                for (int k = 0; k < 4; k++)
                    sc[4 * j + k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, _mm_loadu_si128(shuffle + k)));
            }
            wd = f16_to_f32(w->d);
        } else {
            const lmhead_block_q4_K *w = (const lmhead_block_q4_K *)row + i;
            const __m256i m4 = _mm256_set1_epi8(0xF);
            uint32_t utmp[4];
            q4_K_scales(w->scales, utmp);
            const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
            mins = _mm256_extracti128_si256(mins_and_scales, 1);
            const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
            const __m256i scales = _mm256_insertf128_si256(_mm256_castsi128_si256(sc128), sc128, 1);
            for (int j = 0; j < LMHEAD_QK_K / 64; j++) { /* low nibbles against x's 32, then the high */
                const __m256i q4bits = _mm256_loadu_si256((const __m256i *)(w->qs + 32 * j));
                q[2 * j] = _mm256_and_si256(q4bits, m4), q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
                sc[2 * j] = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)k4_shuffle + 2 * j));
                sc[2 * j + 1] = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)k4_shuffle + 2 * j + 1));
            }
            wd = f16_to_f32(w->d), wdmin = f16_to_f32(w->dmin);
        }
        for (int64_t m = 0; m < mt; m++) {
            const lmhead_block_q8_K *am = a + m * nb + i;
            const int8_t *q8 = am->qs;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)am->bsums);
            __m256i sumi = _mm256_setzero_si256();
            if (six) {
                for (int j = 0; j < 2; j++) {
                    __m256i p[4];
                    for (int k = 0; k < 4; k++)
                        p[k] = _mm256_madd_epi16(sc[4 * j + k], _mm256_maddubs_epi16(q[4 * j + k],
                                                 _mm256_loadu_si256((const __m256i *)(q8 + 128 * j + 32 * k))));
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
                }
                sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(q8sums, per16), 5));
            } else {
                const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
                acc_m[m] = _mm_fmadd_ps(_mm_set1_ps(-am->d * wdmin), _mm_cvtepi32_ps(_mm_madd_epi16(mins, q8s)), acc_m[m]);
                for (int j = 0; j < 4; j++) {
                    const __m256i p16l = _mm256_madd_epi16(sc[2 * j], _mm256_maddubs_epi16(q[2 * j], _mm256_loadu_si256((const __m256i *)(q8 + 64 * j))));
                    const __m256i p16h = _mm256_madd_epi16(sc[2 * j + 1], _mm256_maddubs_epi16(q[2 * j + 1], _mm256_loadu_si256((const __m256i *)(q8 + 64 * j + 32))));
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
                }
            }
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(am->d * wd), _mm256_cvtepi32_ps(sumi), acc[m]);
        }
    }
    for (int64_t m = 0; m < mt; m++) {
        float r = hsum_float_8(acc[m]);
        if (!six) {
            __m128 am = acc_m[m];
            am = _mm_add_ps(am, _mm_movehl_ps(am, am));
            am = _mm_add_ss(am, _mm_movehdup_ps(am));
            r += _mm_cvtss_f32(am);
        }
        out[m * stride] = r + bias;
    }
}
#endif

/* ---- K-quants with AVX-512 VNNI: a row's super-block unpacked once for every row of x ------------- */

#if KQ_VNNI
/* The 16-bit scale lanes that _mm512_packs_epi32 of two dpbusd sums meets: a 128-bit lane L of the pack
   holds 4 sums of the first operand's lanes 4L..4L+3, then 4 of the second's. Q4_K: a sum's lanes 0-7
   are sub-block 2j's, 8-15 sub-block 2j + 1's (the low nibbles, then the high); Q6_K: lanes 4i..4i+3
   are sub-block 4k + i's. Indices into the scales widened to 16 bits. */
#define KQ_LANE(p, first, second) ((p) % 8 < 4 ? (first) : (second))
#define KQ_PICK32(P, j) P(0, j), P(1, j), P(2, j), P(3, j), P(4, j), P(5, j), P(6, j), P(7, j), P(8, j), P(9, j),  \
                        P(10, j), P(11, j), P(12, j), P(13, j), P(14, j), P(15, j), P(16, j), P(17, j), P(18, j), \
                        P(19, j), P(20, j), P(21, j), P(22, j), P(23, j), P(24, j), P(25, j), P(26, j), P(27, j), \
                        P(28, j), P(29, j), P(30, j), P(31, j)
#define Q4P(p, j) KQ_LANE(p, 2 * (j) + (p) / 16, 2 * (j) + 2 + (p) / 16)
#define Q6P(p, k) KQ_LANE(p, 4 * (k) + (p) / 8, 4 * (k) + 4 + (p) / 8)
static const int16_t q4_K_pick[2][32] = {{KQ_PICK32(Q4P, 0)}, {KQ_PICK32(Q4P, 2)}};
static const int16_t q6_K_pick[2][32] = {{KQ_PICK32(Q6P, 0)}, {KQ_PICK32(Q6P, 2)}};
static const int16_t q4_K_mins_pick[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};

/* One super-block of a row of W unpacked: its 256 values as 4 × 64 unsigned bytes in order, its scales in
   the 16-bit lanes where kq_row's packs put each sub-block's sums, Q4_K's dmin · m for each 16 of x
   (`mins`), Q6_K's scales for each 16 (`per16`), d. */
typedef struct {
    __m512i q[4], s01, s23;
    __m256i per16;
    __m512 mins;
    float d;
} kq_block;

static inline __attribute__((always_inline)) void kq_unpack(const void *row, int64_t b, const int six, kq_block *u) {
    if (six) {
        const lmhead_block_q6_K *w = (const lmhead_block_q6_K *)row + b;
        const __m512i lo4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30), lo2 = _mm512_set1_epi8(0x03);
        for (int n = 0; n < 2; n++) { /* values 128n + 0..63, then 128n + 64..127 */
            const __m512i l = _mm512_loadu_si512(w->ql + 64 * n);
            const __m256i h = _mm256_loadu_si256((const __m256i *)(w->qh + 32 * n));
            const __m512i h2 = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
            u->q[2 * n] = _mm512_or_si512(_mm512_and_si512(l, lo4), _mm512_slli_epi16(_mm512_and_si512(h2, lo2), 4));
            u->q[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), lo4), _mm512_and_si512(h2, hi2));
        }
        u->per16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w->scales));
        u->s01 = _mm512_permutexvar_epi16(_mm512_loadu_si512(q6_K_pick[0]), _mm512_castsi256_si512(u->per16));
        u->s23 = _mm512_permutexvar_epi16(_mm512_loadu_si512(q6_K_pick[1]), _mm512_castsi256_si512(u->per16));
        u->mins = _mm512_setzero_ps();
        u->d = f16_to_f32(w->d);
    } else {
        const lmhead_block_q4_K *w = (const lmhead_block_q4_K *)row + b;
        const __m256i m4 = _mm256_set1_epi8(0xF);
        uint32_t utmp[4];
        q4_K_scales(w->scales, utmp);
        for (int j = 0; j < 4; j++) { /* values 64j + 0..31 (low nibbles), then 64j + 32..63 (high) */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w->qs + 32 * j));
            u->q[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m4)),
                                         _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 1);
        }
        const __m256i sm = _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0])); /* scales, mins */
        u->s01 = _mm512_permutexvar_epi16(_mm512_loadu_si512(q4_K_pick[0]), _mm512_castsi256_si512(sm));
        u->s23 = _mm512_permutexvar_epi16(_mm512_loadu_si512(q4_K_pick[1]), _mm512_castsi256_si512(sm));
        const __m256i m16 = _mm256_permutexvar_epi16(_mm256_loadu_si256((const __m256i *)q4_K_mins_pick), sm);
        u->mins = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(w->dmin)), _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(m16)));
        u->per16 = _mm256_setzero_si256();
        u->d = f16_to_f32(w->d);
    }
}

/* out[m · stride] = row · a_m (+ bias) for one row of W as Q4_K or (six) Q6_K blocks and mt ≤
   LMHEAD_GGUF_MAX_ROWS rows of x rounded to Q8_K (`a`, nb blocks a row; `asum`, each block's d · bsums as
   float32, K / 16 a row): each super-block unpacked once for the mt rows. Q4_K's mins, Σ_g dmin · m_g ·
   d_a · Σ a over each 16, are one float32 product of 16 lanes per super-block, into the same sums; Q6_K's
   q − 32 is taken off in integers. The float32 sums run in the same order whatever mt is, so a row of x
   gets the same bits in any tile (a prompt's last is short). Not ported: ggml's own prompt kernels for
   these types work on rows repacked at load (repack.cpp), which lmhead does not do. Two rows of W
   sharing each row of x's loads were no faster (Q4_K 126-132 against 125-132 GMAC/s at M = 512, slower
   at M = 4: measured alternately in one process on the AVX-512 EPYC host). */
static inline __attribute__((always_inline)) void kq_row(const char *row, const lmhead_block_q8_K *a,
                                                         const float *asum, int64_t nb, int64_t mt, float *out,
                                                         int64_t stride, float bias, const int six) {
    __m512 acc[LMHEAD_GGUF_MAX_ROWS];
    for (int64_t m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    const __m512i z = _mm512_setzero_si512();
    for (int64_t b = 0; b < nb; b++) {
        kq_block u;
        kq_unpack(row, b, six, &u);
        for (int64_t m = 0; m < mt; m++) {
            const lmhead_block_q8_K *am = a + m * nb + b;
            const __m512i d0 = _mm512_dpbusd_epi32(z, u.q[0], _mm512_loadu_si512(am->qs));
            const __m512i d1 = _mm512_dpbusd_epi32(z, u.q[1], _mm512_loadu_si512(am->qs + 64));
            const __m512i d2 = _mm512_dpbusd_epi32(z, u.q[2], _mm512_loadu_si512(am->qs + 128));
            const __m512i d3 = _mm512_dpbusd_epi32(z, u.q[3], _mm512_loadu_si512(am->qs + 192));
            /* each sum of 4 products is at most 4 · 63 · 127: exact in the 16 bits the pack leaves */
            __m512i sumi = _mm512_add_epi32(_mm512_madd_epi16(_mm512_packs_epi32(d0, d1), u.s01),
                                            _mm512_madd_epi16(_mm512_packs_epi32(d2, d3), u.s23));
            if (six) { /* q − 32: 32 · Σ_j sc_j · Σ a over sub-block j taken off */
                const __m256i per = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)am->bsums), u.per16);
                sumi = _mm512_sub_epi32(sumi, _mm512_zextsi256_si512(_mm256_slli_epi32(per, 5)));
            } else { /* the mins */
                acc[m] = _mm512_fnmadd_ps(u.mins, _mm512_loadu_ps(asum + m * nb * 16 + b * 16), acc[m]);
            }
            acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(am->d * u.d), _mm512_cvtepi32_ps(sumi), acc[m]);
        }
    }
    for (int64_t m = 0; m < mt; m++) out[m * stride] = _mm512_reduce_add_ps(acc[m]) + bias;
}
#endif

/* ---- x unrounded: each block's small integers q widened to float32 -------------------------------- */

/* One block of W as small integers q with a scale and an offset per sub-block of `sub` values:
   w_i = scale_j · q_i − min_j, as ggml's dequantize_row_* computes them. */
static void unpack_q4_0(const void *blk, int8_t *q, float *scale, float *min) {
    const lmhead_block_q4_0 *b = blk;
#if defined(__AVX2__) /* one 32-byte store, which the loads that follow take whole from the store buffer */
    _mm256_storeu_si256((__m256i *)q, bytes_from_nibbles_32(b->qs));
#else
    for (int j = 0; j < LMHEAD_QK8_0 / 2; j++) q[j] = (int8_t)(b->qs[j] & 0xF), q[j + LMHEAD_QK8_0 / 2] = (int8_t)(b->qs[j] >> 4);
#endif
    scale[0] = f16_to_f32(b->d), min[0] = 8.0f * scale[0];
}

static void unpack_q4_K(const void *blk, int8_t *q, float *scale, float *min) {
    const lmhead_block_q4_K *b = blk;
    uint32_t utmp[4];
    q4_K_scales(b->scales, utmp);
    const uint8_t *sc = (const uint8_t *)utmp, *m = sc + 8;
    const float d = f16_to_f32(b->d), dmin = f16_to_f32(b->dmin);
    for (int j = 0; j < LMHEAD_QK_K / 64; j++) {
#if defined(__AVX2__) /* whole 32-byte stores, which the loads that follow take from the store buffer */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * j)), m4 = _mm256_set1_epi8(0xF);
        _mm256_storeu_si256((__m256i *)(q + 64 * j), _mm256_and_si256(v, m4));
        _mm256_storeu_si256((__m256i *)(q + 64 * j + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
#else
        for (int l = 0; l < 32; l++)
            q[64 * j + l] = (int8_t)(b->qs[32 * j + l] & 0xF), q[64 * j + 32 + l] = (int8_t)(b->qs[32 * j + l] >> 4);
#endif
        scale[2 * j] = d * sc[2 * j], min[2 * j] = dmin * m[2 * j];
        scale[2 * j + 1] = d * sc[2 * j + 1], min[2 * j + 1] = dmin * m[2 * j + 1];
    }
}

static void unpack_q6_K(const void *blk, int8_t *q, float *scale, float *min) {
    const lmhead_block_q6_K *b = blk;
    const float d = f16_to_f32(b->d);
    for (int n = 0; n < LMHEAD_QK_K / 128; n++) {
        const uint8_t *ql = b->ql + 64 * n, *qh = b->qh + 32 * n;
        int8_t *y = q + 128 * n;
        for (int l = 0; l < 32; l++) {
            y[l] = (int8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
            y[l + 32] = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
            y[l + 64] = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            y[l + 96] = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
    }
    for (int k = 0; k < LMHEAD_QK_K / 16; k++) scale[k] = d * b->scales[k], min[k] = 32.0f * scale[k];
}

/* out[m] = Σ_b Σ_j scale_j · (Σ_i q_i · x[m, i]) − min_j · Σ_i x[m, i] over one row of W (nb blocks of
   `values`, sub-blocks of `sub`), for M rows of x, with xsum (M, K / sub) the sums of x per sub-block:
   the dequantised row's product, each block unpacked once for all M rows. */
static inline __attribute__((always_inline)) void float_row(
        void (*unpack)(const void *, int8_t *, float *, float *), const char *row, int64_t wbytes, int64_t nb,
        const int values, const int sub, const float *x, const float *xsum, const int64_t M, int64_t K, float *out,
        int64_t stride) { /* inlined with the type's unpack, `values` and `sub` constants (FLOAT_ROWS) */
    int8_t q[LMHEAD_QK_K];
    float scale[LMHEAD_QK_K / 16], min[LMHEAD_QK_K / 16], macc[LMHEAD_GGUF_MAX_ROWS];
    const int subs = values / sub;
#if LANES
    vf acc[LMHEAD_GGUF_MAX_ROWS];
    for (int64_t m = 0; m < M; m++) acc[m] = vzero(), macc[m] = 0.0f;
#else
    float acc[LMHEAD_GGUF_MAX_ROWS];
    for (int64_t m = 0; m < M; m++) acc[m] = 0.0f, macc[m] = 0.0f;
#endif
#if LANES
    float qf[LMHEAD_QK_K]; /* more than one row of x: the block's integers widened once, for every row */
#endif
    for (int64_t b = 0; b < nb; b++) {
        unpack(row + b * wbytes, q, scale, min);
#if LANES
        if (M > 1)
            for (int i = 0; i < values; i += LANES) vstore(qf + i, vi8(q + i));
#endif
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K + b * values, *xs = xsum + m * (K / sub) + b * subs;
            for (int j = 0; j < subs; j++) {
#if LANES /* the same sums in the same order whichever the number of rows: the same bits */
                vf s = vzero();
                if (M > 1)
                    for (int i = 0; i < sub; i += LANES) s = vfma(vload(qf + j * sub + i), vload(xm + j * sub + i), s);
                else
                    for (int i = 0; i < sub; i += LANES) s = vfma(vi8(q + j * sub + i), vload(xm + j * sub + i), s);
                acc[m] = vfma(vbroadcast(scale[j]), s, acc[m]);
#else
                float s = 0.0f;
                for (int i = 0; i < sub; i++) s += (float)q[j * sub + i] * xm[j * sub + i];
                acc[m] += scale[j] * s;
#endif
                macc[m] += min[j] * xs[j];
            }
        }
    }
    for (int64_t m = 0; m < M; m++)
#if LANES
        out[m * stride] = vsum(acc[m]) - macc[m];
#else
        out[m * stride] = acc[m] - macc[m];
#endif
}

/* ---- the product --------------------------------------------------------------------------------- */

/* Rows of x taken together (a prompt's, in tiles of LMHEAD_GGUF_MAX_ROWS), and rows of W a thread takes
   in turn for every tile: a tile's rounded x (at most 16 × 6.6 KB at K = 5,632) and the block of W's rows
   (16 rows, at most 50 KB at K = 5,632 for Q4_K) stay in L2 while every pairing of them is summed. */
#define GGUF_ROW_BLOCK 16

#define FLOAT_ROWS(UNPACK, VALUES, SUB)                                                                   \
    _Pragma("omp parallel for num_threads(threads) schedule(guided, GGUF_PIECE)")                     \
    for (int64_t n = 0; n < N; n++) {                                                                     \
        if (M == 1)                                                                                       \
            float_row(UNPACK, W + n * nb * wbytes, wbytes, nb, VALUES, SUB, x, xsum, 1, K, y + n, N);     \
        else                                                                                              \
            float_row(UNPACK, W + n * nb * wbytes, wbytes, nb, VALUES, SUB, x, xsum, M, K, y + n, N);     \
        if (bias)                                                                                         \
            for (int64_t m = 0; m < M; m++) y[m * N + n] += bias[n];                                      \
    }

/* R rows of W (row_bytes apart) against mt rows of rounded x, each pairing alone through a type's dot. */
#define DOT_ROWS(NAME, DOT, ABYTES)                                                                       \
    static void NAME(const char *row, int64_t row_bytes, int64_t R, const void *a, const float *asum,      \
                     int64_t nb, int64_t mt, float *out, int64_t stride, const float *bias) {             \
        (void)asum;                                                                                       \
        for (int64_t r = 0; r < R; r++)                                                                   \
            for (int64_t m = 0; m < mt; m++)                                                              \
                out[r + m * stride] = DOT(row + r * row_bytes, (const char *)a + m * nb * ABYTES, nb) + (bias ? bias[r] : 0.0f); \
    }
DOT_ROWS(q4_0_dots, dot_q4_0, (int64_t)sizeof(lmhead_block_q8_0f))
DOT_ROWS(q8_0_dots, dot_q8_0, (int64_t)sizeof(lmhead_block_q8_0f))
#if defined(__AVX2__)
/* One row of W against mt rows of x: one row of x through the dot, more through k_dots (the same bits). */
static inline __attribute__((always_inline)) void k_row(const char *row, const lmhead_block_q8_K *a,
                                                        const float *asum, int64_t nb, int64_t mt, float *out,
                                                        int64_t stride, float bias, const int six) {
    if (mt == 1)
        out[0] = (six ? dot_q6_K(row, a, nb) : dot_q4_K(row, a, nb)) + bias;
    else
        k_dots(row, a, asum, nb, mt, out, stride, bias, six);
}
/* R rows of W, row_bytes apart, one at a time through a K-quant's ROW (k_row, kq_row). */
#define ROWS_OF(NAME, ROW, SIX)                                                                           \
    static void NAME(const char *row, int64_t row_bytes, int64_t R, const void *a, const float *asum,      \
                     int64_t nb, int64_t mt, float *out, int64_t stride, const float *bias) {             \
        for (int64_t r = 0; r < R; r++)                                                                   \
            ROW(row + r * row_bytes, a, asum, nb, mt, out + r, stride, bias ? bias[r] : 0.0f, SIX);      \
    }
ROWS_OF(q4_K_dots, k_row, 0)
ROWS_OF(q6_K_dots, k_row, 1)
#else
DOT_ROWS(q4_K_dots, dot_q4_K, (int64_t)sizeof(lmhead_block_q8_K))
DOT_ROWS(q6_K_dots, dot_q6_K, (int64_t)sizeof(lmhead_block_q8_K))
#endif
#if KQ_VNNI /* a prompt's rows of x */
ROWS_OF(q4_K_rows, kq_row, 0)
ROWS_OF(q6_K_rows, kq_row, 1)
#else /* a prompt's rows through the same as a step's */
#define q4_K_rows q4_K_dots
#define q6_K_rows q6_K_dots
#endif

/* Every row of x rounded (`act`, nb blocks of abytes a row) against every row of W: blocks of
   GGUF_ROW_BLOCK rows of W shared by the guided schedule (at least GGUF_PIECE rows a take), each block
   against each tile of x in turn. ROWS is inlined, one loop per type. */
#define GGUF_ROWS(ROWS)                                                                                   \
    _Pragma("omp parallel for num_threads(threads) schedule(guided, GGUF_PIECE / GGUF_ROW_BLOCK)")    \
    for (int64_t r0 = 0; r0 < N; r0 += GGUF_ROW_BLOCK)                                                    \
        for (int64_t m0 = 0; m0 < M; m0 += LMHEAD_GGUF_MAX_ROWS)                                          \
            ROWS(W + r0 * row_bytes, row_bytes, N - r0 < GGUF_ROW_BLOCK ? N - r0 : GGUF_ROW_BLOCK,          \
                 act + m0 * nb * abytes, asum ? asum + m0 * (K / 16) : NULL, nb,                            \
                 M - m0 < LMHEAD_GGUF_MAX_ROWS ? M - m0 : LMHEAD_GGUF_MAX_ROWS, y + m0 * N + r0, N,       \
                 bias ? bias + r0 : NULL);

/* The bytes of one block of `type`, and its values: 0 for a type these kernels do not take. */
static int64_t block_bytes(int type, int *values) {
    *values = type == LMHEAD_TYPE_Q4_K || type == LMHEAD_TYPE_Q6_K ? LMHEAD_QK_K : LMHEAD_QK8_0;
    switch (type) {
    case LMHEAD_TYPE_Q4_0: return sizeof(lmhead_block_q4_0);
    case LMHEAD_TYPE_Q8_0: return sizeof(lmhead_block_q8_0);
    case LMHEAD_TYPE_Q4_K: return sizeof(lmhead_block_q4_K);
    case LMHEAD_TYPE_Q6_K: return sizeof(lmhead_block_q6_K);
    default: return 0;
    }
}

int LMHEAD_VARIANT(lmhead_gguf_matvec)(int type, int rounded, const void *w, int64_t row_bytes, const float *x,
                                       const float *bias, float *y, int64_t N, int64_t K, int64_t M, int threads) {
    int values;
    const int64_t wbytes = block_bytes(type, &values); /* bytes per weight block */
    const int kquant = values == LMHEAD_QK_K, sub = type == LMHEAD_TYPE_Q6_K ? 16 : LMHEAD_QK8_0;
    if (!wbytes || K <= 0 || K % values || M < 1 || N < 0 || row_bytes != K / values * wbytes) return -2;
    const int64_t nb = K / values;
    const char *W = w;
    if (!rounded && type == LMHEAD_TYPE_Q8_0) /* Q8_0 unrounded: its one product, above */
        return LMHEAD_VARIANT(lmhead_q8_0_matvec)(w, x, bias, y, N, K, M, threads);
    if (!rounded) { /* x unrounded: the sums of x per sub-block, then each row of W unpacked once for a tile of x */
        if (M > LMHEAD_GGUF_MAX_ROWS) { /* tile by tile (y's rows N apart, whichever the tile) */
            for (int64_t m0 = 0; m0 < M; m0 += LMHEAD_GGUF_MAX_ROWS) {
                const int64_t mt = M - m0 < LMHEAD_GGUF_MAX_ROWS ? M - m0 : LMHEAD_GGUF_MAX_ROWS;
                const int status = LMHEAD_VARIANT(lmhead_gguf_matvec)(type, 0, w, row_bytes, x + m0 * K, bias,
                                                                      y + m0 * N, N, K, mt, threads);
                if (status) return status;
            }
            return 0;
        }
        float *xsum = malloc((size_t)(M * (K / sub)) * sizeof(float));
        if (!xsum) return -1;
        for (int64_t i = 0; i < M * (K / sub); i++) {
            float t = 0.0f;
            for (int l = 0; l < sub; l++) t += x[i * sub + l];
            xsum[i] = t;
        }
        switch (type) { /* one loop per type, its unpacking inlined, one row of x a constant */
        case LMHEAD_TYPE_Q4_0: FLOAT_ROWS(unpack_q4_0, LMHEAD_QK8_0, LMHEAD_QK8_0); break;
        case LMHEAD_TYPE_Q4_K: FLOAT_ROWS(unpack_q4_K, LMHEAD_QK_K, 32); break;
        default: FLOAT_ROWS(unpack_q6_K, LMHEAD_QK_K, 16); break;
        }
        free(xsum);
        return 0;
    }
    const int64_t abytes = kquant ? (int64_t)sizeof(lmhead_block_q8_K) : (int64_t)sizeof(lmhead_block_q8_0f);
    char *act = malloc((size_t)(M * nb * abytes));
    if (!act) return -1;
    /* kq_row's d · bsums per 16 of x, only where it runs (a prompt's K-quant rows, with VNNI) */
    const int prompt = M > LMHEAD_GGUF_MAX_ROWS, sums = KQ_VNNI && kquant && prompt;
    float *asum = sums ? malloc((size_t)(M * (K / 16)) * sizeof(float)) : NULL;
    if (sums && !asum) {
        free(act);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) {
        int ok = kquant ? act_q8_K(x + m * K, K, (lmhead_block_q8_K *)(act + m * nb * abytes))
                        : act_q8_0(x + m * K, K, (lmhead_block_q8_0f *)(act + m * nb * abytes));
        if (!ok) {
            free(act), free(asum);
            return 1;
        }
        for (int64_t b = 0; sums && b < nb; b++) {
            const lmhead_block_q8_K *ab = (const lmhead_block_q8_K *)(act + (m * nb + b) * abytes);
            for (int g = 0; g < LMHEAD_QK_K / 16; g++) asum[m * (K / 16) + b * 16 + g] = ab->d * (float)ab->bsums[g];
        }
    }
    /* one loop per type, its rows inlined; the K-quants' a prompt's rows (more than a step's) through
       kq_row where it is built: the same integer sums, in float32 in another order */
    switch (type) {
    case LMHEAD_TYPE_Q4_0: GGUF_ROWS(q4_0_dots); break;
    case LMHEAD_TYPE_Q8_0: GGUF_ROWS(q8_0_dots); break;
    case LMHEAD_TYPE_Q4_K:
        if (prompt) { GGUF_ROWS(q4_K_rows) } else { GGUF_ROWS(q4_K_dots) }
        break;
    default:
        if (prompt) { GGUF_ROWS(q6_K_rows) } else { GGUF_ROWS(q6_K_dots) }
        break;
    }
    free(act), free(asum);
    return 0;
}

/* ---- dequantised rows ------------------------------------------------------------------------------ */

/* out (rows, K) float32 = W's rows as GGUF blocks of `type`, each value as ggml's dequantize_row_* and
   gguf-py's numpy port compute it (the same float32 operations in the same order: the same bits): Q8_0
   d · q, Q4_0 d · (q − 8), Q4_K (d · sc) · q − (dmin · m), Q6_K (d · sc) · (q − 32). Rows in parallel
   where there are many. 0 done, -2 a type or shape it does not take. */
int LMHEAD_VARIANT(lmhead_gguf_dequantise)(int type, const void *w, int64_t row_bytes, float *out, int64_t rows,
                                           int64_t K, int threads) {
    int values;
    const int64_t wbytes = block_bytes(type, &values);
    if (!wbytes || K <= 0 || K % values || rows < 0 || row_bytes != K / values * wbytes) return -2;
    const int64_t nb = K / values;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * K >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)w + r * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            float *o = out + r * K + b * values;
            const char *blk = row + b * wbytes;
            if (type == LMHEAD_TYPE_Q8_0 || type == LMHEAD_TYPE_Q4_0) {
                int8_t q[LMHEAD_QK8_0];
                float d;
                if (type == LMHEAD_TYPE_Q8_0) {
                    const lmhead_block_q8_0 *bl = (const lmhead_block_q8_0 *)blk;
                    memcpy(q, bl->qs, sizeof q), d = f16_to_f32(bl->d);
                } else {
                    const lmhead_block_q4_0 *bl = (const lmhead_block_q4_0 *)blk;
                    for (int j = 0; j < LMHEAD_QK8_0 / 2; j++)
                        q[j] = (int8_t)((bl->qs[j] & 0xF) - 8), q[j + LMHEAD_QK8_0 / 2] = (int8_t)((bl->qs[j] >> 4) - 8);
                    d = f16_to_f32(bl->d);
                }
                for (int i = 0; i < LMHEAD_QK8_0; i++) o[i] = d * (float)q[i];
            } else if (type == LMHEAD_TYPE_Q4_K) {
                int8_t q[LMHEAD_QK_K];
                float scale[LMHEAD_QK_K / 16], min[LMHEAD_QK_K / 16];
                unpack_q4_K(blk, q, scale, min); /* scale d · sc, min dmin · m, per 32 */
                for (int i = 0; i < LMHEAD_QK_K; i++) o[i] = scale[i / 32] * (float)q[i] - min[i / 32];
            } else {
                int8_t q[LMHEAD_QK_K];
                float scale[LMHEAD_QK_K / 16], min[LMHEAD_QK_K / 16];
                unpack_q6_K(blk, q, scale, min); /* scale d · sc per 16, q 0..63 */
                for (int i = 0; i < LMHEAD_QK_K; i++) o[i] = scale[i / 16] * (float)(q[i] - 32);
            }
        }
    }
    return 0;
}

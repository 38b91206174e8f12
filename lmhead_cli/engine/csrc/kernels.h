/* lmhead's compiled interface, declared once: the constants, structures and functions that module.c,
   kernels.c and step.c define and that engine/kernels.py calls through ctypes.

   The compiler holds each definition to its declaration here (kernels.c includes this file, once per
   variant); engine/kernels.py reads LMHEAD_KERNELS_ABI, LMHEAD_STEP_MAX_ROWS and the step's kinds from
   this file (shipped in the package) and refuses a module that reports another ABI; and
   tests/test_kernels.py parses this file and compares it with kernels.py's ctypes argument types,
   return types and structure fields (names, types, order), so that a mismatch fails a test instead of
   crashing the process. */
#ifndef LMHEAD_KERNELS_H
#define LMHEAD_KERNELS_H

#include <stdint.h>

#define LMHEAD_KERNELS_ABI 22 /* raised when a signature, a structure or a name below changes */
#define LMHEAD_MAX_ROWS 4 /* the most rows of x the int8 and bfloat16 products take (kernels.c's MAX_ROWS) */
#define LMHEAD_F32_MAX_ROWS 16 /* the most rows lmhead_f32_matvec takes (more than 4 in one pass of the rows) */
#define LMHEAD_GGUF_MAX_ROWS 16 /* the rows of x lmhead_gguf_matvec takes together (a decoding step's; more in tiles of this) */
#define LMHEAD_STEP_MAX_ROWS 16 /* the most rows × positions of a compiled step (lmhead_step), rows of lmhead_f32_kn_matvec */

/* x86-64 with GCC: a variant per instruction-set level (variant_*.c), best first; elsewhere (another
   architecture, or a compiler without GCC's target pragma) the portable C variant alone. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LMHEAD_X86_VARIANTS 1
#else
#define LMHEAD_X86_VARIANTS 0
#endif

/* The weights' kind of a compiled step (lmhead_layer, lmhead_model `kind`). */
enum { LMHEAD_STEP_F32 = 0, LMHEAD_STEP_BF16 = 1, LMHEAD_STEP_INT8 = 2 };

/* One block's weights, as engine/step.py lays them out (kernels.Layer). For LMHEAD_STEP_F32 w[i] is
   float32 (K, N) and the biases and norm parameters float32; for LMHEAD_STEP_BF16 w[i] is bfloat16
   (N, K) rows and the biases and norm parameters bfloat16; for LMHEAD_STEP_INT8 w[i] is int8 (N, K)
   rows with s[i] (N) float32 scales, and everything else float32. Products in order: c_attn,
   attn.c_proj, c_fc, mlp.c_proj. */
typedef struct {
    const void *w[4];
    const float *s[4];
    const void *b[4];
    const void *ln1_w, *ln1_b, *ln2_w, *ln2_b;
} lmhead_layer;

/* The model's pointers, as engine/step.py lays them out (kernels.Model): `layers` (L blocks), the
   embeddings wte (V, D) (float32, bfloat16, or int8 rows with wte_s (V) scales) and wpe (n_pos, D)
   (float32, or bfloat16 for LMHEAD_STEP_BF16), ln_f's parameters, and the head's rows (V, D) in the
   weights' kind (int8 with head_s): E's, when tied. */
typedef struct {
    const lmhead_layer *layers;
    int64_t L, D, H, inner, V, n_pos;
    int kind;
    float eps;
    const void *wte, *wpe, *lnf_w, *lnf_b, *head;
    const float *wte_s, *head_s;
} lmhead_model;

/* GGUF's block layouts (llama.cpp's ggml-common.h, MIT licence: block_q8_0, block_q4_0, block_q4_K,
   block_q6_K, block_q8_K), declared once: engine/quant.py reads the same bytes through kernels.py's
   ctypes mirror of them, which tests/test_kernel_interface.py checks against this file (fields, and the
   compiler's offsets and sizes). The LMHEAD_TYPE_ numbers are GGML's own (gguf.GGMLQuantizationType). */
#define LMHEAD_TYPE_F32 0 /* float32 rows (a Llama step's product, lmhead_product) */
#define LMHEAD_TYPE_Q4_0 2
#define LMHEAD_TYPE_Q8_0 8
#define LMHEAD_TYPE_Q4_K 12
#define LMHEAD_TYPE_Q6_K 14
#define LMHEAD_QK8_0 32 /* values per Q8_0 and Q4_0 block */
#define LMHEAD_QK_K 256 /* values per K-quant super-block */
#define LMHEAD_K_SCALE_SIZE 12 /* Q4_K's eight 6-bit scales and eight 6-bit mins */
typedef struct {
    uint16_t d; /* the block's scale, IEEE half */
    int8_t qs[LMHEAD_QK8_0]; /* x = d · q */
} lmhead_block_q8_0;
typedef struct {
    uint16_t d; /* IEEE half */
    uint8_t qs[LMHEAD_QK8_0 / 2]; /* x[i] = d · (q − 8): the low nibbles are values 0..15, the high 16..31 */
} lmhead_block_q4_0;
typedef struct {
    uint16_t d, dmin; /* IEEE halves: the scales' and the mins' scales */
    uint8_t scales[LMHEAD_K_SCALE_SIZE]; /* 8 sub-blocks of 32: 6-bit scale sc and min m each */
    uint8_t qs[LMHEAD_QK_K / 2]; /* x = d · sc · q − dmin · m, q 4 bits */
} lmhead_block_q4_K;
typedef struct {
    uint8_t ql[LMHEAD_QK_K / 2]; /* q's low 4 bits */
    uint8_t qh[LMHEAD_QK_K / 4]; /* q's high 2 bits */
    int8_t scales[LMHEAD_QK_K / 16]; /* 16 sub-blocks of 16: x = d · sc · (q − 32) */
    uint16_t d; /* IEEE half */
} lmhead_block_q6_K;
/* Activations, rounded per block inside lmhead_gguf_matvec (they never cross the ABI): Q8_K (llama.cpp's
   block_q8_K, for Q4_K and Q6_K weights) and Q8_0 with a float scale (for Q4_0 and Q8_0 weights). */
typedef struct {
    float d; /* x ≈ d · q */
    int8_t qs[LMHEAD_QK_K];
    int16_t bsums[LMHEAD_QK_K / 16]; /* Σ q over each 16 */
} lmhead_block_q8_K;
typedef struct {
    float d;
    int8_t qs[LMHEAD_QK8_0];
} lmhead_block_q8_0f;

/* One Llama layer (kernels.LlamaLayer): products 0..6 q, k, v, o, gate, up, down, each W (N, K) as GGUF
   blocks of type[i] (LMHEAD_TYPE_*) with rows row_bytes[i] apart and x rounded[i] per block or not
   (lmhead_gguf_matvec's), or float32 rows (type LMHEAD_TYPE_F32), and b[i] (N) float32 or NULL. Where q's
   rows carry k's and v's too (stacked once, engine/llama_step.py `fuse`), w[1] and w[2] are NULL; likewise
   w[5] where gate's rows carry up's. The RMSNorms' weights (D) float32. */
typedef struct {
    const void *w[7];
    const float *b[7];
    int64_t row_bytes[7];
    int type[7], rounded[7];
    const float *norm1, *norm2;
} lmhead_llama_layer;
/* A Llama's layers and sizes (kernels.Llama): H query heads and K key heads of hd, the MLP's width, and
   RoPE's table: cos (rope_len, hd) then sin (rope_len, hd), float32, a row per position; for the whole
   step (lmhead_llama_decode), the final RMSNorm's weight (D) float32 and the head (V, D) as GGUF blocks
   of head_type, rows head_row_bytes apart, x head_rounded or not, or float32 rows (LMHEAD_TYPE_F32); and
   for a step from token ids, the token table (embed_rows, D) as GGUF blocks of embed_type, rows
   embed_row_bytes apart, or float32 rows (LMHEAD_TYPE_F32), or NULL (the caller embeds). */
typedef struct {
    const lmhead_llama_layer *layers;
    int64_t L, D, H, K, hd, inner, rope_len;
    float eps;
    const float *rope, *norm;
    const void *head;
    int64_t V, head_row_bytes;
    int head_type, head_rounded;
    const void *embed;
    int64_t embed_rows, embed_row_bytes;
    int embed_type;
} lmhead_llama;
/* The module's own functions (module.c). */
int lmhead_kernels_abi(void); /* LMHEAD_KERNELS_ABI, as this module was built */
int lmhead_release_thread_pool(void); /* 0 done, 1 no omp_pause_resource_all, -1 inside a parallel region */
int lmhead_kernels_max_rows(void); /* LMHEAD_MAX_ROWS */
int lmhead_kernels_f32_max_rows(void); /* LMHEAD_F32_MAX_ROWS */
const char *lmhead_kernels_variants(void); /* the variants built, best first, separated by spaces */
int lmhead_kernels_supports(const char *variant); /* 1 if this CPU runs `variant` */

#endif /* LMHEAD_KERNELS_H */

/* The kernels, one set per variant: each name ends in its variant's suffix (LMHEAD_VARIANT(name), e.g.
   lmhead_attend_avx2). Declared where a variant is compiled: kernels.c includes this file again after
   LMHEAD_VARIANT is defined. What each computes is written above its definition (kernels.c, step.c). */
#if defined(LMHEAD_VARIANT) && !defined(LMHEAD_KERNELS_VARIANT_DECLARED)
#define LMHEAD_KERNELS_VARIANT_DECLARED
int LMHEAD_VARIANT(lmhead_int8_matvec)(const int8_t *q, const float *s, const float *x, const float *bias, float *y,
                                       int64_t N, int64_t K, int64_t M, int threads);
int LMHEAD_VARIANT(lmhead_q8_0_matvec)(const lmhead_block_q8_0 *w, const float *x, const float *bias, float *y,
                                       int64_t N, int64_t K, int64_t M, int threads);
/* y = W·x (+ bias) for W (N, K) held as GGUF blocks of `type` (LMHEAD_TYPE_*), x (M, K) float32, any M (a
   step's few rows, or a prompt's, taken LMHEAD_GGUF_MAX_ROWS at a time), W's rows `row_bytes` apart (checked
   against K and the type's block); x `rounded` per block to 8 bits (llama.cpp's arithmetic) or not (float32
   sums): 0 done, 1 a row of x not finite when rounded (nothing written), -1 no memory, -2 a type or shape it
   does not take. */
int LMHEAD_VARIANT(lmhead_gguf_matvec)(int type, int rounded, const void *w, int64_t row_bytes, const float *x,
                                       const float *bias, float *y, int64_t N, int64_t K, int64_t M, int threads);
/* out (rows, K) float32: W's rows as GGUF blocks of `type` dequantised, the bits of ggml's dequantize_row_*:
   0 done, -2 a type or shape it does not take. */
int LMHEAD_VARIANT(lmhead_gguf_dequantise)(int type, const void *w, int64_t row_bytes, float *out, int64_t rows,
                                           int64_t K, int threads);
int LMHEAD_VARIANT(lmhead_bf16_matvec)(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y,
                                       int64_t N, int64_t K, int64_t M, int threads);
int LMHEAD_VARIANT(lmhead_f32_matvec)(const float *w, const float *x, const float *bias, float *y, int64_t N,
                                      int64_t K, int64_t M, int threads);
int LMHEAD_VARIANT(lmhead_f32_kn_matvec)(const float *W, const float *x, const float *bias, float *y, int64_t K,
                                         int64_t N, int64_t M, int threads);
int64_t LMHEAD_VARIANT(lmhead_score_rows)(const float *z, const int64_t *ids, int64_t N, int64_t V, float *logprob,
                                          int64_t *rank, float *entropy, int64_t *top_id, float *top_logprob,
                                          float *varentropy, float *margin, int strict, int threads);
int LMHEAD_VARIANT(lmhead_attend)(const float *q, int64_t qsb, int64_t qsh, const float *k, const float *v,
                                  int64_t ksb, int64_t ksh, const float *mask, int64_t msb, float *out, int64_t B,
                                  int64_t H, int64_t T, int64_t hd, float scale, int threads);
int LMHEAD_VARIANT(lmhead_step)(const lmhead_layer *layers, int64_t L, int kind, float *x, int64_t B, int64_t T,
                                int64_t D, int64_t H, int64_t inner, float eps, float *kc, float *vc, int64_t csl,
                                int64_t csb, int64_t csh, int64_t past, const float *mask, int64_t msb, int threads);
int LMHEAD_VARIANT(lmhead_llama_step)(const lmhead_llama *m, float *x, int64_t B, const int64_t *pos, float *kc,
                                      float *vc, int64_t csl, int64_t csb, int64_t csh, int64_t past,
                                      const float *mask, int64_t msb, int threads);
int LMHEAD_VARIANT(lmhead_llama_decode)(const lmhead_llama *m, float *x, const int64_t *ids, int64_t B,
                                        const int64_t *pos, float *kc, float *vc, int64_t csl, int64_t csb,
                                        int64_t csh, int64_t past, const float *mask, int64_t msb, float *logits,
                                        int64_t *top_id, float *top, int threads);
int LMHEAD_VARIANT(lmhead_decode)(const lmhead_model *m, const int64_t *ids, const int64_t *pos, int64_t B,
                                  float *kc, float *vc, int64_t csl, int64_t csb, int64_t csh, int64_t past,
                                  const float *mask, int64_t msb, float *logits, int64_t *top_id, float *top,
                                  int threads);
int LMHEAD_VARIANT(lmhead_greedy_run)(const void *m, int llama, int64_t id, int64_t n, int64_t eos, float *kc,
                                      float *vc, int64_t csl, int64_t csb, int64_t csh, int64_t past,
                                      float *logits, int64_t *top_id, float *top, int threads);
#endif

/* ---- Llama's decoding step: every layer of a Llama-family model for a few rows of one new position ----

   Included at the end of kernels.c, after quants.c, so each variant compiles it with its own vector width
   and its GGUF products. For B rows (B <= STEP_MAX_ROWS) of one new position each, layer by layer:

       h = rms_norm(x) * w1;  q, k, v = h · Wq, Wk, Wv (+ biases);  q and k turned by RoPE at each row's
       position;  k, v -> the KV cache at `past`;  a = attention(q, cache[0 .. past], mask), query head j
       reading key head j / G (G = H / K);  x = x + a · Wo;  h = rms_norm(x) * w2;
       x = x + (silu(h · Wgate) ⊙ (h · Wup)) · Wdown

   What engine/llama.py's LeanLlama does in some thirty dispatched ops and Python calls a layer (at
   TinyLlama's sizes, 7 ms of a 43 ms Q4_K_M token went between the products), here in plain loops and
   the products where the engine keeps the weights (GGUF blocks, float32 rows: nothing copied). q, k and v
   (and gate and up) are one product where the engine stacked their rows (engine/llama_step.py `fuse`).
   Float32 throughout, as the torch path on the CPU; the sums in another order. */

/* y[m] = x[m] / sqrt(mean(x[m]²) + eps) * w for B rows of D (transformers' LlamaRMSNorm in float32). */
static void llama_norm(const float *x, float *y, int64_t B, int64_t D, const float *w, float eps) {
    for (int64_t m = 0; m < B; m++) {
        const float *xm = x + m * D;
        float *ym = y + m * D, ss = 0.0f;
        int64_t d = 0;
#if LANES
        vf s = vzero();
        for (; d + LANES <= D; d += LANES) s = vfma(vload(xm + d), vload(xm + d), s);
        ss = vsum(s);
#endif
        for (; d < D; d++) ss += xm[d] * xm[d];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (d = 0; d < D; d++) ym[d] = w[d] * (xm[d] * r);
    }
}

/* y (M, N) = x (M, K) · Wᵀ (+ bias), W as GGUF blocks of `type` (rows `row_bytes` apart, x `rounded` or
   not) or float32 rows (LMHEAD_TYPE_F32). 0 done; -1 no memory; -2 not taken (a type the kernels lack,
   or a row of x not finite where x is rounded). */
static int llama_times(int type, int rounded, const void *w, int64_t row_bytes, const float *bias, const float *x,
                       float *y, int64_t M, int64_t K, int64_t N, int threads) {
    if (type == LMHEAD_TYPE_F32)
        return LMHEAD_VARIANT(lmhead_f32_matvec)((const float *)w, x, bias, y, N, K, M, threads) ? -2 : 0;
    int status = LMHEAD_VARIANT(lmhead_gguf_matvec)(type, rounded, w, row_bytes, x, bias, y, N, K, M, threads);
    return status == 0 ? 0 : status == -1 ? -1 : -2;
}

/* Product i of a layer (llama_times over its fields). */
static int llama_product(const lmhead_llama_layer *l, int i, const float *x, float *y, int64_t M, int64_t K,
                         int64_t N, int threads) {
    return llama_times(l->type[i], l->rounded[i], l->w[i], l->row_bytes[i], l->b[i], x, y, M, K, N, threads);
}

/* Products first .. first + n - 1 of one input x (M, K), their outputs side by side in y (M, Σ N): one
   product where w[first + 1] is NULL (the first holds every part's rows), else each into `tmp` and its
   columns copied across. */
static int llama_products(const lmhead_llama_layer *l, int first, int n, const int64_t *N, const float *x, float *y,
                          int64_t M, int64_t K, float *tmp, int threads) {
    int64_t total = 0, at = 0;
    for (int i = 0; i < n; i++) total += N[i];
    if (!l->w[first + 1]) return llama_product(l, first, x, y, M, K, total, threads);
    for (int i = 0; i < n; i++, at += N[i - 1]) {
        int status = llama_product(l, first + i, x, M == 1 ? y + at : tmp, M, K, N[i], threads);
        if (status) return status;
        for (int64_t m = 0; M > 1 && m < M; m++) memcpy(y + m * total + at, tmp + m * N[i], (size_t)N[i] * sizeof(float));
    }
    return 0;
}

/* RoPE on one head v (hd): rotate_half's pairs (i, i + hd/2), as transformers' apply_rotary_pos_emb. */
static void llama_rope(float *v, const float *cos, const float *sin, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* f[m, j] = silu(g[m, j]) * u[m, j], g and u the halves of gu (M, 2 I): silu(x) = x / (1 + e^-x). */
static void llama_swiglu(const float *gu, float *f, int64_t M, int64_t I) {
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *fm = f + m * I;
        int64_t j = 0;
#if LANES
        /* sigmoid(x) = (1 + tanh(x / 2)) / 2, with step.c's vtanh (the GELU's) */
        for (; j + LANES <= I; j += LANES) {
            vf x = vload(g + j);
            vf t = vtanh(vmul(x, vbroadcast(0.5f)));
            vstore(fm + j, vmul(vmul(vmul(vbroadcast(0.5f), x), vadd(vbroadcast(1.0f), t)), vload(u + j)));
        }
#endif
        for (; j < I; j++) fm[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

static inline int64_t most(int64_t a, int64_t b) { return a > b ? a : b; }

/* x (B, D) float32, the residual stream of B rows at one new position each (row b at position pos[b], or
   `past` where pos is NULL), through the model's L layers in place. The KV cache: k, v float32 at
   k + l * csl + b * csb + h * csh + t * hd (t < past filled; position past written here). mask: an
   additive (past + 1) float32 row a row of x, msb apart, or NULL. Returns 0; -1 where a buffer could not
   be allocated; -2 for what it does not take (a size, a position past the rope table, a product's type, a
   row of x not finite where x is rounded): the cache may then be partly written at position `past`, which
   the caller's torch path writes again. */
int LMHEAD_VARIANT(lmhead_llama_step)(const lmhead_llama *m, float *x, int64_t B, const int64_t *pos, float *kc,
                                      float *vc, int64_t csl, int64_t csb, int64_t csh, int64_t past,
                                      const float *mask, int64_t msb, int threads) {
    const int64_t D = m->D, H = m->H, K = m->K, hd = m->hd, I = m->inner, Q = H * hd, KV = K * hd, W = Q + 2 * KV;
    if (B < 1 || B > STEP_MAX_ROWS || K < 1 || H % K || hd % 2 || past < 0) return -2;
    for (int64_t b = 0; b < B; b++)
        if ((pos ? pos[b] : past) < 0 || (pos ? pos[b] : past) >= m->rope_len) return -2;
    const int64_t G = H / K, widest = most(most(W, 2 * I), D);
    float *h = step_alloc(sizeof(float) * (size_t)(B * D)), *qkv = step_alloc(sizeof(float) * (size_t)(B * W)),
          *a = step_alloc(sizeof(float) * (size_t)(B * most(Q, I))), *big = step_alloc(sizeof(float) * (size_t)(B * 2 * I)),
          *tmp = step_alloc(sizeof(float) * (size_t)(B * widest));
    int status = h && qkv && a && big && tmp ? 0 : -1;
    const float scale = (float)(1.0 / sqrt((double)hd));
    for (int64_t li = 0; li < m->L && !status; li++) {
        const lmhead_llama_layer *l = m->layers + li;
        float *kl = kc + li * csl, *vl = vc + li * csl;
        const int64_t qkv_n[3] = {Q, KV, KV}, gu_n[2] = {I, I};
        llama_norm(x, h, B, D, l->norm1, m->eps);
        if ((status = llama_products(l, 0, 3, qkv_n, h, qkv, B, D, tmp, threads))) break;
        for (int64_t b = 0; b < B; b++) { /* RoPE on q's and k's heads, then k and v into the cache */
            const int64_t p = pos ? pos[b] : past;
            const float *cos = m->rope + p * hd, *sin = m->rope + (m->rope_len + p) * hd;
            float *row = qkv + b * W;
            for (int64_t j = 0; j < H + K; j++) llama_rope(row + j * hd, cos, sin, hd);
            for (int64_t j = 0; j < K; j++) {
                memcpy(kl + b * csb + j * csh + past * hd, row + Q + j * hd, (size_t)hd * sizeof(float));
                memcpy(vl + b * csb + j * csh + past * hd, row + Q + KV + j * hd, (size_t)hd * sizeof(float));
            }
        }
        /* each row's K key heads as the kernel's rows, each with its G query heads reading one key head
           (a stride of 0 between them): the keys are read once, never repeated */
        for (int64_t b = 0; b < B && !status; b++)
            if (LMHEAD_VARIANT(lmhead_attend)(qkv + b * W, G * hd, hd, kl + b * csb, vl + b * csb, csh, 0,
                                              mask ? mask + b * msb : NULL, 0, a + b * Q, K, G, past + 1, hd, scale,
                                              threads))
                status = -1;
        if (status || (status = llama_product(l, 3, a, h, B, Q, D, threads))) break;
        for (int64_t j = 0; j < B * D; j++) x[j] += h[j];
        llama_norm(x, h, B, D, l->norm2, m->eps);
        if ((status = llama_products(l, 4, 2, gu_n, h, big, B, D, tmp, threads))) break;
        llama_swiglu(big, a, B, I);
        if ((status = llama_product(l, 6, a, h, B, I, D, threads))) break;
        for (int64_t j = 0; j < B * D; j++) x[j] += h[j];
    }
    free(h), free(qkv), free(a), free(big), free(tmp);
    return status;
}

/* Rows ids (B) of the token table (m->embed) into x (B, D) float32: GGUF blocks dequantised as
   lmhead_gguf_dequantise (gguf-py's bits), float32 rows copied. -2 where there is no table or an id is
   out of range (nothing written). */
static int llama_embed(const lmhead_llama *m, const int64_t *ids, int64_t B, float *x) {
    if (!m->embed) return -2;
    for (int64_t b = 0; b < B; b++)
        if (ids[b] < 0 || ids[b] >= m->embed_rows) return -2;
    for (int64_t b = 0; b < B; b++) {
        float *row = x + b * m->D;
        if (m->embed_type == LMHEAD_TYPE_F32)
            memcpy(row, (const float *)m->embed + ids[b] * m->D, (size_t)m->D * sizeof(float));
        else if (LMHEAD_VARIANT(lmhead_gguf_dequantise)(m->embed_type, (const char *)m->embed + ids[b] * m->embed_row_bytes,
                                                         m->embed_row_bytes, row, 1, m->D, 1))
            return -2;
    }
    return 0;
}

/* The whole step: x (B, D) float32, each row's token embedding (overwritten), or with ids (B) the tokens,
   looked up in the token table here (x NULL: a buffer of the call's own; llama_embed), through
   lmhead_llama_step, the final RMSNorm and the head -> logits (B, V) float32; with top_id (B) and top
   (3, B) given, each row's greedy record too (step.c's step_record). What LeanLlama's body, final norm,
   head and the decoding loop's record did in Python and torch around the layers' call: about a
   millisecond of a 23 ms Q4_K_M token at TinyLlama's sizes; and the lookup, ~0.1 ms more between two
   steps once the step's weights have evicted Python's objects from the caches. Returns
   lmhead_llama_step's codes (-2 too for an id out of range, before anything is written), or the number of
   rows whose record a logit that is not finite spoilt (the logits are whole: the caller records them). */
int LMHEAD_VARIANT(lmhead_llama_decode)(const lmhead_llama *m, float *x, const int64_t *ids, int64_t B,
                                        const int64_t *pos, float *kc, float *vc, int64_t csl, int64_t csb,
                                        int64_t csh, int64_t past, const float *mask, int64_t msb, float *logits,
                                        int64_t *top_id, float *top, int threads) {
    if (!m->head || !m->norm || B < 1 || B > STEP_MAX_ROWS || (!x && !ids)) return -2;
    float *own = NULL;
    int status = 0;
    if (ids) {
        if (!x && !(x = own = step_alloc(sizeof(float) * (size_t)(B * m->D)))) return -1;
        status = llama_embed(m, ids, B, x);
    }
    if (!status)
        status = LMHEAD_VARIANT(lmhead_llama_step)(m, x, B, pos, kc, vc, csl, csb, csh, past, mask, msb, threads);
    float *h = status ? NULL : step_alloc(sizeof(float) * (size_t)(B * m->D));
    if (!status && !h) status = -1;
    if (!status) {
        llama_norm(x, h, B, m->D, m->norm, m->eps);
        status = llama_times(m->head_type, m->head_rounded, m->head, m->head_row_bytes, NULL, h, logits, B, m->D, m->V,
                             threads);
    }
    free(h), free(own);
    return !status && top_id ? step_record(logits, B, m->V, top_id, top, threads) : status;
}

/* One row's greedy run: up to n whole steps in one call, from token `id` at position `past`, each next
   token the top-1 of the step before (its greedy record's top_id): what a decoding loop does in n calls,
   without its Python between them (a few hundred microseconds a step once a step's weights have evicted
   the interpreter's objects from every cache). `llama`: m is an lmhead_llama (lmhead_llama_decode's
   step), else GPT-2's lmhead_model (lmhead_decode's). One row, no mask. Step i writes the cache at
   past + i, its logits to row i % 2 of logits (2, V) and its record to top_id[i] and top[3 i .. 3 i + 2]
   (the top-1's log p, the entropy, its logit). The run stops after a step whose top-1 is `eos` (-1:
   none), or whose record a logit that is not finite spoilt (top_id[i] = -1, its logits whole). Returns
   the steps run (1 .. n: a step after the first that fails ends the run before it, the cache then partly
   written at its position, past the steps run), or the first step's code (-1 no memory, -2 not taken). */
int LMHEAD_VARIANT(lmhead_greedy_run)(const void *m, int llama, int64_t id, int64_t n, int64_t eos, float *kc,
                                      float *vc, int64_t csl, int64_t csb, int64_t csh, int64_t past,
                                      float *logits, int64_t *top_id, float *top, int threads) {
    const int64_t V = llama ? ((const lmhead_llama *)m)->V : ((const lmhead_model *)m)->V;
    for (int64_t i = 0; i < n; i++) {
        const int64_t token = i ? top_id[i - 1] : id;
        float *z = logits + (i % 2) * V;
        int status = llama ? LMHEAD_VARIANT(lmhead_llama_decode)((const lmhead_llama *)m, NULL, &token, 1, NULL, kc,
                                                                 vc, csl, csb, csh, past + i, NULL, 0, z, top_id + i,
                                                                 top + 3 * i, threads)
                           : LMHEAD_VARIANT(lmhead_decode)((const lmhead_model *)m, &token, NULL, 1, kc, vc, csl,
                                                           csb, csh, past + i, NULL, 0, z, top_id + i, top + 3 * i,
                                                           threads);
        if (status < 0) return i ? (int)i : status;
        if (status > 0) top_id[i] = -1;
        if (status > 0 || top_id[i] == eos) return (int)(i + 1);
    }
    return (int)n;
}

/* A streaming read of a buffer far larger than the caches, on 1..N threads: the machine's read
 * bandwidth, the limit a decoding step that reads every weight once cannot pass.
 *
 *     cc -O3 -march=native -pthread stream_read.c -o stream_read
 *     ./stream_read MiB MAX_THREADS PASSES      -> one JSON line
 *
 * Built by benchmarks/bandwidth.py into a temporary folder when the benchmark runs (-march=native is
 * for this one measurement on this machine; nothing built here is kept or shipped). Three ways to
 * read, since which one reaches the limit depends on the machine:
 *   slices      each thread sums its own contiguous slice with 8 independent 64-byte accumulators;
 *   interleaved the threads take 1 MiB blocks in turn (the pattern a row-split matrix product reads);
 *   prefetch    slices, with a software prefetch 2 KiB ahead.
 * Each figure is the fastest of PASSES passes (other work can only slow a pass down), in GB/s of
 * bytes read (1 GB = 1e9 bytes). Each entry prints its last pass's sum of every float in the buffer, so
 * that no compiler can drop the reads and a test can check that every byte was read exactly once.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef float vec __attribute__((vector_size(64)));  /* 16 floats, one cache line */

#define BLOCK (1u << 20)  /* bytes per block for the interleaved method */

enum method { SLICES, INTERLEAVED, PREFETCH, N_METHODS };
static const char *NAMES[N_METHODS] = {"slices", "interleaved", "prefetch"};

struct job {
    const vec *base;
    size_t n_vec;      /* vectors in the whole buffer */
    int thread, threads;
    enum method method;
    pthread_barrier_t *start;
    float sum;
    double t0, t1;     /* this thread's own start and end */
};

static float sum_range(const vec *p, size_t n, int prefetch) {
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        if (prefetch) __builtin_prefetch(p + i + 32, 0, 0);
        a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
        a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
    }
    for (; i < n; i++) a0 += p[i];
    vec s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
    float out = 0;
    for (int k = 0; k < 16; k++) out += s[k];
    return out;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *worker(void *arg) {
    struct job *j = arg;
    pthread_barrier_wait(j->start);
    j->t0 = now();
    float s = 0;
    if (j->method == INTERLEAVED) {
        size_t per_block = BLOCK / sizeof(vec), blocks = (j->n_vec + per_block - 1) / per_block;
        for (size_t b = (size_t)j->thread; b < blocks; b += (size_t)j->threads) {
            size_t first = b * per_block, n = first + per_block > j->n_vec ? j->n_vec - first : per_block;
            s += sum_range(j->base + first, n, 0);
        }
    } else {
        size_t per = j->n_vec / (size_t)j->threads, first = per * (size_t)j->thread;
        size_t n = j->thread == j->threads - 1 ? j->n_vec - first : per;
        s = sum_range(j->base + first, n, j->method == PREFETCH);
    }
    j->sum = s;
    j->t1 = now();
    return NULL;
}

/* One pass: the threads start together at a barrier; timed from the first thread's start to the last
 * thread's end, each read by the thread itself (the main thread may be descheduled in between). */
static double pass(const vec *buf, size_t n_vec, int threads, enum method m, float *sum) {
    pthread_t tid[256];
    struct job jobs[256];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
    for (int t = 0; t < threads; t++) {
        jobs[t] = (struct job){buf, n_vec, t, threads, m, &start, 0, 0, 0};
        pthread_create(&tid[t], NULL, worker, &jobs[t]);
    }
    pthread_barrier_wait(&start);
    for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
    double t0 = jobs[0].t0, t1 = jobs[0].t1;
    for (int t = 0; t < threads; t++) {
        *sum += jobs[t].sum;
        if (jobs[t].t0 < t0) t0 = jobs[t].t0;
        if (jobs[t].t1 > t1) t1 = jobs[t].t1;
    }
    double dt = t1 - t0;
    pthread_barrier_destroy(&start);
    return dt;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MiB MAX_THREADS PASSES\n", argv[0]);
        return 2;
    }
    long mib = atol(argv[1]), max_threads = atol(argv[2]), passes = atol(argv[3]);
    if (mib < 1 || max_threads < 1 || max_threads > 256 || passes < 1) {
        fprintf(stderr, "stream_read: MiB >= 1, 1 <= MAX_THREADS <= 256, PASSES >= 1\n");
        return 2;
    }
    size_t bytes = (size_t)mib << 20, n_vec = bytes / sizeof(vec);
    vec *buf = aligned_alloc(4096, n_vec * sizeof(vec));
    if (!buf) {
        fprintf(stderr, "stream_read: cannot allocate %ld MiB\n", mib);
        return 1;
    }
    float *f = (float *)buf;
    for (size_t i = 0; i < n_vec * 16; i++) f[i] = (float)(i & 7);  /* every page really there */
    printf("{\"bytes\": %zu, \"passes\": %ld, \"rates\": [", n_vec * sizeof(vec), passes);
    int first = 1;
    for (int threads = 1; threads <= max_threads; threads++) {
        for (int m = 0; m < N_METHODS; m++) {
            if (threads == 1 && m == INTERLEAVED) continue;  /* the same as slices on one thread */
            double best = 1e30;
            float sum = 0;
            for (long p = 0; p < passes; p++) {
                sum = 0;
                double dt = pass(buf, n_vec, threads, (enum method)m, &sum);
                if (dt < best) best = dt;
            }
            printf("%s{\"method\": \"%s\", \"threads\": %d, \"gbs\": %.3f, \"sum\": %.1f}", first ? "" : ", ",
                   NAMES[m], threads, (double)(n_vec * sizeof(vec)) / best / 1e9, (double)sum);
            first = 0;
        }
    }
    printf("]}\n");
    free(buf);
    return 0;
}

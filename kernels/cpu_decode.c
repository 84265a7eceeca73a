/* Paged decode attention for the CPU KV pool: one query token per sequence.
 *
 * The pool is stored [block, kv_head, slot, dim] (pools/kv_cache.py), so one KV head's keys of a
 * block are one contiguous run of block_size * head_dim floats. Each (sequence, KV head) is one unit
 * of work: its group of query heads is scored against the run of every block in the table, softmaxed,
 * and the values are summed with those weights. K and V are read once, straight from the pool,
 * instead of being gathered into a padded copy first (which is what the torch path must do).
 * Slots at or past a sequence's length are never read, whatever they hold.
 *
 * Built by kernels/cpu_build.py, once per ISA variant (cpu_simd.h); the head-size loops are left to
 * the compiler's vectoriser.
 */
#include <stdlib.h>

#include "cpu_simd.h"

#define MAX_GROUP 16
#define MAX_DIM 256

/* The run (block_size x dim floats) of KV head `head` in the block holding position `start`. */
static inline const float *block_run(const float *pool, const int32_t *table, int start, int block_size,
                                     int kv_heads, int head, int64_t run) {
    return pool + ((int64_t)table[start / block_size] * kv_heads + head) * run;
}

/* The run of the sequence's next block, or NULL after the last. Its rows are prefetched one per
 * row of this block read (prefetch_row), into L2 (prefetcht2): L1's few fill buffers stay free. */
static inline const float *next_run(const float *pool, const int32_t *table, int start, int len,
                                    int block_size, int kv_heads, int head, int64_t run) {
    if (start + block_size >= len) return NULL;
    return block_run(pool, table, start + block_size, block_size, kv_heads, head, run);
}

/* Ask for row i of the next block while row i of this one is read. Spread like this, the requests
 * keep pace with the reads; the whole run asked for at once (64 lines) stalled on the full miss
 * queue, and perf put a quarter of the kernel's samples on those prefetch instructions. */
static inline void prefetch_row(const float *next, int i, int dim) {
    if (!next) return;
    for (int d = 0; d < dim; d += 16) __builtin_prefetch(next + (int64_t)i * dim + d, 0, 1);
}

static inline __attribute__((always_inline)) void attend_one(const float *q, const float *k_pool, const float *v_pool, const int32_t *table,
                       int len, float *out, int group, int kv_heads, int block_size, int dim, int head,
                       float scale, float *scores) {
    float acc[MAX_GROUP][MAX_DIM];
    float best[MAX_GROUP], total[MAX_GROUP];
    const int64_t run = (int64_t)block_size * dim;
    for (int g = 0; g < group; g++) {
        best[g] = -INFINITY;
        memset(acc[g], 0, sizeof(float) * dim);
    }
    for (int start = 0; start < len; start += block_size) {
        const float *k = block_run(k_pool, table, start, block_size, kv_heads, head, run);
        const float *next = next_run(k_pool, table, start, len, block_size, kv_heads, head, run);
        const int n = len - start < block_size ? len - start : block_size;
        for (int i = 0; i < n; i++) {
            prefetch_row(next, i, dim);
            for (int g = 0; g < group; g++) {
                const float *qg = q + (int64_t)(head * group + g) * dim;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < dim; d++) s += qg[d] * k[i * dim + d];
                s *= scale;
                scores[g * len + start + i] = s;
                if (s > best[g]) best[g] = s;
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float sum = 0.f, *sg = scores + g * len;
#pragma omp simd reduction(+ : sum)
        for (int p = 0; p < len; p++) {
            sg[p] = mm_expf(sg[p] - best[g]);
            sum += sg[p];
        }
        total[g] = sum;
    }
    for (int start = 0; start < len; start += block_size) {
        const float *v = block_run(v_pool, table, start, block_size, kv_heads, head, run);
        const float *next = next_run(v_pool, table, start, len, block_size, kv_heads, head, run);
        const int n = len - start < block_size ? len - start : block_size;
        for (int i = 0; i < n; i++) {
            prefetch_row(next, i, dim);
            for (int g = 0; g < group; g++) {
                const float p = scores[g * len + start + i];
                float *a = acc[g];
#pragma omp simd
                for (int d = 0; d < dim; d++) a[d] += p * v[i * dim + d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float *o = out + (int64_t)(head * group + g) * dim;
        for (int d = 0; d < dim; d++) o[d] = acc[g][d] / total[g];
    }
}

/* q, out: [n, heads, dim] contiguous; tables: [n, table_stride] int32; lens: [n] int32.
 * Returns 0, or -1 when a shape is beyond the fixed limits (the caller falls back). */
int paged_decode(const float *q, const float *k_pool, const float *v_pool, const int32_t *tables,
                 int64_t table_stride, const int32_t *lens, float *out, int n, int heads, int kv_heads,
                 int block_size, int dim, float scale, int max_len, int threads) {
    const int group = heads / kv_heads;
    if (group > MAX_GROUP || dim > MAX_DIM || group * kv_heads != heads) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * group * (max_len > 0 ? max_len : 1));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < n * kv_heads; w++) {
            if (!scores) continue;
            const int s = w / kv_heads, h = w % kv_heads;
            const float *qs = q + (int64_t)s * heads * dim;
            const int32_t *table = tables + s * table_stride;
            float *os = out + (int64_t)s * heads * dim;
/* The common shapes get a copy with group and head_dim as constants, so the compiler unrolls the
 * head_dim loops and keeps the accumulators in registers; anything else takes the generic copy. */
#define SPECIALISED(G, D)                                                                             \
    if (group == G && dim == D) {                                                                     \
        attend_one(qs, k_pool, v_pool, table, lens[s], os, G, kv_heads, block_size, D, h, scale, scores); \
        continue;                                                                                     \
    }
            SPECIALISED(1, 64) SPECIALISED(2, 64) SPECIALISED(3, 64) SPECIALISED(4, 64)
            SPECIALISED(5, 64) SPECIALISED(6, 64) SPECIALISED(7, 64) SPECIALISED(8, 64)
            SPECIALISED(1, 128) SPECIALISED(2, 128) SPECIALISED(3, 128) SPECIALISED(4, 128)
            SPECIALISED(5, 128) SPECIALISED(6, 128) SPECIALISED(7, 128) SPECIALISED(8, 128)
#undef SPECIALISED
            attend_one(qs, k_pool, v_pool, table, lens[s], os, group, kv_heads, block_size, dim, h, scale,
                       scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

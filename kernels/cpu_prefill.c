/* Prefill attention for the CPU: many query tokens per sequence, read straight from the KV pool.
 *
 * A sequence's new tokens sit at the end of its context: query j of a q_len-token chunk is at
 * position seq_len - q_len + j and, when causal, sees keys 0 .. that position (the cached context
 * and the chunk so far). Without `causal` every query sees every key (a vision encoder's images).
 * Two optional widenings and narrowings of the causal rule: `bidir_hi` (per query token, or NULL)
 * lets a token also see keys up to bidir_hi - 1 (its image's end: Gemma 3's image tokens see each
 * other; an image range always holds the token itself, so what a row sees stays one run of keys),
 * and `window` > 0 keeps only keys above position - window (sliding-window layers).
 *
 * K and V are addressed through a block table and three strides (block, head, slot; the head dim
 * is contiguous), so the same code reads the paged pool ([block, kv_head, slot, dim]) and a vision
 * tower's plain [image, token, head, dim] tensors (one "block" per image).
 *
 * The work: one unit per (sequence, KV head, tile of query tokens). A tile's rows are its tokens
 * times the group of query heads sharing that KV head, so every key and value read serves them all.
 *  1. Each (sequence, KV head)'s keys are first copied transposed, [dim][key] (16 x 16 tiles by
 *     vector shuffles), so that scoring a register tile of 6 rows x 64 keys is broadcast-multiply-
 *     adds with no horizontal sums.
 *  2. Scores for the keys the tile can see (causal: up to its last token), a softmax per row.
 *  3. Values: 6 rows x 64 dims of output held in registers over every key the tile sees, then
 *     stored once, normalised, straight into the output.
 * The causal triangle is skipped but for its diagonal tiles; SDPA on CPU computes it all.
 *
 * Built by kernels/cpu_build.py, once per ISA variant (cpu_simd.h): the tiles below are sized from
 * the variant's register file.
 */
#include <stdlib.h>

#include "cpu_simd.h"

/* Register tiles: 6 rows x KEY_VECS vectors of scores, 6 rows x DIM_VECS vectors of output. With
 * AVX-512's 32 registers that is 24 accumulators (on the 2-core AVX-512 EPYC, 10 images' SigLIP
 * attention, 196 tokens, 12 heads, took 9.2 ms with them against 10.3 ms with 8 x 32 score tiles;
 * smaller output tiles ran at 70-75% of the rate); with 16 registers, 12 accumulators, two loads
 * and a broadcast. */
#define SCORE_ROWS 6
#define VALUE_ROWS 6
#if WIDE_REGISTERS
#define KEY_VECS 4
#define DIM_VECS 4
#else
#define KEY_VECS 2
#define DIM_VECS 2
#endif
#define PAD_ROWS 8             /* rows past a tile's last, up to the next multiple of either tile */
#define KEYS (KEY_VECS * LANES) /* keys per score tile (the last may be fewer) */
#define DIMS (DIM_VECS * LANES) /* head dims per output tile (head sizes: any multiple of LANES) */
#define TILE_ROWS 48           /* rows (tokens x group) per unit of work */

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

typedef struct {
    const float *k, *v;
    int64_t block_stride, head_stride, slot_stride;
    const int32_t *tables;
    int64_t table_stride;
    int block_size, dim;
} kv_t;

static inline const float *kv_row(const kv_t *kv, const float *base, int seq, int head, int pos) {
    const int32_t block = kv->tables[seq * kv->table_stride + pos / kv->block_size];
    return base + block * kv->block_stride + head * kv->head_stride + (pos % kv->block_size) * kv->slot_stride;
}

#if defined(__GNUC__) && !defined(__clang__)
/* A LANES x LANES transpose in log2(LANES) butterfly stages: at stage h, rows i and i + h
 * (i & h == 0) swap their off-diagonal h x h blocks, each output one two-source shuffle
 * (vpermt2ps on AVX-512). Lane l of the first output takes a[l] or b[l - h], of the second
 * a[l + h] or b[l]. */
#define LO(h, l) (((l) & (h)) ? LANES + (l) - (h) : (l))
#define HI(h, l) (((l) & (h)) ? LANES + (l) : (l) + (h))
#if LANES == 16
#define MASK(F, h) ((ivec){F(h, 0), F(h, 1), F(h, 2), F(h, 3), F(h, 4), F(h, 5), F(h, 6), F(h, 7),       \
                           F(h, 8), F(h, 9), F(h, 10), F(h, 11), F(h, 12), F(h, 13), F(h, 14), F(h, 15)})
#elif LANES == 8
#define MASK(F, h) ((ivec){F(h, 0), F(h, 1), F(h, 2), F(h, 3), F(h, 4), F(h, 5), F(h, 6), F(h, 7)})
#else
#define MASK(F, h) ((ivec){F(h, 0), F(h, 1), F(h, 2), F(h, 3)})
#endif
#define SWAP_BLOCKS(H)                                                                          \
    for (int i = 0; i < LANES; i++)                                                             \
        if (!(i & H)) {                                                                         \
            const vec a = r[i], b = r[i + H];                                                   \
            r[i] = __builtin_shuffle(a, b, MASK(LO, H)), r[i + H] = __builtin_shuffle(a, b, MASK(HI, H)); \
        }
static inline void transpose_lanes(vec r[LANES]) {
#if LANES >= 16
    SWAP_BLOCKS(8)
#endif
#if LANES >= 8
    SWAP_BLOCKS(4)
#endif
    SWAP_BLOCKS(2)
    SWAP_BLOCKS(1)
}
#undef SWAP_BLOCKS
#define HAVE_TRANSPOSE 1
#endif

/* kt[d * kpad + j] = key j's dim d for j < len, zeros up to kpad (a multiple of LANES). */
static void transpose_keys(const kv_t *kv, int seq, int head, int len, int64_t kpad, float *kt) {
#ifdef HAVE_TRANSPOSE
    static const float zeros[LANES] = {0};
    for (int j0 = 0; j0 < kpad; j0 += LANES) {
        const float *rows[LANES];
        for (int i = 0; i < LANES; i++) rows[i] = j0 + i < len ? kv_row(kv, kv->k, seq, head, j0 + i) : NULL;
        for (int d0 = 0; d0 < kv->dim; d0 += LANES) {
            vec r[LANES];
            for (int i = 0; i < LANES; i++) r[i] = rows[i] ? load(rows[i] + d0) : load(zeros);
            transpose_lanes(r);
            for (int d = 0; d < LANES; d++) store(kt + (d0 + d) * kpad + j0, r[d]);
        }
    }
#else
    for (int j = 0; j < len; j++) {
        const float *row = kv_row(kv, kv->k, seq, head, j);
        for (int d = 0; d < kv->dim; d++) kt[d * kpad + j] = row[d];
    }
    for (int d = 0; d < kv->dim; d++) memset(kt + d * kpad + len, 0, sizeof(float) * (kpad - len));
#endif
}

/* s[r * ss + j .. j + C * LANES] = scale * q_r . those keys, for SCORE_ROWS rows: per head dim,
 * C vectors of transposed keys against a broadcast of each row. */
#define SCORE_TILE(NAME, C)                                                                              \
    static __attribute__((noinline)) void NAME(const float *const q[SCORE_ROWS], const float *kt,         \
                                               int64_t kpad, int dim, int j, float scale, float *s,       \
                                               int64_t ss) {                                              \
        vec a[SCORE_ROWS][C] = {};                                                                       \
        const float *col = kt + j;                                                                       \
        for (int d = 0; d < dim; d++, col += kpad) {                                                     \
            vec k[C];                                                                                    \
            for (int c = 0; c < C; c++) k[c] = load(col + c * LANES);                                    \
            for (int r = 0; r < SCORE_ROWS; r++) {                                                       \
                const vec x = splat(q[r][d]);                                                            \
                for (int c = 0; c < C; c++) a[r][c] += x * k[c];                                         \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < SCORE_ROWS; r++)                                                             \
            for (int c = 0; c < C; c++) store(s + r * ss + j + c * LANES, a[r][c] * scale);              \
    }
SCORE_TILE(score_tile2, 2)
SCORE_TILE(score_tile1, 1)
#if KEY_VECS == 4
SCORE_TILE(score_tile4, 4)
SCORE_TILE(score_tile3, 3)
#endif

/* Scores of SCORE_ROWS rows against keys j .. j + KEYS, fewer where the padded row ends first. */
static inline void score_tile(const float *const q[SCORE_ROWS], const float *kt, int64_t kpad, int dim, int j,
                              int64_t ss, float scale, float *s) {
    switch ((ss - j) / LANES) {
    case 1: score_tile1(q, kt, kpad, dim, j, scale, s, ss); break;
#if KEY_VECS == 4
    case 2: score_tile2(q, kt, kpad, dim, j, scale, s, ss); break;
    case 3: score_tile3(q, kt, kpad, dim, j, scale, s, ss); break;
    default: score_tile4(q, kt, kpad, dim, j, scale, s, ss);
#else
    default: score_tile2(q, kt, kpad, dim, j, scale, s, ss);
#endif
    }
}

/* Row scores -> unnormalised weights exp(s - max) over its visible keys first .. visible - 1, zeros
 * before and after them up to n_keys; returns 1 / their sum. */
static inline float softmax_row(float *s, int first, int visible, int n_keys) {
    float best = -INFINITY, sum = 0.f;
    for (int j = first; j < visible; j++) best = s[j] > best ? s[j] : best;
#pragma omp simd reduction(+ : sum)
    for (int j = first; j < visible; j++) {
        s[j] = mm_expf(s[j] - best);
        sum += s[j];
    }
    memset(s, 0, sizeof(float) * first);
    memset(s + visible, 0, sizeof(float) * (n_keys - visible));
    return 1.f / sum;
}

/* o_r[dc .. dc + C * LANES] = inv_r * sum_j w_r[j] v_j over the n_keys keys of sequence `seq`'s KV
 * head `head`, for VALUE_ROWS rows: C = DIM_VECS vectors of head dims at a time, then C = 1 for a head
 * size that is not a multiple of DIMS. The sums stay in registers over every key, block by block,
 * and are stored once, already normalised. */
#define VALUE_TILE(NAME, C)                                                                               \
    static __attribute__((noinline)) void NAME(const kv_t *kv, int seq, int head, int n_keys, const float *w, \
                                               int64_t ws, int dc, float *const o[VALUE_ROWS],             \
                                               const float *inv) {                                        \
        vec a[VALUE_ROWS][C] = {};                                                                        \
        for (int start = 0, run; start < n_keys; start += run) {                                          \
            run = kv->block_size - start % kv->block_size;                                                \
            run = n_keys - start < run ? n_keys - start : run;                                            \
            const float *v = kv_row(kv, kv->v, seq, head, start) + dc, *wj = w + start;                   \
            for (int j = 0; j < run; j++, v += kv->slot_stride) {                                         \
                vec x[C];                                                                                 \
                for (int c = 0; c < C; c++) x[c] = load(v + c * LANES);                                   \
                for (int r = 0; r < VALUE_ROWS; r++) {                                                    \
                    const vec p = splat(wj[r * ws + j]);                                                  \
                    for (int c = 0; c < C; c++) a[r][c] += p * x[c];                                      \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < VALUE_ROWS; r++)                                                              \
            for (int c = 0; c < C; c++) store(o[r] + dc + c * LANES, a[r][c] * inv[r]);                   \
    }
VALUE_TILE(value_tile, DIM_VECS)
VALUE_TILE(value_tile_narrow, 1)

typedef struct {
    kv_t kv;
    const float *q;
    int64_t q_token_stride, q_head_stride;
    const int32_t *q_starts, *q_lens, *seq_lens;
    float *out;
    int heads, group, tile_tokens, causal;
    float scale;
    const int64_t *bidir_hi; /* per query token: it also sees keys below this (NULL: none) */
    int window;              /* > 0: keys above position - window only */
} job_t;

/* One unit: query tokens t0 .. t0 + tile_tokens of sequence i against KV head h, its keys already
 * transposed in kt. Scratch: s for the tile's scores (rows x keys), a row the padding rows' output
 * goes to. */
static void attend_tile(const job_t *job, int i, int h, int t0, const float *kt, float *s, float *scratch,
                        const float *zeros) {
    const int group = job->group, dim = job->kv.dim;
    const int q_len = job->q_lens[i], seq_len = job->seq_lens[i];
    const int tn = q_len - t0 < job->tile_tokens ? q_len - t0 : job->tile_tokens;
    const int first_pos = seq_len - q_len + t0, rows = tn * group;
    const int score_rows = (int)round_up(rows, SCORE_ROWS), value_rows = (int)round_up(rows, VALUE_ROWS);
    const int rows_up = score_rows > value_rows ? score_rows : value_rows;
    int n_keys = job->causal ? first_pos + tn : seq_len; /* what the tile's last token sees */
    if (job->bidir_hi)                                   /* ... or any of its image tokens */
        for (int t = 0; t < tn; t++) {
            const int64_t hi = job->bidir_hi[job->q_starts[i] + t0 + t];
            n_keys = hi > n_keys ? (int)(hi < seq_len ? hi : seq_len) : n_keys;
        }
    const int64_t kpad = round_up(seq_len, LANES), ss = round_up(n_keys, LANES);
    float inv[TILE_ROWS + PAD_ROWS];
    /* Row r is token t0 + r / group, query head h * group + r % group (padding rows read zeros).
     * Keys outer, rows inner: a run of transposed keys is read from L1 by every row. */
    const float *qr[TILE_ROWS + PAD_ROWS];
    for (int row = 0; row < rows_up; row++) {
        const int tok = job->q_starts[i] + t0 + row / group, head = h * group + row % group;
        qr[row] = row < rows ? job->q + tok * job->q_token_stride + head * job->q_head_stride : zeros;
    }
    for (int j = 0; j < n_keys; j += KEYS)
        for (int r0 = 0; r0 < score_rows; r0 += SCORE_ROWS) score_tile(qr + r0, kt, kpad, dim, j, ss, job->scale, s + r0 * ss);
    for (int row = 0; row < rows_up; row++) {
        const int pos = first_pos + row / group;
        int visible = row >= rows ? 0 : job->causal ? pos + 1 : n_keys, first = 0;
        if (row < rows && job->bidir_hi) {
            const int64_t hi = job->bidir_hi[job->q_starts[i] + t0 + row / group];
            visible = hi > visible ? (int)(hi < n_keys ? hi : n_keys) : visible;
        }
        if (row < rows && job->window > 0 && pos - job->window + 1 > 0) first = pos - job->window + 1;
        inv[row] = row < rows ? softmax_row(s + row * ss, first, visible, n_keys) : 0.f;
        if (row >= rows) memset(s + row * ss, 0, sizeof(float) * n_keys);
    }
    /* Values: each group of VALUE_ROWS rows written straight to its output rows (a padding row to
     * scratch). */
    for (int r0 = 0; r0 < value_rows; r0 += VALUE_ROWS) {
        float *o[VALUE_ROWS];
        for (int r = 0; r < VALUE_ROWS; r++) {
            const int row = r0 + r, tok = job->q_starts[i] + t0 + row / group, head = h * group + row % group;
            o[r] = row < rows ? job->out + ((int64_t)tok * job->heads + head) * dim : scratch;
        }
        for (int dc = 0; dc < dim;) {
            const float *w = s + r0 * ss;
            if (dim - dc >= DIMS) {
                value_tile(&job->kv, i, h, n_keys, w, ss, dc, o, inv + r0);
                dc += DIMS;
            } else {
                value_tile_narrow(&job->kv, i, h, n_keys, w, ss, dc, o, inv + r0);
                dc += LANES;
            }
        }
    }
}

/* q: rows at q + token * q_token_stride + head * q_head_stride (dim contiguous); out: [tokens,
 * heads, dim] contiguous. Sequence i's q_lens[i] query tokens start at token q_starts[i].
 * Returns 0, or -1 when a shape is beyond what this kernel handles (the caller falls back). */
int paged_prefill(const float *q, int64_t q_token_stride, int64_t q_head_stride, const float *k,
                  const float *v, int64_t block_stride, int64_t head_stride, int64_t slot_stride,
                  const int32_t *tables, int64_t table_stride, const int32_t *q_starts,
                  const int32_t *q_lens, const int32_t *seq_lens, int n, float *out, int heads,
                  int kv_heads, int block_size, int dim, float scale, int causal, const int64_t *bidir_hi,
                  int window, int threads) {
    const int group = heads / kv_heads;
    /* Head sizes that are multiples of 16 on every variant (all of 64, 80, 96, 128, 256), so that
     * what the kernel takes does not depend on the CPU. */
    if (group * kv_heads != heads || group > TILE_ROWS || dim % 16) return -1;
    const job_t job = {
        {k, v, block_stride, head_stride, slot_stride, tables, table_stride, block_size, dim},
        q, q_token_stride, q_head_stride, q_starts, q_lens, seq_lens, out,
        heads, group, TILE_ROWS / group, causal, scale, bidir_hi, window,
    };
    const int tile_rows = job.tile_tokens * group + PAD_ROWS;
    /* Where each sequence's transposed keys go, and the units of work: (sequence, tile) pairs. */
    int64_t *kt_at = malloc(sizeof(int64_t) * (n + 1));
    int *unit_seq = NULL, *unit_tile = NULL, units = 0, kpad_max = LANES;
    if (!kt_at) return -1;
    kt_at[0] = 0;
    for (int i = 0; i < n; i++) {
        const int64_t kpad = round_up(seq_lens[i], LANES);
        kt_at[i + 1] = kt_at[i] + kpad * dim * kv_heads;
        kpad_max = kpad > kpad_max ? (int)kpad : kpad_max;
        units += (q_lens[i] + job.tile_tokens - 1) / job.tile_tokens;
    }
    float *kt = malloc(sizeof(float) * (kt_at[n] > 0 ? kt_at[n] : 1));
    unit_seq = malloc(sizeof(int) * (units + 1));
    unit_tile = malloc(sizeof(int) * (units + 1));
    int failed = !kt || !unit_seq || !unit_tile;
    for (int i = 0, u = 0; !failed && i < n; i++)
        for (int t = 0; t * job.tile_tokens < q_lens[i]; t++, u++) unit_seq[u] = i, unit_tile[u] = t;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(dynamic, 1)
            for (int w = 0; w < n * kv_heads; w++) {
                const int i = w / kv_heads, h = w % kv_heads;
                const int64_t kpad = round_up(seq_lens[i], LANES);
                transpose_keys(&job.kv, i, h, seq_lens[i], kpad, kt + kt_at[i] + h * kpad * dim);
            }
            float *s = malloc(sizeof(float) * ((int64_t)tile_rows * kpad_max + 2 * dim));
            float *scratch = NULL, *zeros = NULL; /* after the scores: a scratch row, a zero row */
            if (!s) {
#pragma omp atomic write
                failed = 1;
            } else {
                scratch = s + (int64_t)tile_rows * kpad_max, zeros = scratch + dim;
                memset(zeros, 0, sizeof(float) * dim);
            }
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (int u = 0; u < units; u++) {
                for (int h = 0; h < kv_heads; h++) {
                    if (!s) continue;
                    const int i = unit_seq[u];
                    const float *kth = kt + kt_at[i] + h * round_up(seq_lens[i], LANES) * dim;
                    attend_tile(&job, i, h, unit_tile[u] * job.tile_tokens, kth, s, scratch, zeros);
                }
            }
            free(s);
        }
    }
    free(kt), free(kt_at), free(unit_seq), free(unit_tile);
    return failed ? -1 : 0;
}

/* y = x W^T + b with W stored in fewer bits than float32: bf16, fp8 (e4m3), int8 or unsigned int4
 * with a float scale (and optionally a zero point) per output column and group of K. A decode step
 * streams every weight once, so reading 2, 1 or 0.5 bytes a weight instead of 4 is the speed-up;
 * the weights become floats in registers, never in memory, and every sum is float32.
 *
 * Layout: the panels of cpu_gemm.c (NR output columns each, [panels][K][NR] elements, N padded with
 * zero columns), one element per weight, except int4: eight k share a 32-bit word, [panels][K / 8]
 * [NR] words, k = 8i + j in bits 4j..4j+3 of word i (K and the group a multiple of 8). Scales and
 * zero points: [panels][K / group][NR] floats. A weight is (q - zero) * scale: for int8 and fp8 the zero is 0, for int4 it is 8
 * (symmetric) unless `zeros` gives one per column and group (int4 only).
 *
 * Two paths, chosen by the number of rows: up to direct_rows(), each strip of rows converts the
 * weights in its register tile as it goes (the weights are read once, at their stored size); past
 * it, each thread converts one panel at a time into a float32 scratch panel and runs the float32
 * GEMM of cpu_gemm.c on it, so a prefill chunk pays the conversion once per panel, not once per
 * strip, and never holds the whole float32 matrix.
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_simd.h"

#define QNV PANEL_VECTORS /* cpu_gemm.c's panels: the scratch path hands them to gemm_panels */
#define QMR TILE_ROWS
#define QNR (QNV * LANES)

enum { W_BF16 = 1, W_FP8 = 2, W_INT8 = 3, W_UINT4 = 4 };

/* Rows up to which the strips convert in their tiles: two strips of 8 still beat a scratch panel,
 * whose conversion and float tile cost a fixed ~1 us a panel (1.5-1.8x the float32 GEMM at 9-16 rows
 * on a Zen 4). int4 on narrower vectors (AVX2) converts slower in the tile: 8 there. */
static inline int direct_rows(int kind) { return kind == W_UINT4 && !WIDE_REGISTERS ? 8 : 16; }

typedef uint32_t u32vec __attribute__((vector_size(MM_VEC_BYTES)));

int gemm_panels(const float *x, int64_t ldx, const float *panels, const float *bias, float *y, int64_t ldy,
                int M, int N, int K, int threads);

/* LANES bytes (or 16-bit values) widened to 32-bit lanes: one instruction each with AVX2 and
 * AVX-512 (GCC turns `__builtin_convertvector` of narrow integers into scalar code there). */
#if MM_VEC_BYTES == 64
#include <immintrin.h>
static inline ivec widen_i8(const uint8_t *p) { return (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline ivec widen_u16(const uint8_t *p) { return (ivec)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); }
#elif MM_VEC_BYTES == 32
#include <immintrin.h>
static inline ivec widen_i8(const uint8_t *p) { return (ivec)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline ivec widen_u16(const uint8_t *p) { return (ivec)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)); }
#else
typedef int8_t i8vec __attribute__((vector_size(LANES)));
typedef uint16_t u16vec __attribute__((vector_size(2 * LANES)));
static inline ivec widen_i8(const uint8_t *p) { i8vec v; memcpy(&v, p, sizeof v); return __builtin_convertvector(v, ivec); }
static inline ivec widen_u16(const uint8_t *p) { u16vec v; memcpy(&v, p, sizeof v); return __builtin_convertvector(v, ivec); }
#endif

static inline vec from_bf16(const uint8_t *p) { return (vec)(widen_u16(p) << 16); }

/* e4m3: the byte sign-extended and shifted left by 20 puts the exponent and mantissa in float32's
 * places and the sign in bit 31 (bits 27-30, copies of the sign, are cleared): 2^(e - 127) (1 + m / 8),
 * or for e = 0 the float32 denormal m 2^-149 x 2^20; times 2^120 both become the fp8 value. */
static inline vec from_fp8(const uint8_t *p) {
    return (vec)(((u32vec)widen_i8(p) << 20) & 0x87FFFFFFu) * 0x1p120f;
}

static inline vec from_int8(const uint8_t *p) { return __builtin_convertvector(widen_i8(p), vec); }

/* int4: eight consecutive k of one column in a 32-bit lane, k + j in bits 4j..4j+3, so one vector
 * load holds eight weight rows of LANES columns. A nibble moved into the top of float32's mantissa
 * under the exponent of 16 is the float 16 + q: a shift and a mask-and-or per vector, no conversion
 * and no shuffle (the shuffle units were the bound of the byte layout's widen and table lookup). The
 * tiles take the values as 16 + q and subtract 16 + zero; `stored_values` gives them signed (q - 8). */
#define INT4_K 8 /* k per 32-bit lane */
typedef uint32_t u32vec_u __attribute__((vector_size(MM_VEC_BYTES), aligned(4), may_alias));
/* The words holding rows k..k + 7 (k a multiple of 8) of vector c of an int4 panel. */
static inline u32vec int4_words(const uint8_t *w, int64_t k, int c) {
    return *(const u32vec_u *)(w + ((k / INT4_K) * QNR + c * LANES) * 4);
}
static inline vec nibble_16(u32vec d, int j) {
    const u32vec m = j <= 4 ? d << (19 - 4 * j) : d >> (4 * j - 19);
#if MM_VEC_BYTES == 64 /* (m & mask) | exponent in one instruction that overwrites m, not a copy */
    return (vec)_mm512_ternarylogic_epi32((__m512i)m, _mm512_set1_epi32(0x00780000), _mm512_set1_epi32(0x41800000), 0xEA);
#else
    return (vec)((m & 0x00780000u) | 0x41800000u);
#endif
}

/* The stored values of weight row k, vector c of a panel, as floats (int4 signed: q - 8). */
static inline vec stored_values(const uint8_t *w, int kind, int64_t k, int c) {
    if (kind == W_UINT4) {
        const u32vec d = int4_words(w, k, c);
        return __builtin_convertvector((ivec)((d >> (4 * (k % INT4_K))) & 15u), vec) - 8.f;
    }
    const uint8_t *p = w + (k * QNR + c * LANES) * (kind == W_BF16 ? 2 : 1);
    return kind == W_BF16 ? from_bf16(p) : kind == W_FP8 ? from_fp8(p) : from_int8(p);
}

/* Up to this many rows a tile sums each group's products unscaled and scales the sum once (one
 * accumulator set more: 4 rows x 3 vectors fit AVX-512's 32 registers twice, 2 x 2 AVX2's 16); an
 * int4 group's zero point then enters once too, as zero x (the group's sum of x), from `xsum`.
 * A short tile spreads its sums over SPLIT accumulator sets, consecutive k (int4: nibbles) taking
 * turns: with one row on AVX2 the two column vectors made two chains of dependent multiply-adds,
 * each waiting out the add's latency, and the tile ran at half the rate the multiply-adds allow.
 * int4 on AVX-512 sums a group unscaled at every height: past 4 rows the tile's scaled totals no
 * longer fit beside the sums and go to the stack, touched once a group, which costs less than a
 * subtract and a multiply per converted vector (5-7 rows 1.08-1.19x, 8 level; bench.qgemm_stream). */
#define GROUPED_ROWS (WIDE_REGISTERS ? 4 : 2)
#define SUM_CHAINS 8 /* independent multiply-add chains a tile keeps going */

/* Weight row kk of the tile's panel times x's column kk, for bf16, fp8 and int8: into a group's
 * unscaled sums ACC (GROUPED), else scaled into the tile's accumulators `a`. */
#define QROW_STEP(R, kind, kk, ACC)                                                                      \
    do {                                                                                                 \
        vec q[QNV];                                                                                      \
        for (int c = 0; c < QNV; c++) {                                                                  \
            q[c] = stored_values(w, kind, kk, c);                                                        \
            if (!GROUPED && kind != W_BF16) q[c] *= sc[c];                                               \
        }                                                                                                \
        for (int r = 0; r < R; r++) {                                                                    \
            const vec xr = splat(x[r * ldx + (kk)]);                                                     \
            for (int c = 0; c < QNV; c++) {                                                              \
                if (GROUPED) (ACC)[r][c] += xr * q[c];                                                   \
                else a[r][c] += xr * q[c];                                                               \
            }                                                                                            \
        }                                                                                                \
    } while (0)

/* R rows x NR columns, the direct path: `w` one panel's packed weights for all of K, `s` and `z`
 * its scales and zero points (z: int4 only, NULL for 8), `group` K per scale, `xsum` (int4 only)
 * each row's sum of x per group, `groups` to a row. */
#define QTILE(NAME, R, kind)                                                                             \
    static __attribute__((noinline)) void NAME(const float *x, int64_t ldx, const uint8_t *w,            \
                                               const float *s, const float *z, int K, int group,         \
                                               const float *xsum, int groups, const float *init,         \
                                               float *y, int64_t ldy, int ncols) {                       \
        enum {                                                                                           \
            GROUPED = R <= GROUPED_ROWS || (kind == W_UINT4 && WIDE_REGISTERS),                          \
            STEP = kind == W_UINT4 ? INT4_K : 1,                                                         \
            SPLIT = GROUPED && R * QNV < SUM_CHAINS ? (SUM_CHAINS + R * QNV - 1) / (R * QNV) : 1,        \
        };                                                                                               \
        vec a[R][QNV];                                                                                   \
        for (int r = 0; r < R; r++)                                                                      \
            for (int c = 0; c < QNV; c++) a[r][c] = init ? load(init + c * LANES) : (vec){};             \
        for (int g0 = 0, g = 0; g0 < K; g0 += group, g++) {                                              \
            const int g1 = g0 + group < K ? g0 + group : K;                                              \
            vec sc[QNV], zc[QNV], acc[SPLIT][R][QNV];                                                    \
            for (int c = 0; c < QNV; c++) { /* int4: 16 + zero, as the values are 16 + q */              \
                sc[c] = s ? load(s + c * LANES) : splat(1.f);                                            \
                zc[c] = (z ? load(z + c * LANES) : splat(8.f)) + 16.f;                                   \
            }                                                                                            \
            if (s) s += QNR;                                                                             \
            if (z) z += QNR;                                                                             \
            for (int u = 0; GROUPED && u < SPLIT; u++)                                                   \
                for (int r = 0; r < R; r++)                                                              \
                    for (int c = 0; c < QNV; c++) acc[u][r][c] = (vec){};                                \
            if (kind == W_UINT4) {                                                                       \
                for (int k = g0; k < g1; k += STEP) {                                                    \
                    u32vec d[QNV];                                                                       \
                    prefetch_ahead(w + (k / INT4_K) * QNR * 4, QNR * 4);                                 \
                    for (int c = 0; c < QNV; c++) d[c] = int4_words(w, k, c);                            \
                    _Pragma("GCC unroll 8") for (int j = 0; j < INT4_K; j++)                             \
                        for (int c = 0; c < QNV; c++) {                                                  \
                            vec v = nibble_16(d[c], j);                                                  \
                            if (!GROUPED) v = (v - zc[c]) * sc[c];                                       \
                            for (int r = 0; r < R; r++) {                                                \
                                if (GROUPED) acc[j % SPLIT][r][c] += splat(x[r * ldx + k + j]) * v;      \
                                else a[r][c] += splat(x[r * ldx + k + j]) * v;                           \
                            }                                                                            \
                        }                                                                                \
                }                                                                                        \
            } else {                                                                                     \
                const int row_bytes = QNR * (kind == W_BF16 ? 2 : 1);                                    \
                int k = g0;                                                                              \
                for (; k + SPLIT <= g1; k += SPLIT) {                                                    \
                    prefetch_ahead(w + (int64_t)k * row_bytes, SPLIT * row_bytes);                       \
                    _Pragma("GCC unroll 8") for (int u = 0; u < SPLIT; u++)                              \
                        QROW_STEP(R, kind, k + u, acc[u]);                                               \
                }                                                                                        \
                for (; k < g1; k++) QROW_STEP(R, kind, k, acc[0]);                                       \
            }                                                                                            \
            for (int r = 0; GROUPED && r < R; r++)                                                       \
                for (int c = 0; c < QNV; c++) {                                                          \
                    vec sum = acc[0][r][c];                                                              \
                    for (int u = 1; u < SPLIT; u++) sum += acc[u][r][c];                                 \
                    a[r][c] += (kind == W_UINT4 ? sum - zc[c] * xsum[r * groups + g] : sum) * sc[c];     \
                }                                                                                        \
        }                                                                                                \
        for (int r = 0; r < R; r++) {                                                                    \
            float row[QNR];                                                                              \
            for (int c = 0; c < QNV; c++) store(row + c * LANES, a[r][c]);                               \
            memcpy(y + r * ldy, row, sizeof(float) * ncols);                                             \
        }                                                                                                \
    }
#define QTILES_OF(KIND, P)                                                                               \
    QTILE(P##1, 1, KIND) QTILE(P##2, 2, KIND) QTILE(P##3, 3, KIND) QTILE(P##4, 4, KIND) QTILE(P##5, 5, KIND)  \
    QTILE(P##6, 6, KIND) QTILE(P##7, 7, KIND) QTILE(P##8, 8, KIND)
QTILES_OF(W_BF16, bf16_tile)
QTILES_OF(W_FP8, fp8_tile)
QTILES_OF(W_INT8, int8_tile)
QTILES_OF(W_UINT4, uint4_tile)
typedef void (*qtile_fn)(const float *, int64_t, const uint8_t *, const float *, const float *, int, int,
                         const float *, int, const float *, float *, int64_t, int);
/* [kind][rows]: a register tile for each weight kind and strip height (at most QMR rows). */
static const qtile_fn QTILES[5][9] = {
    {0},
    {0, bf16_tile1, bf16_tile2, bf16_tile3, bf16_tile4, bf16_tile5, bf16_tile6, bf16_tile7, bf16_tile8},
    {0, fp8_tile1, fp8_tile2, fp8_tile3, fp8_tile4, fp8_tile5, fp8_tile6, fp8_tile7, fp8_tile8},
    {0, int8_tile1, int8_tile2, int8_tile3, int8_tile4, int8_tile5, int8_tile6, int8_tile7, int8_tile8},
    {0, uint4_tile1, uint4_tile2, uint4_tile3, uint4_tile4, uint4_tile5, uint4_tile6, uint4_tile7, uint4_tile8},
};

/* One panel's weights as float32, [K][NR], into `out`: a group's scales and zero points loaded
 * once, an int4 word once for its eight k (converted as the direct tiles do). */
static void dequantize_panel(const uint8_t *w, int kind, const float *s, const float *z, int K, int group,
                             float *out) {
    for (int g0 = 0, g = 0; g0 < K; g0 += group, g++) {
        const int g1 = g0 + group < K ? g0 + group : K;
        vec sc[QNV], zc[QNV];
        for (int c = 0; c < QNV; c++) {
            sc[c] = s ? load(s + (int64_t)g * QNR + c * LANES) : splat(1.f);
            zc[c] = z ? load(z + (int64_t)g * QNR + c * LANES) : splat(kind == W_UINT4 ? 8.f : 0.f);
        }
        if (kind == W_UINT4) {
            for (int c = 0; c < QNV; c++) zc[c] += 16.f; /* nibble_16 gives 16 + q */
            for (int k = g0; k < g1; k += INT4_K)
                for (int c = 0; c < QNV; c++) {
                    const u32vec d = int4_words(w, k, c);
#pragma GCC unroll 8
                    for (int j = 0; j < INT4_K; j++)
                        store(out + (int64_t)(k + j) * QNR + c * LANES, (nibble_16(d, j) - zc[c]) * sc[c]);
                }
            continue;
        }
        for (int k = g0; k < g1; k++)
            for (int c = 0; c < QNV; c++)
                store(out + (int64_t)k * QNR + c * LANES, stored_values(w, kind, k, c) * sc[c]);
    }
}

/* Each row's sum of x over each group of K, [M][groups]. */
static void group_sums(const float *x, int64_t ldx, int M, int K, int group, float *out) {
    const int groups = (K + group - 1) / group;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < groups; g++) {
            const int k1 = (g + 1) * group < K ? (g + 1) * group : K;
            int k = g * group;
            vec v = {};
            for (; k + LANES <= k1; k += LANES) v += load(x + m * ldx + k);
            float sum = 0.f;
            for (int l = 0; l < LANES; l++) sum += v[l];
            for (; k < k1; k++) sum += x[m * ldx + k];
            out[m * groups + g] = sum;
        }
}

/* y [M][N] (row stride ldy) = x [M][K] (row stride ldx) W^T + bias, W packed as above; `scales`
 * NULL for bf16 and fp8 without scales, `zeros` NULL for the kind's constant zero, `bias` (padded
 * to whole panels) may be NULL. Returns 0, or -1 where a scratch panel cannot be allocated. */
int qgemm_panels(const float *x, int64_t ldx, const uint8_t *panels, int kind, const float *scales,
                 const float *zeros, int group, const float *bias, float *y, int64_t ldy, int M, int N, int K,
                 int threads) {
    const int n_panels = (N + QNR - 1) / QNR, groups = (K + group - 1) / group;
    const int64_t panel_bytes = (int64_t)K * QNR * (kind == W_BF16 ? 2 : 1) / (kind == W_UINT4 ? 2 : 1);
    const int direct = M <= direct_rows(kind);
    float *xsum = NULL;
    if (kind == W_UINT4 && direct) {
        xsum = malloc(sizeof(float) * (size_t)M * groups);
        if (xsum == NULL) return -1;
        group_sums(x, ldx, M, K, group, xsum);
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int64_t)n_panels * t / nt, p1 = (int64_t)n_panels * (t + 1) / nt;
        float *scratch = NULL;
        if (!direct && p1 > p0) {
            scratch = aligned_alloc(64, sizeof(float) * (size_t)K * QNR);
            failed = scratch == NULL;
        }
        for (int p = p0; p < p1 && !failed; p++) {
            const int ncols = N - p * QNR < QNR ? N - p * QNR : QNR;
            const uint8_t *w = panels + p * panel_bytes;
            const float *s = scales ? scales + (int64_t)p * groups * QNR : NULL;
            const float *z = zeros ? zeros + (int64_t)p * groups * QNR : NULL;
            const float *b = bias ? bias + p * QNR : NULL;
            if (scratch) {
                dequantize_panel(w, kind, s, z, K, group, scratch);
                gemm_panels(x, ldx, scratch, b, y + p * QNR, ldy, M, ncols, K, 1);
                continue;
            }
            for (int m = 0, strips = (M + QMR - 1) / QMR, i = 0; i < strips; i++) {
                const int r = M * (i + 1) / strips - M * i / strips;
                QTILES[kind][r](x + m * ldx, ldx, w, s, z, K, group, xsum ? xsum + m * groups : NULL, groups, b,
                                y + m * ldy + p * QNR, ldy, ncols);
                m += r;
            }
        }
        free(scratch);
    }
    free(xsum);
    return failed ? -1 : 0;
}

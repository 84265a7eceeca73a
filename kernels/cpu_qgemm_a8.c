/* y = x W^T + b with the input rounded to int8 per row (W8A8 / W4A8): integer dot products
 * (AVX-512 VNNI `vpdpbusd`: 64 multiply-adds of a byte and a signed byte an instruction, summed
 * in int32; AVX2: vpmaddubsw + vpmaddwd), instead of widening every weight to float32. Weight-only int4
 * at one row is bound by that widening (docs/cpu.md), not by memory; here a weight byte is used
 * as it is loaded.
 *
 * The input is quantized as compressed-tensors quantizes it (models/layers/act_quant.py): per row,
 * scale = max |x| / 127.5 (a zero scale becomes FLT_EPSILON), or the stored static scale; then
 * x / scale clamped to [-128, 127] and rounded half to even. The int32 sum of each group of K is
 * exact, then scaled by the group's weight scales in float32, and the row by its input scale.
 *
 * Layout (kernels/cpu_qgemm_a8.py packs it): panels of NR output columns as cpu_qgemm.c; within a
 * panel, for each 4 consecutive k, NR columns of 4 bytes (one 32-bit lane each):
 * - int8: [panels][K / 4][NR][4] signed weights. vpdpbusd takes the unsigned operand from x, so x
 *   goes in as x + 128 and 128 times the group's column sum (`wsum`, packed) comes off again;
 * - int4: [panels][K / 8][NR][4], byte j of a lane holding k = 8i + j in its low nibble and
 *   8i + 4 + j in its high one, the stored values 0..15 (unsigned, as vpdpbusd wants them); the
 *   zero point (8, or `zeros`) comes off as zero times the group's sum of x.
 *
 * Built in every variant: avx512 takes int8 and int4 weights where the CPU has VNNI, avx2 int4
 * weights (see dot4); `qgemm_a8_kinds` says which here, and for the rest the caller keeps the
 * fake-quantized float path.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu_simd.h"

#define A8NV PANEL_VECTORS
#define A8NR (A8NV * LANES)
#define A8_ROWS 4 /* rows a tile holds: 4 x 3 int32 sums and 4 x 3 float sums fill AVX-512's registers */

enum { A8_INT8 = 3, A8_INT4 = 4 }; /* cpu_qgemm.py's KINDS */

/* Rows of x as the kernel reads them: int8 (int4 weights) or int8 + 128 (int8 weights), K
 * contiguous per row; each row's scale, and (int4) each row's sum of the rounded values per group. */
static void quantize_rows(const float *x, int64_t ldx, int M, int K, int group, int kind, const float *static_scale,
                          uint8_t *xq, float *xscale, int32_t *xsum, int threads) {
    const int groups = K / group;
#pragma omp parallel for num_threads(threads) schedule(static) if ((int64_t)M * K >= 65536)
    for (int m = 0; m < M; m++) {
        const float *row = x + m * ldx;
        float scale;
        if (static_scale) {
            scale = *static_scale;
        } else {
            float peak = 0.f;
            for (int k = 0; k < K; k++) peak = fmaxf(peak, fabsf(row[k]));
            scale = peak / 127.5f;
            if (scale == 0.f) scale = FLT_EPSILON;
        }
        xscale[m] = scale;
        uint8_t *q = xq + (int64_t)m * K;
        for (int g = 0; g < groups; g++) {
            int32_t sum = 0;
            for (int k = g * group; k < (g + 1) * group; k++) {
                const float v = fminf(fmaxf(row[k] / scale, -128.f), 127.f);
                const int r = (int)rintf(v);
                sum += r;
                q[k] = (uint8_t)(kind == A8_INT8 ? r + 128 : r);
            }
            if (xsum) xsum[m * groups + g] = sum;
        }
    }
}

/* The ISA's 4-byte dot product: each 32-bit lane of acc plus the sum of 4 products of an unsigned
 * byte of u and a signed byte of s. AVX-512 VNNI: one instruction, never saturating (int8 weights
 * take it, their x + 128 reaching 255). AVX2: vpmaddubsw then vpmaddwd, whose 16-bit pair sums
 * saturate past 32767, so only int4 weights (u at most 15: pairs up to 3840) take it. */
#if MM_VEC_BYTES == 64
#include <immintrin.h>
#define A8_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define A8_KINDS (1 << A8_INT8 | 1 << A8_INT4)
A8_TARGET static inline ivec dot4(ivec acc, ivec u, ivec s) {
    return (ivec)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
}
static int a8_cpu(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
}
#elif MM_VEC_BYTES == 32 && defined(__AVX2__)
#include <immintrin.h>
#define A8_TARGET
#define A8_KINDS (1 << A8_INT4)
static inline ivec dot4(ivec acc, ivec u, ivec s) {
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)u, (__m256i)s);
    return acc + (ivec)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
static int a8_cpu(void) { return 1; } /* the variant loads only where AVX2 runs */
#endif

#ifdef A8_KINDS
static inline ivec load_bytes(const uint8_t *p) {
    ivec v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline ivec splat4(const uint8_t *p) { /* 4 bytes in every 32-bit lane */
    int32_t x;
    memcpy(&x, p, 4);
    return (ivec){} + x;
}

/* R rows x NR columns of one panel, all of K. */
#define A8_TILE(NAME, R, KIND)                                                                           \
    A8_TARGET static __attribute__((noinline)) void NAME(                                               \
        const uint8_t *xq, int K, const float *xscale, const int32_t *xsum, const uint8_t *w,             \
        const float *s, const float *z, const int32_t *wsum, int group, const float *bias, float *y,       \
        int64_t ldy, int ncols) {                                                                        \
        const int groups = K / group;                                                                    \
        vec a[R][A8NV];                                                                                  \
        for (int r = 0; r < R; r++)                                                                      \
            for (int c = 0; c < A8NV; c++) a[r][c] = (vec){};                                            \
        const ivec low4 = (ivec){} + 0x0F0F0F0F;                                                         \
        for (int g = 0; g < groups; g++) {                                                               \
            ivec acc[R][A8NV];                                                                           \
            for (int r = 0; r < R; r++)                                                                  \
                for (int c = 0; c < A8NV; c++) acc[r][c] = (ivec){};                                     \
            for (int k = g * group; k < (g + 1) * group; k += KIND == A8_INT4 ? 8 : 4) {                 \
                for (int c = 0; c < A8NV; c++) {                                                         \
                    const int64_t at = (int64_t)(KIND == A8_INT4 ? k / 8 : k / 4) * A8NR * 4 + c * MM_VEC_BYTES; \
                    const ivec v = load_bytes(w + at);                                                   \
                    if (KIND == A8_INT8) {                                                               \
                        for (int r = 0; r < R; r++) acc[r][c] = dot4(acc[r][c], splat4(xq + (int64_t)r * K + k), v); \
                    } else {                                                                             \
                        const ivec lo = v & low4, hi = (ivec)((uint32_t __attribute__((vector_size(MM_VEC_BYTES))))v >> 4) & low4; \
                        for (int r = 0; r < R; r++) {                                                    \
                            acc[r][c] = dot4(acc[r][c], lo, splat4(xq + (int64_t)r * K + k));            \
                            acc[r][c] = dot4(acc[r][c], hi, splat4(xq + (int64_t)r * K + k + 4));        \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
            for (int c = 0; c < A8NV; c++) {                                                             \
                const vec sc = load(s + (int64_t)g * A8NR + c * LANES);                                  \
                if (KIND == A8_INT8) {                                                                   \
                    ivec off;                                                                            \
                    memcpy(&off, wsum + (int64_t)g * A8NR + c * LANES, sizeof off);                      \
                    for (int r = 0; r < R; r++)                                                          \
                        a[r][c] += __builtin_convertvector(acc[r][c] - (off << 7), vec) * sc;            \
                } else {                                                                                 \
                    const vec zc = z ? load(z + (int64_t)g * A8NR + c * LANES) : splat(8.f);             \
                    for (int r = 0; r < R; r++) {                                                        \
                        const vec sum = __builtin_convertvector(acc[r][c], vec) - zc * (float)xsum[r * groups + g]; \
                        a[r][c] += sum * sc;                                                             \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < R; r++) {                                                                    \
            float row[A8NR];                                                                             \
            for (int c = 0; c < A8NV; c++) {                                                             \
                vec out = a[r][c] * xscale[r];                                                           \
                if (bias) out += load(bias + c * LANES);                                                 \
                store(row + c * LANES, out);                                                             \
            }                                                                                            \
            memcpy(y + r * ldy, row, sizeof(float) * ncols);                                             \
        }                                                                                                \
    }
A8_TILE(a8_int8_1, 1, A8_INT8)
A8_TILE(a8_int8_2, 2, A8_INT8)
A8_TILE(a8_int8_3, 3, A8_INT8)
A8_TILE(a8_int8_4, 4, A8_INT8)
A8_TILE(a8_int4_1, 1, A8_INT4)
A8_TILE(a8_int4_2, 2, A8_INT4)
A8_TILE(a8_int4_3, 3, A8_INT4)
A8_TILE(a8_int4_4, 4, A8_INT4)
typedef void (*a8_tile_fn)(const uint8_t *, int, const float *, const int32_t *, const uint8_t *, const float *,
                           const float *, const int32_t *, int, const float *, float *, int64_t, int);
static const a8_tile_fn A8_TILES[2][A8_ROWS + 1] = {
    {0, a8_int8_1, a8_int8_2, a8_int8_3, a8_int8_4},
    {0, a8_int4_1, a8_int4_2, a8_int4_3, a8_int4_4},
};

/* Which weight kinds this build and CPU multiply with int8 inputs: bit KINDS[kind] (cpu_qgemm.py).
 * Asked once: qgemm_a8_panels checks it on every call (a guard against an illegal instruction). */
int qgemm_a8_kinds(void) {
    static int kinds = -1;
    if (kinds < 0) kinds = a8_cpu() ? A8_KINDS : 0;
    return kinds;
}

/* y [M][N] (row stride ldy) = quantize(x) W^T + bias; `static_scale` NULL for a scale per row.
 * `zeros` (int4) NULL for 8; `wsum` (int8) the packed column sums per group. Returns 0, -1 where
 * scratch cannot be allocated, -2 where this build or CPU does not take `kind`. */
int qgemm_a8_panels(const float *x, int64_t ldx, const float *static_scale, const uint8_t *panels, int kind,
                    const float *scales, const float *zeros, const int32_t *wsum, int group, const float *bias,
                    float *y, int64_t ldy, int M, int N, int K, int threads) {
    if (!(qgemm_a8_kinds() >> kind & 1)) return -2;
    const int n_panels = (N + A8NR - 1) / A8NR, groups = K / group;
    const int64_t panel_bytes = (int64_t)K * A8NR / (kind == A8_INT4 ? 2 : 1);
    uint8_t *xq = malloc((size_t)M * K);
    float *xscale = malloc(sizeof(float) * (size_t)M);
    int32_t *xsum = kind == A8_INT4 ? malloc(sizeof(int32_t) * (size_t)M * groups) : NULL;
    if (!xq || !xscale || (kind == A8_INT4 && !xsum)) {
        free(xq), free(xscale), free(xsum);
        return -1;
    }
    quantize_rows(x, ldx, M, K, group, kind, static_scale, xq, xscale, xsum, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int p = 0; p < n_panels; p++) {
        const int ncols = N - p * A8NR < A8NR ? N - p * A8NR : A8NR;
        const uint8_t *w = panels + p * panel_bytes;
        const float *s = scales + (int64_t)p * groups * A8NR;
        const float *z = zeros ? zeros + (int64_t)p * groups * A8NR : NULL;
        const int32_t *ws = wsum ? wsum + (int64_t)p * groups * A8NR : NULL;
        const float *b = bias ? bias + p * A8NR : NULL;
        for (int m = 0; m < M; m += A8_ROWS) {
            const int r = M - m < A8_ROWS ? M - m : A8_ROWS;
            A8_TILES[kind == A8_INT4][r](xq + (int64_t)m * K, K, xscale + m, xsum ? xsum + (int64_t)m * groups : NULL,
                                         w, s, z, ws, group, b, y + m * ldy + p * A8NR, ldy, ncols);
        }
    }
    free(xq), free(xscale), free(xsum);
    return 0;
}
#else
int qgemm_a8_kinds(void) { return 0; }

int qgemm_a8_panels(const float *x, int64_t ldx, const float *static_scale, const uint8_t *panels, int kind,
                    const float *scales, const float *zeros, const int32_t *wsum, int group, const float *bias,
                    float *y, int64_t ldy, int M, int N, int K, int threads) {
    (void)x, (void)ldx, (void)static_scale, (void)panels, (void)kind, (void)scales, (void)zeros, (void)wsum;
    (void)group, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)threads;
    (void)quantize_rows;
    return -2;
}
#endif

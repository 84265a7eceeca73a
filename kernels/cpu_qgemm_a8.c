/* y = x W^T + b with the input rounded to int8 per row (W8A8 / W4A8): integer dot products
 * where the CPU has AVX-512 VNNI (`vpdpbusd`: 64 multiply-adds of a byte and a signed byte an
 * instruction, summed in int32), instead of widening every weight to float32. Weight-only int4
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
 * Built in every variant; only the avx512 build has the kernel (`qgemm_a8_available` says whether
 * this CPU runs it); the others answer 0 and the caller keeps the fake-quantized float path.
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

#if MM_VEC_BYTES == 64
#include <immintrin.h>
#define A8_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* R rows x NR columns of one panel, all of K. */
#define A8_TILE(NAME, R, KIND)                                                                           \
    static A8_TARGET __attribute__((noinline)) void NAME(                                               \
        const uint8_t *xq, int K, const float *xscale, const int32_t *xsum, const uint8_t *w,             \
        const float *s, const float *z, const int32_t *wsum, int group, const float *bias, float *y,       \
        int64_t ldy, int ncols) {                                                                        \
        const int groups = K / group;                                                                    \
        __m512 a[R][A8NV];                                                                               \
        for (int r = 0; r < R; r++)                                                                      \
            for (int c = 0; c < A8NV; c++) a[r][c] = _mm512_setzero_ps();                                \
        const __m512i low4 = _mm512_set1_epi8(0x0F);                                                     \
        for (int g = 0; g < groups; g++) {                                                               \
            __m512i acc[R][A8NV];                                                                        \
            for (int r = 0; r < R; r++)                                                                  \
                for (int c = 0; c < A8NV; c++) acc[r][c] = _mm512_setzero_si512();                       \
            for (int k = g * group; k < (g + 1) * group; k += KIND == A8_INT4 ? 8 : 4) {                 \
                for (int c = 0; c < A8NV; c++) {                                                         \
                    const int64_t at = (int64_t)(KIND == A8_INT4 ? k / 8 : k / 4) * A8NR * 4 + c * 64;     \
                    const __m512i v = _mm512_loadu_si512((const void *)(w + at));                         \
                    if (KIND == A8_INT8) {                                                               \
                        for (int r = 0; r < R; r++) {                                                    \
                            int32_t x4;                                                                  \
                            memcpy(&x4, xq + (int64_t)r * K + k, 4);                                     \
                            acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], _mm512_set1_epi32(x4), v);        \
                        }                                                                                \
                    } else {                                                                             \
                        const __m512i lo = _mm512_and_si512(v, low4);                                    \
                        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);              \
                        for (int r = 0; r < R; r++) {                                                    \
                            int32_t x0, x1;                                                              \
                            memcpy(&x0, xq + (int64_t)r * K + k, 4);                                     \
                            memcpy(&x1, xq + (int64_t)r * K + k + 4, 4);                                 \
                            acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], lo, _mm512_set1_epi32(x0));       \
                            acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], hi, _mm512_set1_epi32(x1));       \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
            for (int c = 0; c < A8NV; c++) {                                                             \
                const __m512 sc = _mm512_loadu_ps(s + (int64_t)g * A8NR + c * LANES);                   \
                if (KIND == A8_INT8) {                                                                   \
                    const __m512i off = _mm512_slli_epi32(                                               \
                        _mm512_loadu_si512((const void *)(wsum + (int64_t)g * A8NR + c * LANES)), 7);      \
                    for (int r = 0; r < R; r++) {                                                        \
                        const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], off));         \
                        a[r][c] = _mm512_fmadd_ps(sum, sc, a[r][c]);                                     \
                    }                                                                                    \
                } else {                                                                                 \
                    const __m512 zc = z ? _mm512_loadu_ps(z + (int64_t)g * A8NR + c * LANES)             \
                                        : _mm512_set1_ps(8.f);                                           \
                    for (int r = 0; r < R; r++) {                                                        \
                        const __m512 xs = _mm512_set1_ps((float)xsum[r * groups + g]);                   \
                        const __m512 sum = _mm512_fnmadd_ps(zc, xs, _mm512_cvtepi32_ps(acc[r][c]));      \
                        a[r][c] = _mm512_fmadd_ps(sum, sc, a[r][c]);                                     \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < R; r++) {                                                                    \
            float row[A8NR];                                                                             \
            const __m512 xs = _mm512_set1_ps(xscale[r]);                                                 \
            for (int c = 0; c < A8NV; c++) {                                                             \
                __m512 out = _mm512_mul_ps(a[r][c], xs);                                                 \
                if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + c * LANES));                   \
                _mm512_storeu_ps(row + c * LANES, out);                                                  \
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

int qgemm_a8_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
}

/* y [M][N] (row stride ldy) = quantize(x) W^T + bias; `static_scale` NULL for a scale per row.
 * `zeros` (int4) NULL for 8; `wsum` (int8) the packed column sums per group. Returns 0, -1 where
 * scratch cannot be allocated, -2 where this CPU has no VNNI. */
int qgemm_a8_panels(const float *x, int64_t ldx, const float *static_scale, const uint8_t *panels, int kind,
                    const float *scales, const float *zeros, const int32_t *wsum, int group, const float *bias,
                    float *y, int64_t ldy, int M, int N, int K, int threads) {
    if (!qgemm_a8_available()) return -2;
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
int qgemm_a8_available(void) { return 0; }

int qgemm_a8_panels(const float *x, int64_t ldx, const float *static_scale, const uint8_t *panels, int kind,
                    const float *scales, const float *zeros, const int32_t *wsum, int group, const float *bias,
                    float *y, int64_t ldy, int M, int N, int K, int threads) {
    (void)x, (void)ldx, (void)static_scale, (void)panels, (void)kind, (void)scales, (void)zeros, (void)wsum;
    (void)group, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)threads;
    (void)quantize_rows;
    return -2;
}
#endif

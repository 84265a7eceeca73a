/* What every CPU kernel shares: the vector type of the ISA variant being built, and an exp that
 * vectorises without -ffast-math.
 *
 * kernels/cpu_build.py compiles each source once per variant, with MM_VEC_BYTES set to the width
 * of the variant's registers: 64 (AVX-512), 32 (AVX2 + FMA) or 16 (portable: SSE2 on x86-64,
 * NEON on aarch64, GCC's generic lowering elsewhere). The register tiles of the GEMM and the
 * prefill kernel are sized from it: 32 registers for AVX-512, 16 for the others.
 *
 * The kernels are compiled with IEEE semantics (no -ffast-math): infinities and NaN behave as in
 * torch. The reassociations the kernels need are spelled out (vector types, `omp simd` reductions).
 */
#ifndef MM_CPU_SIMD_H
#define MM_CPU_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef MM_VEC_BYTES
#define MM_VEC_BYTES 16
#endif

typedef float vec __attribute__((vector_size(MM_VEC_BYTES)));
typedef float vec_u __attribute__((vector_size(MM_VEC_BYTES), aligned(4), may_alias)); /* unaligned */
typedef int ivec __attribute__((vector_size(MM_VEC_BYTES)));
#define LANES (MM_VEC_BYTES / 4)
/* Registers the tiles may fill: 32 on AVX-512, 16 on AVX2, SSE2 (NEON's 32 are left unused). */
#define WIDE_REGISTERS (MM_VEC_BYTES == 64)

/* The float GEMM's panels (cpu_gemm.c), which the low-bit GEMM (cpu_qgemm.c) packs alike and hands
 * to it: PANEL_VECTORS vectors of output columns, register tiles of up to TILE_ROWS rows. */
#define PANEL_VECTORS (WIDE_REGISTERS ? 3 : 2)
#define TILE_ROWS (WIDE_REGISTERS ? 8 : 6)

/* The GEMM tiles of both ask for a panel's weights this many bytes ahead of the row they read:
 * with the hardware's prefetchers alone a few-row product's loads waited and its multiply-adds (and
 * low-bit conversions) ran after them, not beside (bench.qgemm_stream, against the build without). */
#define WEIGHTS_AHEAD 8192
static inline void prefetch_ahead(const void *row, int bytes) {
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch((const char *)row + WEIGHTS_AHEAD + l);
}

static inline vec load(const float *p) { return *(const vec_u *)p; }
static inline void store(float *p, vec v) { *(vec_u *)p = v; }
/* x in every lane: one broadcast, from memory where x comes from there. (`(vec){} + x`, the usual
 * spelling, costs an add here: without -ffast-math, 0 + x cannot be folded, -0 + 0 being +0.) */
static inline vec splat(float x) { return __builtin_shuffle((vec){x}, (ivec){}); }

/* exp(x) in float32, to about 2 ulp, written so that `omp simd` loops vectorise it (glibc's
 * vector exp is only declared under -ffast-math). Cody-Waite reduction x = n ln2 + r, Cephes'
 * degree-6 polynomial for exp(r), and 2^n put together from its bits. exp(-inf) and anything
 * below -87.3 is 0, above 88.37 (where 2^n would leave the exponent range) +inf, NaN stays NaN:
 * the comparisons are false for NaN, so it flows through the arithmetic. */
static inline float mm_expf(float x) {
    const float shift = 12582912.f; /* 1.5 * 2^23: adding it rounds to an integer, kept in the bits */
    float xc = x < -87.3f ? -87.3f : x;
    xc = xc > 88.37f ? 88.37f : xc;
    const float s = xc * 1.44269504088896341f + shift, n = s - shift;
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    uint32_t bits;
    memcpy(&bits, &s, sizeof bits);
    bits = (bits - 0x4B400000u + 127u) << 23; /* n's bits sit at the bottom of s */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = p * scale;
    y = x < -87.3f ? 0.f : y;
    y = x > 88.37f ? INFINITY : y;
    return y;
}

#endif

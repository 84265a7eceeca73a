/* Fused elementwise passes for the CPU path, one pass over memory each: activations, RMSNorm (with
 * the residual add) and rotary embedding.
 *
 * torch runs SiLU-times-up as two kernels (silu into a temporary, then the product) and its
 * tanh-GELU with a full-precision tanh; over a prefill step's [2048, 1536] (LM) or a vision batch's
 * [1960, 3072] activations these took 2.2 and 5.3 ms a layer. Here each is one pass, with the
 * vectorisable exp of cpu_simd.h: results agree with torch's to a few float32 ulps, infinities
 * and NaN included (tanh's argument is clamped where tanh(15) is 1 in float32).
 *
 * Built by kernels/cpu_build.py, once per ISA variant (cpu_simd.h).
 */
#include "cpu_simd.h"

/* out[r, c] = silu(x[r, c]) * x[r, cols + c]: the gate and up halves of a fused projection's rows
 * (row stride x_stride), into a contiguous [rows, cols] output. */
void silu_and_mul(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t cols, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + cols;
        float *o = out + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) o[c] = gate[c] / (1.f + mm_expf(-gate[c])) * up[c];
    }
}

/* x = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in place; tanh(y) = 1 - 2 / (exp(2y) + 1). */
void gelu_tanh_(float *x, int64_t n, int threads) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i];
        float y = k * (v + 0.044715f * v * v * v);
        y = y < -15.f ? -15.f : y > 15.f ? 15.f : y; /* NaN stays NaN */
        x[i] = 0.5f * v * (2.f - 2.f / (mm_expf(2.f * y) + 1.f));
    }
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, row by row. With `delta`, the row normalised is
 * x[r] + delta[r], also written to sum[r] (the residual stream; sum may be x itself: each element
 * is read before it is written), so the add and the norm are one pass. Small batches (a decode
 * step) stay on one thread: waking the other costs more than the work. (torch's CPU RMSNorm is
 * five ops, about 40 us for one decode row.) */
void rms_norm(const float *x, const float *delta, float *sum_out, const float *w, float *out, int64_t rows,
              int64_t cols, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *o = out + r * cols, sum = 0.f;
        if (delta) {
            const float *dr = delta + r * cols;
            float *sr = sum_out + r * cols;
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) sr[c] = xr[c] + dr[c];
            xr = sr;
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < cols; c++) sum += xr[c] * xr[c];
        const float inv = 1.f / sqrtf(sum / (float)cols + eps);
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) o[c] = xr[c] * inv * w[c];
    }
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w * silu(gate[r]), row by row: the gated RMSNorm a
 * linear-attention layer ends with (torch: eight ops). Small batches stay on one thread. */
void gated_rms_norm(const float *x, const float *gate, const float *w, float *out, int64_t rows, int64_t cols,
                    float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols, *gr = gate + r * cols;
        float *o = out + r * cols, sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < cols; c++) sum += xr[c] * xr[c];
        const float inv = 1.f / sqrtf(sum / (float)cols + eps);
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) o[c] = xr[c] * inv * w[c] * (gr[c] / (1.f + mm_expf(-gr[c])));
    }
}

/* Rotary embedding in place, rotate_half layout: for each token t and head h of x (rows
 * token_stride apart, heads dim apart), (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos, sin
 * [tokens, dim / 2] shared by the heads. */
void rotary_(float *x, int64_t tokens, int heads, int64_t token_stride, int dim, const float *cos,
             const float *sin, int threads) {
    const int half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads * dim >= 65536)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * token_stride + (int64_t)h * dim, *x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

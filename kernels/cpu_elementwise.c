/* Fused elementwise activations for the CPU path, one pass over memory each.
 *
 * torch runs SiLU-times-up as two kernels (silu into a temporary, then the product) and its
 * tanh-GELU with a full-precision tanh; over a prefill step's [2048, 1536] (LM) or a vision batch's
 * [1960, 3072] activations these took 2.2 and 5.3 ms a layer. Here each is one pass, with exp from
 * the vector math library (-ffast-math): results agree with torch's to a few float32 ulps.
 * Arguments of exp are clamped where the result no longer changes (tanh(15) and 1 / (1 + e^80) are
 * 1 and 0 in float32): -ffast-math's reciprocal turns an infinite denominator into NaN.
 *
 * Built by kernels/cpu_build.py with the system C compiler (-O3 -march=native -ffast-math -fopenmp).
 */
#include <math.h>
#include <stdint.h>

/* out[r, c] = silu(x[r, c]) * x[r, cols + c]: the gate and up halves of a fused projection's rows
 * (row stride x_stride), into a contiguous [rows, cols] output. */
void silu_and_mul(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t cols, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + cols;
        float *o = out + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) o[c] = gate[c] / (1.f + expf(fminf(-gate[c], 80.f))) * up[c];
    }
}

/* x = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in place; tanh(y) = 1 - 2 / (exp(2y) + 1). */
void gelu_tanh_(float *x, int64_t n, int threads) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i], y = fminf(fmaxf(k * (v + 0.044715f * v * v * v), -15.f), 15.f);
        x[i] = 0.5f * v * (2.f - 2.f / (expf(2.f * y) + 1.f));
    }
}

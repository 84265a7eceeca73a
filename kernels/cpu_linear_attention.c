/* The gated delta rule's decode step (Gated DeltaNet, Qwen3.5's linear attention) on the CPU.
 *
 * For each sequence of a batch and each value head, one token: decay the state S [key_dim,
 * value_dim] by exp(g), take the part of v that S does not predict from k (scaled by beta), add
 * k times it to S, and read S with q. q and k are L2-normalised first (q also scaled by
 * key_dim^-0.5), as the torch reference does.
 *
 * The torch path gathers each sequence's state out of the pool, makes five passes over it
 * (decay, predict, outer product, add, read) and scatters it back; here the state is updated in
 * place in the pool (rows chosen by `slots`) in two passes: decay and predict in one, write and
 * read in the other. Decode is bound by this traffic: Qwen3.5-0.8B's state is 1 MB per layer and
 * sequence.
 *
 * Built by kernels/cpu_build.py, once per ISA variant (cpu_simd.h).
 */
#include <math.h>

#include "cpu_simd.h"

#define MAX_DIM 512

/* Normalise `n` floats into `out`: x / sqrt(sum x^2 + 1e-6), then times `scale`. */
static void l2_normalise(const float *x, float *out, int n, float scale) {
    float sum = 0.f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.f / sqrtf(sum + 1e-6f);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * scale;
}

/* state: [pool rows, heads, dk, dv], contiguous; slots[b]: sequence b's row. qkv: row b at
 * qkv + b * qkv_stride holds q [key_heads, dk], k [key_heads, dk], v [heads, dv] side by side.
 * g, beta: [batch, heads] contiguous. out: [batch, heads, dv]. Returns 0. */
int delta_rule_step_(float *state, const int64_t *slots, const float *qkv, int64_t qkv_stride, const float *g,
                     const float *beta, float *out, int64_t batch, int heads, int key_heads, int dk, int dv,
                     int threads) {
    const int group = heads / key_heads;
    const float scale = 1.f / sqrtf((float)dk);
#pragma omp parallel for num_threads(threads) schedule(static) if (batch * heads > 1)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads;
        const int h = (int)(bh % heads), kh = h / group;
        const float *row = qkv + b * qkv_stride;
        float q[MAX_DIM], k[MAX_DIM], pred[MAX_DIM], delta[MAX_DIM];
        l2_normalise(row + kh * dk, q, dk, 1.f);
        for (int i = 0; i < dk; i++) q[i] *= scale;
        l2_normalise(row + (key_heads + kh) * dk, k, dk, 1.f);
        const float *v = row + 2 * key_heads * dk + h * dv;
        const float decay = expf(g[b * heads + h]), bt = beta[b * heads + h];
        float *s = state + (slots[b] * heads + h) * (int64_t)dk * dv;
        float *o = out + (b * heads + h) * (int64_t)dv;
        for (int j = 0; j < dv; j++) pred[j] = 0.f;
        for (int i = 0; i < dk; i++) {
            float *si = s + (int64_t)i * dv;
            const float ki = k[i];
#pragma omp simd
            for (int j = 0; j < dv; j++) {
                si[j] *= decay;
                pred[j] += ki * si[j];
            }
        }
#pragma omp simd
        for (int j = 0; j < dv; j++) {
            delta[j] = (v[j] - pred[j]) * bt;
            o[j] = 0.f;
        }
        for (int i = 0; i < dk; i++) {
            float *si = s + (int64_t)i * dv;
            const float ki = k[i], qi = q[i];
#pragma omp simd
            for (int j = 0; j < dv; j++) {
                si[j] += ki * delta[j];
                o[j] += qi * si[j];
            }
        }
    }
    return 0;
}

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
 * The causal depthwise conv in front of it (`conv_step_`) is one pass too: torch gathers each
 * sequence's conv state, concatenates the new input, multiplies, sums over the window, applies SiLU
 * and scatters the state back, six ops for a few thousand floats.
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

/* One token per sequence through the depthwise causal conv and SiLU, the conv state updated in
 * place. conv: [pool rows, channels, width - 1], contiguous, oldest input first; slots[b]: sequence
 * b's row; x: row b at x + b * x_stride, [channels]; weight: [channels, width], the last tap on the
 * newest input; out: [batch, channels]. Returns 0. */
int conv_step_(float *conv, const int64_t *slots, const float *x, int64_t x_stride, const float *weight,
               float *out, int64_t batch, int channels, int width, int threads) {
    const int keep = width - 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (batch > 1)
    for (int64_t b = 0; b < batch; b++) {
        float *state = conv + slots[b] * (int64_t)channels * keep;
        const float *xb = x + b * x_stride;
        float *o = out + b * (int64_t)channels;
        if (keep == 3) { /* Qwen3.5's width 4, unrolled: the general loop runs 4x slower */
            for (int c = 0; c < channels; c++) {
                float *sc = state + 3 * (int64_t)c;
                const float *w = weight + 4 * (int64_t)c;
                const float s0 = sc[0], s1 = sc[1], s2 = sc[2], xc = xb[c];
                o[c] = w[0] * s0 + w[1] * s1 + w[2] * s2 + w[3] * xc;
                sc[0] = s1, sc[1] = s2, sc[2] = xc;
            }
        } else {
            for (int c = 0; c < channels; c++) {
                float *sc = state + (int64_t)c * keep;
                const float *w = weight + (int64_t)c * width;
                float y = 0.f;
                for (int j = 0; j < keep; j++) y += w[j] * sc[j];
                y += w[keep] * xb[c];
                for (int j = 0; j + 1 < keep; j++) sc[j] = sc[j + 1];
                if (keep) sc[keep - 1] = xb[c];
                o[c] = y;
            }
        }
#pragma omp simd
        for (int c = 0; c < channels; c++) o[c] = o[c] / (1.f + mm_expf(-o[c]));
    }
    return 0;
}

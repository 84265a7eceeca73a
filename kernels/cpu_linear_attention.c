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
#include <stdlib.h>

#include "cpu_simd.h"

#define MAX_DIM 512

/* Normalise `n` floats into `out`: x / sqrt(sum x^2 + 1e-6), then times `scale`. */
static void l2_normalise(const float *x, float *out, int n, float scale) {
    float sum = 0.f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.f / sqrtf(sum + 1e-6f);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * scale;
}

/* One value head of one sequence: `s` its state [dk, dv] (updated in place), `row` its q | k | v
 * after the conv, `h` the head, writes `o` [dv]. */
static void delta_head(float *s, const float *row, int h, int key_heads, int group, int dk, int dv, float decay,
                       float bt, float *o) {
    const int kh = h / group;
    float q[MAX_DIM], k[MAX_DIM], pred[MAX_DIM], delta[MAX_DIM];
    l2_normalise(row + kh * dk, q, dk, 1.f / sqrtf((float)dk));
    l2_normalise(row + (key_heads + kh) * dk, k, dk, 1.f);
    const float *v = row + 2 * key_heads * dk + h * dv;
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

/* state: [pool rows, heads, dk, dv], contiguous; slots[b]: sequence b's row. qkv: row b at
 * qkv + b * qkv_stride holds q [key_heads, dk], k [key_heads, dk], v [heads, dv] side by side.
 * g, beta: [batch, heads] contiguous. out: [batch, heads, dv]. Returns 0. */
int delta_rule_step_(float *state, const int64_t *slots, const float *qkv, int64_t qkv_stride, const float *g,
                     const float *beta, float *out, int64_t batch, int heads, int key_heads, int dk, int dv,
                     int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (batch * heads > 1)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads;
        const int h = (int)(bh % heads);
        float *s = state + (slots[b] * heads + h) * (int64_t)dk * dv;
        delta_head(s, qkv + b * qkv_stride, h, key_heads, heads / key_heads, dk, dv, expf(g[bh]), beta[bh],
                   out + bh * (int64_t)dv);
    }
    return 0;
}

/* Channels [c0, c1) of one sequence's token through the depthwise causal conv and SiLU: `state`
 * its conv state [channels, width - 1] (oldest input first), updated in place; `x` the token's
 * channels; `weight` [channels, width], the last tap on the newest input; writes `o` [channels]. */
static void conv_channels(float *state, const float *x, const float *weight, float *o, int c0, int c1, int width) {
    const int keep = width - 1;
    if (keep == 3) { /* Qwen3.5's width 4, unrolled: the general loop runs 4x slower */
        for (int c = c0; c < c1; c++) {
            float *sc = state + 3 * (int64_t)c;
            const float *w = weight + 4 * (int64_t)c;
            const float s0 = sc[0], s1 = sc[1], s2 = sc[2], xc = x[c];
            o[c] = w[0] * s0 + w[1] * s1 + w[2] * s2 + w[3] * xc;
            sc[0] = s1, sc[1] = s2, sc[2] = xc;
        }
    } else {
        for (int c = c0; c < c1; c++) {
            float *sc = state + (int64_t)c * keep;
            const float *w = weight + (int64_t)c * width;
            float y = 0.f;
            for (int j = 0; j < keep; j++) y += w[j] * sc[j];
            y += w[keep] * x[c];
            for (int j = 0; j + 1 < keep; j++) sc[j] = sc[j + 1];
            if (keep) sc[keep - 1] = x[c];
            o[c] = y;
        }
    }
#pragma omp simd
    for (int c = c0; c < c1; c++) o[c] = o[c] / (1.f + mm_expf(-o[c]));
}

/* One token per sequence through the depthwise causal conv and SiLU, the conv state updated in
 * place. conv: [pool rows, channels, width - 1], contiguous; slots[b]: sequence b's row; x: row b
 * at x + b * x_stride, [channels]; weight: [channels, width]; out: [batch, channels]. Returns 0. */
int conv_step_(float *conv, const int64_t *slots, const float *x, int64_t x_stride, const float *weight,
               float *out, int64_t batch, int channels, int width, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (batch > 1)
    for (int64_t b = 0; b < batch; b++)
        conv_channels(conv + slots[b] * (int64_t)channels * (width - 1), x + b * x_stride, weight,
                      out + b * (int64_t)channels, 0, channels, width);
    return 0;
}

void gated_rms_norm(const float *x, const float *gate, const float *w, float *out, int64_t rows, int64_t cols,
                    float eps, int threads); /* cpu_elementwise.c */

#define CONV_CHUNK 1024 /* channels a thread takes at a time: a decode row's conv splits over threads */

/* A linear-attention layer's decode after its input projection, one call for what is otherwise
 * eight torch ops and three kernels: the conv step and SiLU (conv state in place), the write
 * strength beta = sigmoid(b) and decay g = -exp(A_log) softplus(a + dt_bias) (torch's softplus:
 * a + dt_bias past 20 passes through), the delta rule step (state in place), and the gated
 * RMSNorm of each head's output with z. Row b of mixed, z, b and a at `*_stride` apart (views into
 * one projection); out: [batch, heads * dv]. Returns 0, or -1 where scratch cannot be allocated. */
int gated_delta_decode_(float *conv, float *state, const int64_t *slots, const float *mixed, int64_t mixed_stride,
                        const float *z, int64_t z_stride, const float *b_in, const float *a_in, int64_t ba_stride,
                        const float *conv_weight, const float *a_log, const float *dt_bias, const float *norm_weight,
                        float eps, float *out, int64_t batch, int heads, int key_heads, int dk, int dv, int width,
                        int threads) {
    const int channels = 2 * key_heads * dk + heads * dv, chunks = (channels + CONV_CHUNK - 1) / CONV_CHUNK;
    float *y = malloc(sizeof(float) * (size_t)batch * channels);
    if (y == NULL) return -1;
#pragma omp parallel num_threads(threads) if (batch * heads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t bc = 0; bc < batch * chunks; bc++) {
            const int64_t b = bc / chunks;
            const int c0 = (int)(bc % chunks) * CONV_CHUNK, c1 = c0 + CONV_CHUNK < channels ? c0 + CONV_CHUNK : channels;
            conv_channels(conv + slots[b] * (int64_t)channels * (width - 1), mixed + b * mixed_stride, conv_weight,
                          y + b * (int64_t)channels, c0, c1, width);
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * heads; bh++) {
            const int64_t b = bh / heads;
            const int h = (int)(bh % heads);
            const float bt = 1.f / (1.f + expf(-b_in[b * ba_stride + h]));
            const float x = a_in[b * ba_stride + h] + dt_bias[h];
            const float g = -expf(a_log[h]) * (x > 20.f ? x : log1pf(expf(x)));
            float *o = out + b * (int64_t)heads * dv + (int64_t)h * dv;
            delta_head(state + (slots[b] * heads + h) * (int64_t)dk * dv, y + b * (int64_t)channels, h, key_heads,
                       heads / key_heads, dk, dv, expf(g), bt, o);
            gated_rms_norm(o, z + b * z_stride + (int64_t)h * dv, norm_weight, o, 1, dv, eps, 1);
        }
    }
    free(y);
    return 0;
}

/* A decoder layer's decode step in one call: the kernels its torch modules call one by one (the
 * norms, the projections, the linear-attention step, SiLU-and-multiply), in the same order and on
 * the same inputs, so the result is the one the modules compute, bit for bit. At batch 1 a step
 * of a small model spends as long in Python between the kernels as in them; this is that Python's
 * work done in C. The layer's weights come in plain structs built once (kernels/cpu_layer_decode.py);
 * each call brings the step's activations, state rows and one scratch buffer. */
#include <stddef.h>
#include <stdint.h>

/* One linear layer as its kernel reads it: kind 0 float32 panels (cpu_gemm.c), else a kind of
 * cpu_qgemm.c's low-bit panels with their scales and zero points, or with `a8` cpu_qgemm_a8.c's
 * panels for int8 inputs (each group's column sums `wsum` for int8 weights; `static_scale` NULL
 * for a scale per row). `bias` padded to whole panels. */
typedef struct {
    int kind, group, n, k;
    const void *weights;
    const float *scales, *zeros, *bias;
    int a8;
    const int32_t *wsum;
    const float *static_scale;
} mm_linear;

/* The post-attention half of a layer: the residual add and RMSNorm, gate and up in one matmul,
 * SiLU-and-multiply, down. `width`: the MLP's hidden size (gate_up has twice as many outputs). */
typedef struct {
    mm_linear gate_up, down;
    const float *norm;
    float eps;
    int width;
} mm_mlp;

/* A linear-attention (Gated DeltaNet) layer: input RMSNorm, the fused input projection (mixed q|k|v
 * before the conv, z, b, a side by side), the conv, gates, delta rule and gated norm of
 * cpu_linear_attention.c, the output projection, then the MLP half. */
typedef struct {
    mm_linear in_proj, out_proj;
    const float *in_norm, *conv_weight, *a_log, *dt_bias, *gate_norm;
    float eps, gate_eps;
    int hidden, heads, key_heads, dk, dv, conv_width;
    mm_mlp mlp;
} mm_delta_layer;

/* A full-attention layer of the decoder (models/layers/decoder.py): input RMSNorm, the fused q|k|v
 * projection, an RMSNorm over each head of q and k where the model has one (q_norm NULL: none), the
 * rotary over whole heads (rotate_half layout), the K/V write into the pool, paged decode
 * attention, the output projection, then the MLP half. */
typedef struct {
    mm_linear qkv, o;
    const float *in_norm, *q_norm, *k_norm;
    float eps, qk_eps, scale;
    int hidden, heads, kv_heads, dim;
    mm_mlp mlp;
} mm_attn_layer;

/* Where a step's K/V rows go and what each sequence's attention reads: the pool (`k_cache`,
 * `v_cache` and their block, slot and head strides), each row's slot, the block tables and
 * sequence lengths of cpu_decode.c. */
typedef struct {
    float *k_cache, *v_cache;
    int64_t block_stride, slot_stride, head_stride;
    int block_size, max_len;
    const int64_t *slots;
    const int32_t *tables;
    int64_t table_stride;
    const int32_t *lens;
} mm_kv_rows;

int gemm_panels(const float *x, int64_t ldx, const float *panels, const float *bias, float *y, int64_t ldy,
                int M, int N, int K, int threads);
int qgemm_panels(const float *x, int64_t ldx, const uint8_t *panels, int kind, const float *scales,
                 const float *zeros, int group, const float *bias, float *y, int64_t ldy, int M, int N, int K,
                 int threads);
int qgemm_a8_panels(const float *x, int64_t ldx, const float *static_scale, const uint8_t *panels, int kind,
                    const float *scales, const float *zeros, const int32_t *wsum, int group, const float *bias,
                    float *y, int64_t ldy, int M, int N, int K, int threads);
void rms_norm(const float *x, const float *delta, float *sum_out, const float *w, float *out, int64_t rows,
              int64_t cols, float eps, int threads);
void silu_and_mul(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t cols, int threads);
int gated_delta_decode_(float *conv, float *state, const int64_t *slots, const float *mixed, int64_t mixed_stride,
                        const float *z, int64_t z_stride, const float *b_in, const float *a_in, int64_t ba_stride,
                        const float *conv_weight, const float *a_log, const float *dt_bias, const float *norm_weight,
                        float eps, float *out, int64_t batch, int heads, int key_heads, int dk, int dv, int width,
                        int threads);

void rotary_(float *x, int64_t tokens, int heads, int64_t token_stride, int dim, const float *cos,
             const float *sin, int threads);
int write_kv(const float *key, int64_t k_token, int64_t k_head, const float *value, int64_t v_token,
             int64_t v_head, float *k_cache, float *v_cache, int64_t block_stride, int64_t slot_stride,
             int64_t head_stride, const int64_t *slots, int n, int kv_heads, int dim, int block_size,
             int threads);
int paged_decode(const float *q, const float *k_pool, const float *v_pool, const int32_t *tables,
                 int64_t table_stride, const int32_t *lens, float *out, int n, int heads, int kv_heads,
                 int block_size, int dim, float scale, int max_len, int threads);

static int linear(const mm_linear *l, const float *x, float *y, int M, int threads) {
    if (l->kind == 0) return gemm_panels(x, l->k, l->weights, l->bias, y, l->n, M, l->n, l->k, threads);
    if (l->a8) /* -2 (a kind this build does not take) cannot happen: the description checked it */
        return qgemm_a8_panels(x, l->k, l->static_scale, l->weights, l->kind, l->scales, l->zeros, l->wsum,
                               l->group, l->bias, y, l->n, M, l->n, l->k, threads) ? -1 : 0;
    return qgemm_panels(x, l->k, l->weights, l->kind, l->scales, l->zeros, l->group, l->bias, y, l->n, M, l->n,
                        l->k, threads);
}

/* A layer's input norm into `h`: of `x` for the first layer (no residual yet: x becomes it), else of
 * residual += x. Returns the residual stream. */
static float *input_norm(float *x, float *residual, const float *w, float eps, float *h, int M, int64_t H,
                         int threads) {
    if (residual == NULL) {
        rms_norm(x, NULL, x, w, h, M, H, eps, threads);
        return x;
    }
    rms_norm(residual, x, residual, w, h, M, H, eps, threads);
    return residual;
}

/* residual += mixed; out = down(silu(gate) * up) of the norm of the sum. `scratch`: M x (hidden +
 * 3 width) floats. Returns 0, or -1 where a kernel could not allocate its scratch. */
int mlp_decode(const mm_mlp *m, float *residual, const float *mixed, float *scratch, float *out, int hidden, int M,
               int threads) {
    float *h = scratch, *gate_up = h + (int64_t)M * hidden, *act = gate_up + (int64_t)M * 2 * m->width;
    rms_norm(residual, mixed, residual, m->norm, h, M, hidden, m->eps, threads);
    if (linear(&m->gate_up, h, gate_up, M, threads)) return -1;
    silu_and_mul(gate_up, 2 * (int64_t)m->width, act, M, m->width, threads);
    return linear(&m->down, act, out, M, threads);
}

/* One decode token of each of M sequences through a linear-attention layer. `x` [M, hidden] the
 * layer's input, `residual` the residual stream (updated in place; NULL for the first layer, whose
 * input then becomes it, as in the modules); conv and state: the layer's state pool tensors, row
 * slots[b] for sequence b (updated in place); `scratch` M x (3 hidden + in_proj.n + heads dv +
 * 3 mlp.width) floats; `out` [M, hidden] the layer's output. Returns 0, or -1 where a kernel could
 * not allocate its scratch. */
int delta_layer_decode(const mm_delta_layer *L, float *x, float *residual, float *conv, float *state,
                       const int64_t *slots, float *scratch, float *out, int M, int threads) {
    const int64_t H = L->hidden, P = L->in_proj.n, values = (int64_t)L->heads * L->dv;
    const int64_t channels = 2 * (int64_t)L->key_heads * L->dk + values;
    float *h = scratch, *proj = h + M * H, *attn = proj + M * P, *mixed = attn + M * values;
    float *rest = mixed + M * H;
    residual = input_norm(x, residual, L->in_norm, L->eps, h, M, H, threads);
    if (linear(&L->in_proj, h, proj, M, threads)) return -1;
    const float *z = proj + channels, *b = z + values, *a = b + L->heads;
    if (gated_delta_decode_(conv, state, slots, proj, P, z, P, b, a, P, L->conv_weight, L->a_log, L->dt_bias,
                            L->gate_norm, L->gate_eps, attn, M, L->heads, L->key_heads, L->dk, L->dv,
                            L->conv_width, threads))
        return -1;
    if (linear(&L->out_proj, attn, mixed, M, threads)) return -1;
    return mlp_decode(&L->mlp, residual, mixed, rest, out, (int)H, M, threads);
}

/* One decode token of each of M sequences through a full-attention layer, as the modules compute
 * it. `x`, `residual`, `scratch`, `out` as for delta_layer_decode; `cos`, `sin` [M, dim / 2] the
 * step's rotary angles; `kv` where the rows' keys and values go. `scratch`: M x (3 hidden + qkv.n
 * + 2 heads dim + kv_heads dim + 3 mlp.width) floats. Returns 0, or -1 where a kernel could not
 * run (its scratch, or a head shape the decode kernel does not take: the caller checks those). */
int attn_layer_decode(const mm_attn_layer *L, float *x, float *residual, const float *cos, const float *sin,
                      const mm_kv_rows *kv, float *scratch, float *out, int M, int threads) {
    const int64_t H = L->hidden, P = L->qkv.n, D = L->dim;
    const int64_t qn = (int64_t)L->heads * D, kn = (int64_t)L->kv_heads * D;
    float *h = scratch, *proj = h + M * H, *q = proj + M * P, *k = q + M * qn, *att = k + M * kn;
    float *mixed = att + M * qn, *rest = mixed + M * H;
    residual = input_norm(x, residual, L->in_norm, L->eps, h, M, H, threads);
    if (linear(&L->qkv, h, proj, M, threads)) return -1;
    int64_t k_token = P;
    const float *keys = proj + qn;
    if (L->q_norm) { /* each head of q and k normalised into rows of their own, then turned there */
        for (int m = 0; m < M; m++) {
            rms_norm(proj + m * P, NULL, NULL, L->q_norm, q + m * qn, L->heads, D, L->qk_eps, threads);
            rms_norm(proj + m * P + qn, NULL, NULL, L->k_norm, k + m * kn, L->kv_heads, D, L->qk_eps, threads);
        }
        rotary_(q, M, L->heads, qn, (int)D, cos, sin, threads);
        rotary_(k, M, L->kv_heads, kn, (int)D, cos, sin, threads);
        keys = k, k_token = kn;
    } else { /* q and k turned in place side by side, q then copied out as the decode kernel reads it */
        rotary_(proj, M, L->heads + L->kv_heads, P, (int)D, cos, sin, threads);
        for (int m = 0; m < M; m++)
            for (int64_t i = 0; i < qn; i++) q[m * qn + i] = proj[m * P + i];
    }
    write_kv(keys, k_token, D, proj + qn + kn, P, D, kv->k_cache, kv->v_cache, kv->block_stride, kv->slot_stride,
             kv->head_stride, kv->slots, M, L->kv_heads, (int)D, kv->block_size, threads);
    if (paged_decode(q, kv->k_cache, kv->v_cache, kv->tables, kv->table_stride, kv->lens, att, M, L->heads,
                     L->kv_heads, kv->block_size, (int)D, L->scale, kv->max_len, threads))
        return -1;
    if (linear(&L->o, att, mixed, M, threads)) return -1;
    return mlp_decode(&L->mlp, residual, mixed, rest, out, (int)H, M, threads);
}

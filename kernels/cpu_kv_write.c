/* Writes a step's new K and V rows into their pool slots, for the CPU path.
 *
 * Token i's key (kv_heads rows of head_dim floats, each row contiguous, at any token and head
 * stride: a view into the fused q/k/v projection) goes to slot slots[i] of the pool: block
 * slots[i] / block_size, offset slots[i] % block_size, addressed by the pool's block, slot and head
 * strides; likewise its value. Slots below zero (padding) are skipped.
 *
 * torch's index_put_ took about 60 us per call for a decode step's 64 rows, most of it indexing
 * overhead; a plain row copy is a few microseconds. Large writes (prefill chunks) are split
 * between threads by token.
 *
 * Built by kernels/cpu_build.py, once per ISA variant.
 */
#include <stdint.h>
#include <string.h>

#define PARALLEL_ROWS 256 /* below this, one thread: the copy is shorter than waking the others */

int write_kv(const float *key, int64_t k_token, int64_t k_head, const float *value, int64_t v_token,
             int64_t v_head, float *k_cache, float *v_cache, int64_t block_stride, int64_t slot_stride,
             int64_t head_stride, const int64_t *slots, int n, int kv_heads, int dim, int block_size,
             int threads) {
    const size_t bytes = sizeof(float) * dim;
#pragma omp parallel for num_threads(threads) if (n >= PARALLEL_ROWS) schedule(static)
    for (int i = 0; i < n; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        const int64_t at = slot / block_size * block_stride + slot % block_size * slot_stride;
        for (int h = 0; h < kv_heads; h++) {
            memcpy(k_cache + at + h * head_stride, key + i * k_token + h * k_head, bytes);
            memcpy(v_cache + at + h * head_stride, value + i * v_token + h * v_head, bytes);
        }
    }
    return 0;
}

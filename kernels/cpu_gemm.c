/* y = x W^T + b for the language model's linear layers on CPU, with W packed once at load time.
 *
 * Why not oneDNN (which the vision tower keeps): a decode step multiplies a few to 64 rows by every
 * weight of the model, so each weight is read from memory once per step and used by few rows.
 * oneDNN's packed sgemm there reached 15-16 GB/s at 1-8 rows (the machine copies at 30) and
 * 150-175 GFLOP/s at 32-64 rows (its square-matrix rate is about 219). This kernel streams each
 * weight once per call and reuses it from cache across all rows; at 2048 rows (a prefill chunk) it
 * is within a few percent of oneDNN on the model's shapes.
 *
 * Layout: W [N][K] is packed as panels of NR output columns, [ceil(N / NR)][K][NR] (N padded with
 * zero columns; the bias padded alike), so a panel's weights for one k are NV vectors in a row.
 * NR follows the variant's registers (`gemm_panel_width()` tells the packer): AVX-512 tiles are
 * 8 rows x 3 vectors (NR = 48: 24 accumulators, 3 weights and a broadcast of its 32 registers),
 * AVX2 and portable tiles the classic 6 rows x 2 vectors (NR = 16 or 8: 12 + 2 + 1 of 16).
 *
 * Work: the panels are split evenly between the threads (each streams its own weights). Per block
 * of MC rows and KC of K, each panel's KC x NR weights (144 KiB at KC = 768 on AVX-512) are reused
 * from L2 by every strip of up to MR rows, a register tile of MR rows x NR columns fed by NV
 * weight vectors and a broadcast of each row's x per k. A block's rows are cut into strips of
 * near-equal height (20 rows: 3 strips of 6-7, not 2 of 8 and one of 4). On AVX-512, against
 * tiles of 12 rows x 32 columns (two vectors, more broadcasts per multiply-add), 8 x 48 ran 64
 * rows at 196-209 against 193-207 GFLOP/s, 16 rows at 175 against 141-175, and the 2048 x 576 x
 * 3072 MLP projection at 216 against 207-211.
 *
 * Built by kernels/cpu_build.py, once per ISA variant (cpu_simd.h).
 */
#include <omp.h>

#include "cpu_simd.h"

#define NV PANEL_VECTORS /* vectors of output columns per panel */
#define MR TILE_ROWS     /* rows per register tile, at most */
#define NR (NV * LANES)  /* output columns per panel */
#define MC 96           /* rows per block */
#define KC 768          /* K per block: larger K is summed block by block through y */

int gemm_panel_width(void) { return NR; }

/* R rows x NR columns of y = init + x[:, :k_len] w, w one panel's k_len x NR weights. init (row
 * stride ldi; 0 repeats one row, the bias) is the bias, an earlier K block's sums, or none (zero).
 * Only the first ncols columns are stored (a panel past N's end). */
#define GEMM_TILE(NAME, R)                                                                              \
    static __attribute__((noinline)) void NAME(const float *x, int64_t ldx, const float *w, int k_len,    \
                                               const float *init, int64_t ldi, float *y, int64_t ldy,     \
                                               int ncols) {                                               \
        vec a[R][NV];                                                                                     \
        for (int r = 0; r < R; r++)                                                                       \
            for (int c = 0; c < NV; c++) a[r][c] = init ? load(init + r * ldi + c * LANES) : (vec){};     \
        for (int k = 0; k < k_len; k++, w += NR) {                                                        \
            vec wk[NV];                                                                                   \
            prefetch_ahead(w, NR * 4);                                                                    \
            for (int c = 0; c < NV; c++) wk[c] = load(w + c * LANES);                                     \
            for (int r = 0; r < R; r++) {                                                                 \
                const vec xr = splat(x[r * ldx + k]);                                                     \
                for (int c = 0; c < NV; c++) a[r][c] += xr * wk[c];                                       \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < R; r++) {                                                                     \
            if (ncols == NR) {                                                                            \
                for (int c = 0; c < NV; c++) store(y + r * ldy + c * LANES, a[r][c]);                     \
            } else {                                                                                      \
                float row[NR];                                                                            \
                for (int c = 0; c < NV; c++) store(row + c * LANES, a[r][c]);                             \
                memcpy(y + r * ldy, row, sizeof(float) * ncols);                                          \
            }                                                                                             \
        }                                                                                                 \
    }
GEMM_TILE(tile1, 1)
GEMM_TILE(tile2, 2)
GEMM_TILE(tile3, 3)
GEMM_TILE(tile4, 4)
GEMM_TILE(tile5, 5)
GEMM_TILE(tile6, 6)
typedef void (*tile_fn)(const float *, int64_t, const float *, int, const float *, int64_t, float *, int64_t, int);
#if WIDE_REGISTERS
GEMM_TILE(tile7, 7)
GEMM_TILE(tile8, 8)
static const tile_fn TILES[MR + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8};
#else
static const tile_fn TILES[MR + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6};
#endif

/* y [M][N] (row stride ldy) = x [M][K] (row stride ldx) W^T + bias; `panels` from the packing
 * above, `bias` (padded to whole panels) may be NULL. */
int gemm_panels(const float *x, int64_t ldx, const float *panels, const float *bias, float *y, int64_t ldy,
                int M, int N, int K, int threads) {
    const int n_panels = (N + NR - 1) / NR;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int64_t)n_panels * t / nt, p1 = (int64_t)n_panels * (t + 1) / nt;
        float edge[MR * NR] = {0}; /* a partial panel's earlier sums, read back whole */
        for (int m0 = 0; m0 < M; m0 += MC) {
            const int rows = M - m0 < MC ? M - m0 : MC, strips = (rows + MR - 1) / MR;
            for (int k0 = 0; k0 < K; k0 += KC) {
                const int k_len = K - k0 < KC ? K - k0 : KC;
                for (int p = p0; p < p1; p++) {
                    const int ncols = N - p * NR < NR ? N - p * NR : NR;
                    const float *w = panels + ((int64_t)p * K + k0) * NR;
                    for (int s = 0, m = m0; s < strips; s++) {
                        const int r = rows * (s + 1) / strips - rows * s / strips;
                        float *out = y + m * ldy + p * NR;
                        const float *init = k0 ? out : bias ? bias + p * NR : NULL;
                        int64_t ldi = k0 ? ldy : 0;
                        if (k0 && ncols < NR) {
                            for (int i = 0; i < r; i++) memcpy(edge + i * NR, out + i * ldy, sizeof(float) * ncols);
                            init = edge, ldi = NR;
                        }
                        TILES[r](x + m * ldx + k0, ldx, w, k_len, init, ldi, out, ldy, ncols);
                        m += r;
                    }
                }
            }
        }
    }
    return 0;
}

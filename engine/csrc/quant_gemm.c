/* y[M, N] = x[M, K] @ W[K, N] for a weight held in GGUF's quantized groups of 32 inputs:
 *   Q4_1: W[k, n] = d[n, g] * q[n, k] + m[n, g], q in 0..15, d and m float16;
 *   Q8_0: W[k, n] = d[n, g] * q[n, k],           q in -128..127, d float16;
 * with g = k / 32.
 *
 * Layout (engine/quantized.py packs it): N in tiles of 16 outputs; for each tile, its K / 32
 * groups one after another. A Q4_1 group is 320 bytes: d[16] and m[16] as float16, then 16 rows
 * of 16 bytes, row p holding q[k = 2p] in the low nibble and q[k = 2p + 1] in the high one, a byte
 * per output. A Q8_0 group is 544 bytes: d[16] as float16, then 32 rows of 16 signed bytes.
 *
 * Each weight is rebuilt in float32 with one fused multiply-add, which gives exactly the float32
 * value d * q + m (d * q is exact: 11 by at most 8 significant bits), then multiplied into up to
 * 16 rows of x held in registers (more rows: see BUF_MIN). Each group's 32 products are summed in registers, then added to
 * the row's total: float32 throughout, rounding like a blocked GEMM. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 16
#define GROUP 32
#define MAX_R 26
/* From BUF_MIN rows on, each group is rebuilt once into a buffer and multiplied into blocks of at
 * most BLOCK_R rows; below, the rows stay in registers while each weight is rebuilt. Measured on
 * the 2-core AMD EPYC (Zen 5) of BENCHMARKS.md, session 11, over the default model's 30 gate/up
 * weights: 17-23 rows 324-334 -> 359-385 GFLOP/s, 24-64 rows 305-372 -> 370-387, and no gain at
 * 16 rows or fewer (blocks of 8 rows from the buffer were slower than registers). */
#define BUF_MIN 17
#define BLOCK_R 16
#define Q4_1 0
#define Q8_0 1

int quant_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 1 : 0;
}

#define TARGET __attribute__((target("avx512f,avx512bw,f16c,fma")))

static inline int group_bytes(int fmt) { return fmt == Q4_1 ? 320 : 544; }

/* R rows (xt: x transposed for them, xt[k * ldx + r]) times one tile of 16 outputs. */
TARGET __attribute__((always_inline)) static inline void
tile_rows(const int fmt, const uint8_t *wt, int groups, const float *xt, const int R, int ldx, float *y, int ldy) {
    __m512 acc[MAX_R];
#pragma GCC unroll 26
    for (int r = 0; r < MAX_R; r++)
        if (r < R) _mm512_storeu_ps(y + (size_t)r * ldy, _mm512_setzero_ps());
    const __m512i low = _mm512_set1_epi32(0xF);
    for (int g = 0; g < groups; g++, wt += group_bytes(fmt)) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)wt));
        const __m512 m = fmt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wt + 32)))
                                     : _mm512_setzero_ps();
        const uint8_t *q = wt + (fmt == Q4_1 ? 64 : 32);
        const float *xk = xt + (size_t)g * GROUP * ldx;
#pragma GCC unroll 26
        for (int r = 0; r < MAX_R; r++)
            if (r < R) acc[r] = _mm512_setzero_ps();
        for (int p = 0; p < GROUP / 2; p++, xk += 2 * ldx) {
            __m512i q0, q1;
            if (fmt == Q4_1) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
                q0 = _mm512_and_si512(b, low);
                q1 = _mm512_srli_epi32(b, 4);
                q += TILE;
            } else {
                q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
                q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + TILE)));
                q += 2 * TILE;
            }
            const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), d, m);
            const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d, m);
#pragma GCC unroll 26
            for (int r = 0; r < MAX_R; r++)
                if (r < R) {
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[r]), w0, acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[ldx + r]), w1, acc[r]);
                }
        }
#pragma GCC unroll 26
        for (int r = 0; r < MAX_R; r++)
            if (r < R) {
                float *yr = y + (size_t)r * ldy;
                _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr), acc[r]));
            }
    }
}

/* A group of one tile rebuilt once into wb[32] (32 inputs x 16 outputs, in L1), for several row
 * blocks to use: from BUF_MIN rows on, they share the rebuilding instead of repeating it per block. */
TARGET __attribute__((always_inline)) static inline void
dequant_group(const int fmt, const uint8_t *wg, __m512 *wb) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)wg));
    const __m512 m = fmt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wg + 32)))
                                 : _mm512_setzero_ps();
    const uint8_t *q = wg + (fmt == Q4_1 ? 64 : 32);
    const __m512i low = _mm512_set1_epi32(0xF);
    for (int p = 0; p < GROUP / 2; p++) {
        __m512i q0, q1;
        if (fmt == Q4_1) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + p * TILE)));
            q0 = _mm512_and_si512(b, low);
            q1 = _mm512_srli_epi32(b, 4);
        } else {
            q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 2 * p * TILE)));
            q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + (2 * p + 1) * TILE)));
        }
        wb[2 * p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), d, m);
        wb[2 * p + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d, m);
    }
}

/* R rows times one rebuilt group, added to their totals in y (same order of additions as
 * tile_rows: the group's 32 products in k order, then the group's sum into the total). */
TARGET __attribute__((always_inline)) static inline void
block_group(const __m512 *wb, const float *xk, const int R, int ldx, float *y, int ldy) {
    __m512 acc[MAX_R];
#pragma GCC unroll 26
    for (int r = 0; r < MAX_R; r++)
        if (r < R) acc[r] = _mm512_setzero_ps();
    for (int k = 0; k < GROUP; k++, xk += ldx) {
        const __m512 w = wb[k];
#pragma GCC unroll 26
        for (int r = 0; r < MAX_R; r++)
            if (r < R) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[r]), w, acc[r]);
    }
#pragma GCC unroll 26
    for (int r = 0; r < MAX_R; r++)
        if (r < R) {
            float *yr = y + (size_t)r * ldy;
            _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr), acc[r]));
        }
}

#define BCASE(R) case R: block_group(wb, xk, R, ldx, y, ldy); break;

TARGET static void
block(const __m512 *wb, const float *xk, int R, int ldx, float *y, int ldy) {
    switch (R) {
        BCASE(1) BCASE(2) BCASE(3) BCASE(4) BCASE(5) BCASE(6) BCASE(7) BCASE(8) BCASE(9) BCASE(10)
        BCASE(11) BCASE(12) BCASE(13) BCASE(14) BCASE(15) BCASE(16) BCASE(17) BCASE(18) BCASE(19)
        BCASE(20) BCASE(21) BCASE(22) BCASE(23) BCASE(24) BCASE(25) BCASE(26)
    }
}

/* All M rows (BUF_MIN or more) times one tile: per group, rebuild once, then each block of rows. */
TARGET static void
tile_blocks(int fmt, const uint8_t *wt, int groups, const float *xt, int M, int blocks, float *y, int ldy) {
    __m512 wb[GROUP];
    for (int r = 0; r < M; r++)
        for (int c = 0; c < TILE; c++) y[(size_t)r * ldy + c] = 0.0f;
    for (int g = 0; g < groups; g++, wt += group_bytes(fmt)) {
        if (fmt == Q4_1) dequant_group(Q4_1, wt, wb);
        else dequant_group(Q8_0, wt, wb);
        const float *xk = xt + (size_t)g * GROUP * M;
        for (int b = 0; b < blocks; b++) {
            const int r0 = (int)((long)M * b / blocks), r1 = (int)((long)M * (b + 1) / blocks);
            block(wb, xk + r0, r1 - r0, M, y + (size_t)r0 * ldy, ldy);
        }
    }
}

/* one specialised copy per format and row count, so that the accumulators live in registers */
#define CASE(R)                                                   \
    case R:                                                       \
        if (fmt == Q4_1) tile_rows(Q4_1, wt, groups, xt, R, ldx, y, ldy); \
        else tile_rows(Q8_0, wt, groups, xt, R, ldx, y, ldy);    \
        break;

TARGET static void
tile(int fmt, const uint8_t *wt, int groups, const float *xt, int R, int ldx, float *y, int ldy) {
    switch (R) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10)
        CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16) CASE(17) CASE(18) CASE(19) CASE(20)
        CASE(21) CASE(22) CASE(23) CASE(24) CASE(25) CASE(26)
    }
}

/* x [M, K] row-major, w packed in format fmt, y [M, N] row-major; K a multiple of 32, N of 16. */
TARGET void
quant_gemm(int fmt, const float *x, int M, int K, const uint8_t *w, int N, float *y, int threads) {
    /* x transposed, xt[k * M + r], so that one k's rows lie together (a thread's own buffer) */
    static __thread float *xt = NULL;
    static __thread size_t xt_size = 0;
    const size_t need = (size_t)K * M;
    if (need > xt_size) {
        free(xt);
        xt = malloc(need * sizeof(float));
        xt_size = xt ? need : 0;
        if (!xt) return;
    }
    const int groups = K / GROUP, tiles = N / TILE;
    const size_t tile_bytes = (size_t)groups * group_bytes(fmt);
    const int blocks = M >= BUF_MIN ? (M + BLOCK_R - 1) / BLOCK_R : 1;
    for (int k = 0; k < K; k++)
        for (int r = 0; r < M; r++) xt[(size_t)k * M + r] = x[(size_t)r * K + k];
    float *xtp = xt;
    if (M < BUF_MIN) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int j = 0; j < tiles; j++)
            tile(fmt, w + (size_t)j * tile_bytes, groups, xtp, M, M, y + (size_t)j * TILE, N);
    } else {
        /* rows split evenly over the blocks: 40 rows go as 14 + 13 + 13, not 16 + 16 + 8 */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int j = 0; j < tiles; j++)
            tile_blocks(fmt, w + (size_t)j * tile_bytes, groups, xtp, M, blocks, y + (size_t)j * TILE, N);
    }
}

/* Causal attention of one prefill chunk, float32, on CPUs with AVX-512.
 *
 *   out[i, h, :] = softmax_j(q[i, h, :] . k[j, h / G, :] * scale) @ v[j, h / G, :]
 *
 * over keys j = 0 .. off + i, where off = Lk - Lq: query i of the chunk sits at position off + i
 * of its sequence (off = 0 for a whole prompt; a later chunk also sees the keys before it). G =
 * H / KVH query heads share a key/value head (grouped-query attention).
 *
 * Flash-attention style: each task takes 16 query rows of one head and walks the keys in blocks of
 * 16, keeping for each row a running maximum, a running sum and an unnormalised output (online
 * softmax), so nothing of size Lq x Lk is stored. The scores of a 16 x 16 tile are 16 vector
 * accumulators (one per row, a lane per key) fed by the keys transposed once per call (kt below),
 * so the inner loop is one load and 16 fused multiply-adds per head dimension. Blocks past a
 * row's last key are skipped or masked. Exponentials are a degree-7 polynomial after a Cody-Waite
 * reduction (a few ulp, like the decode kernel's); everything is float32 and no fast-math
 * reassociation is asked of the compiler. Results agree with torch's scaled_dot_product_attention
 * to float32 rounding (tests/engine/test_prefill_attention.py).
 *
 * Tasks (16 rows x 1 head) are spread over `threads` OpenMP threads, the longest (last rows) first.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QB 16   /* query rows per task */
#define KB 16   /* keys per block: one vector of scores per row */
#define MAXD 256
#define DC 16   /* dimensions per run of a dot product (D is a multiple) */

int attn_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") ? 1 : 0;
}

#define TARGET __attribute__((target("avx512f,avx512dq,fma")))

/* exp(x) for x <= 0 (a score minus its row's maximum); below -87 it gives exp(-87). */
TARGET static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, k);
}

typedef struct {
    int Lq, Lk, H, KVH, D, Lkp, off;
    const float *q, *v, *kt;
    long q_stride, v_stride, out_stride;
    float *out;
    float scale;
} job_t;

/* acc[0 .. D) += sum_j p[j] * v[j] for nk keys, v rows v_stride apart (4 vectors at a time). */
TARGET static inline void accumulate(float *acc, const float *p, const float *v, long v_stride, int nk, int D) {
    int dc = 0;
    for (; dc + 64 <= D; dc += 64) {
        __m512 a0 = _mm512_load_ps(acc + dc), a1 = _mm512_load_ps(acc + dc + 16);
        __m512 a2 = _mm512_load_ps(acc + dc + 32), a3 = _mm512_load_ps(acc + dc + 48);
        const float *vr = v + dc;
        for (int j = 0; j < nk; j++, vr += v_stride) {
            const __m512 pj = _mm512_set1_ps(p[j]);
            a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr), a0);
            a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16), a1);
            a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 32), a2);
            a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 48), a3);
        }
        _mm512_store_ps(acc + dc, a0);
        _mm512_store_ps(acc + dc + 16, a1);
        _mm512_store_ps(acc + dc + 32, a2);
        _mm512_store_ps(acc + dc + 48, a3);
    }
    for (; dc < D; dc += 16) {
        __m512 a = _mm512_load_ps(acc + dc);
        const float *vr = v + dc;
        for (int j = 0; j < nk; j++, vr += v_stride) a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(vr), a);
        _mm512_store_ps(acc + dc, a);
    }
}

TARGET static void attend_tile(const job_t *J, int h, int qb) {
    const int D = J->D, Lkp = J->Lkp;
    const int kh = h / (J->H / J->KVH);
    const int r0 = qb * QB;
    const int rows = J->Lq - r0 < QB ? J->Lq - r0 : QB;
    const float *kt = J->kt + (size_t)kh * D * Lkp;
    const float *vh = J->v + (size_t)kh * D;
    float qs[QB][MAXD] __attribute__((aligned(64)));
    float acc[QB][MAXD] __attribute__((aligned(64)));
    float p[QB][KB] __attribute__((aligned(64)));
    float m[QB], l[QB];
    int live[QB];
    for (int r = 0; r < QB; r++) {
        const float *qr = J->q + (long)(r0 + r) * J->q_stride + (size_t)h * D;
        for (int d = 0; d < D; d++) qs[r][d] = r < rows ? qr[d] * J->scale : 0.0f;
        memset(acc[r], 0, sizeof(float) * D);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int last = J->off + r0 + rows - 1; /* the last key any row of the tile sees */
    const int kend = last + 1 < J->Lk ? last + 1 : J->Lk;
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int j0 = 0; j0 < kend; j0 += KB) {
        /* each row's dot products summed by runs of DC dimensions, then across runs (a long
         * single chain of fused multiply-adds would round more than a blocked GEMM does) */
        __m512 s[QB];
#pragma GCC unroll 16
        for (int r = 0; r < QB; r++) s[r] = _mm512_setzero_ps();
        const float *kd = kt + j0;
        for (int d0 = 0; d0 < D; d0 += DC) {
            __m512 t[QB];
#pragma GCC unroll 16
            for (int r = 0; r < QB; r++) t[r] = _mm512_setzero_ps();
            for (int d = d0; d < d0 + DC; d++, kd += Lkp) {
                const __m512 kv = _mm512_load_ps(kd);
#pragma GCC unroll 16
                for (int r = 0; r < QB; r++) t[r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r][d]), kv, t[r]);
            }
#pragma GCC unroll 16
            for (int r = 0; r < QB; r++) s[r] = _mm512_add_ps(s[r], t[r]);
        }
        /* a key of this block is masked for some row when it lies past the first row's last key */
        const int partial = j0 + KB - 1 > J->off + r0 || j0 + KB > J->Lk;
        const __m512i lane = _mm512_add_epi32(_mm512_set1_epi32(j0), iota);
        for (int r = 0; r < rows; r++) {
            __mmask16 ok = 0xFFFF;
            if (partial) {
                int lim = J->off + r0 + r;
                if (lim > J->Lk - 1) lim = J->Lk - 1;
                ok = _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32(lim));
            }
            live[r] = ok != 0;
            if (!ok) continue;
            const __m512 sr = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), ok, s[r]);
            const float bm = _mm512_reduce_max_ps(sr);
            const float mn = bm > m[r] ? bm : m[r];
            const __m512 pr = _mm512_maskz_mov_ps(ok, exp512(_mm512_sub_ps(sr, _mm512_set1_ps(mn))));
            _mm512_store_ps(p[r], pr);
            if (mn != m[r]) {
                const float alpha = expf(m[r] - mn); /* 0 on the first block (m = -inf) */
                l[r] *= alpha;
                const __m512 a = _mm512_set1_ps(alpha);
                for (int d = 0; d < D; d += 16) _mm512_store_ps(acc[r] + d, _mm512_mul_ps(a, _mm512_load_ps(acc[r] + d)));
                m[r] = mn;
            }
            l[r] += _mm512_reduce_add_ps(pr);
        }
        const int nk = kend - j0 < KB ? kend - j0 : KB;
        const float *vb = vh + (long)j0 * J->v_stride;
        for (int r = 0; r < rows; r++)
            if (live[r]) accumulate(acc[r], p[r], vb, J->v_stride, nk, D);
    }
    for (int r = 0; r < rows; r++) {
        float *o = J->out + (long)(r0 + r) * J->out_stride + (size_t)h * D;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < D; d++) o[d] = acc[r][d] * inv;
    }
}

/* q [Lq, H, D], k and v [Lk, KVH, D], out [Lq, H, D]: each with its own token stride (elements),
 * heads D apart, dimensions contiguous. Needs D % 16 == 0, D <= 256, Lk >= Lq, H % KVH == 0.
 * Returns 0, or -1 if scratch memory could not be had. */
TARGET int attn_prefill(int Lq, int Lk, int H, int KVH, int D, const float *q, long q_stride, const float *k,
                        long k_stride, const float *v, long v_stride, float *out, long out_stride, float scale,
                        int threads) {
    const int Lkp = (Lk + KB - 1) / KB * KB;
    float *kt = aligned_alloc(64, (size_t)KVH * D * Lkp * sizeof(float));
    if (!kt) return -1;
    /* the keys transposed per KV head, kt[(kh * D + d) * Lkp + j] = k[j, kh, d], zero past Lk;
     * 16 keys at a time, so that every write fills whole cache lines */
    const int nkb = Lkp / KB;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int kh = 0; kh < KVH; kh++)
        for (int b = 0; b < nkb; b++) {
            float *t = kt + (size_t)kh * D * Lkp + (size_t)b * KB;
            for (int d = 0; d < D; d++)
                for (int j = 0; j < KB; j++) {
                    const int jj = b * KB + j;
                    t[(size_t)d * Lkp + j] = jj < Lk ? k[(long)jj * k_stride + (size_t)kh * D + d] : 0.0f;
                }
        }
    job_t J = {Lq, Lk, H, KVH, D, Lkp, Lk - Lq, q, v, kt, q_stride, v_stride, out_stride, out, scale};
    const int nqb = (Lq + QB - 1) / QB;
    const long tasks = (long)H * nqb;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long t = 0; t < tasks; t++) attend_tile(&J, (int)(t % H), nqb - 1 - (int)(t / H));
    free(kt);
    return 0;
}

/* Batch-1 GEMVs on AVX-512 CPUs: y[N] = W[N,K] x[K] (+ bias), for bfloat16 and float32 weights.
 *
 * W is repacked once into "VNNI" pairs so the whole matrix is read as one sequential stream and
 * every 64-byte load feeds one vdpbf16ps (16 rows x 2 k):
 *
 *     P[N/16][K/2][16][2]      P[b][k2][r][j] = W[16 b + r][2 k2 + j]
 *
 * Accumulation is float32; the result is rounded to bfloat16 (nearest even).  */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

void tm_gemv_bf16_vnni(const uint16_t *P, const uint16_t *x, const uint16_t *bias, uint16_t *y,
                       int64_t N, int64_t K, int nthreads) {
    const int64_t K2 = K / 2;
    const uint32_t *xpairs = (const uint32_t *)x;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const uint16_t *blk = P + b * K * 16;
        /* four independent accumulators hide the dot-product latency */
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        int64_t k2 = 0;
        for (; k2 + 4 <= K2; k2 += 4) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(blk + (k2 + 0) * 32), (__m512bh)_mm512_set1_epi32(xpairs[k2 + 0]));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(blk + (k2 + 1) * 32), (__m512bh)_mm512_set1_epi32(xpairs[k2 + 1]));
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(blk + (k2 + 2) * 32), (__m512bh)_mm512_set1_epi32(xpairs[k2 + 2]));
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(blk + (k2 + 3) * 32), (__m512bh)_mm512_set1_epi32(xpairs[k2 + 3]));
        }
        for (; k2 < K2; k2++)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(blk + k2 * 32), (__m512bh)_mm512_set1_epi32(xpairs[k2]));
        float out[16];
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        for (int r = 0; r < 16; r++) {
            float v = out[r];
            if (bias) v += bf16_to_f32(bias[b * 16 + r]);
            y[b * 16 + r] = f32_to_bf16(v);
        }
    }
}

/* float32: W is repacked into 16-row panels, so each 64-byte load feeds one FMA and the matrix is
 * read as one sequential stream:
 *
 *     P[N/16][K][16]      P[b][k][r] = W[16 b + r][k]
 */
void tm_gemv_f32(const float *P, const float *x, const float *bias, float *y, int64_t N, int64_t K, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const float *blk = P + b * K * 16;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 4 <= K; k += 4) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(blk + (k + 0) * 16), _mm512_set1_ps(x[k + 0]), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(blk + (k + 1) * 16), _mm512_set1_ps(x[k + 1]), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(blk + (k + 2) * 16), _mm512_set1_ps(x[k + 2]), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(blk + (k + 3) * 16), _mm512_set1_ps(x[k + 3]), a3);
        }
        for (; k < K; k++)
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(blk + k * 16), _mm512_set1_ps(x[k]), a0);
        __m512 acc = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
        if (bias)
            acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + b * 16));
        _mm512_storeu_ps(y + b * 16, acc);
    }
}

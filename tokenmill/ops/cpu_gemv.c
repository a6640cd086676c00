/* Batch-1 GEMVs: y[N] = W[N,K] x[K] (+ bias), for bfloat16 and float32 weights.
 *
 * W is repacked once into "VNNI" pairs so the whole matrix is read as one sequential stream and
 * every 64-byte load feeds one vdpbf16ps (16 rows x 2 k):
 *
 *     P[N/16][K/2][16][2]      P[b][k2][r][j] = W[16 b + r][2 k2 + j]
 *
 * Accumulation is float32; the result is rounded to bfloat16 (nearest even).
 *
 * Each kernel has an AVX-512 path (intrinsics; bf16 needs AVX512-BF16) and a portable one: plain loops
 * over the 16 rows of a panel that gcc -O3 -march=native vectorizes (two AVX2 FMAs per 16 rows), with
 * several accumulator panels so consecutive FMAs do not wait on each other. Same layouts either way. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "rows.h"
#include "stream.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
void tm_gemv_bf16_vnni(const uint16_t *P, const uint16_t *x, const uint16_t *bias, uint16_t *y,
                       int64_t N, int64_t K, int nthreads) {
    const int64_t K2 = K / 2;
    const uint32_t *xpairs = (const uint32_t *)x;
    /* guided, as the int8 GEMV (ops/cpu_qgemv.c): evens out two streams of different speeds, 1.005-1.05x */
    #pragma omp parallel for num_threads(nthreads) schedule(guided)
    for (int64_t b = 0; b < N / 16; b++) {
        const uint16_t *blk = P + b * K * 16;
        /* four independent accumulators hide the dot-product latency */
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        int64_t k2 = 0;
        for (; k2 + 4 <= K2; k2 += 4) {  /* four 64-byte lines */
            for (int j = 0; j < 4; j++) STREAM_PREFETCH(blk + (k2 + j) * 32);
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

#else
/* Each uint32 of a panel holds one row's pair (low half: k = 2 k2, high half: 2 k2 + 1), so widening both
 * to float32 is a shift and a mask, lane-wise. */
void tm_gemv_bf16_vnni(const uint16_t *P, const uint16_t *x, const uint16_t *bias, uint16_t *y,
                       int64_t N, int64_t K, int nthreads) {
    const int64_t K2 = K / 2;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const uint32_t *blk = (const uint32_t *)P + b * K2 * 16;
        float a0[16] = {0}, a1[16] = {0}, a2[16] = {0}, a3[16] = {0};
        int64_t k2 = 0;
        for (; k2 + 2 <= K2; k2 += 2) {
            const float x0 = bf16_to_f32(x[2 * k2]), x1 = bf16_to_f32(x[2 * k2 + 1]);
            const float x2 = bf16_to_f32(x[2 * k2 + 2]), x3 = bf16_to_f32(x[2 * k2 + 3]);
            const uint32_t *p0 = blk + k2 * 16, *p1 = p0 + 16;
            #pragma omp simd
            for (int r = 0; r < 16; r++) {
                a0[r] += bits_f32(p0[r] << 16) * x0;
                a1[r] += bits_f32(p0[r] & 0xFFFF0000u) * x1;
                a2[r] += bits_f32(p1[r] << 16) * x2;
                a3[r] += bits_f32(p1[r] & 0xFFFF0000u) * x3;
            }
        }
        for (; k2 < K2; k2++) {
            const float x0 = bf16_to_f32(x[2 * k2]), x1 = bf16_to_f32(x[2 * k2 + 1]);
            const uint32_t *p0 = blk + k2 * 16;
            #pragma omp simd
            for (int r = 0; r < 16; r++) {
                a0[r] += bits_f32(p0[r] << 16) * x0;
                a1[r] += bits_f32(p0[r] & 0xFFFF0000u) * x1;
            }
        }
        #pragma omp simd
        for (int r = 0; r < 16; r++) {
            float v = (a0[r] + a1[r]) + (a2[r] + a3[r]);
            if (bias) v += bf16_to_f32(bias[b * 16 + r]);
            y[b * 16 + r] = f32_to_bf16(v);
        }
    }
}
#endif

/* float32: W is repacked into 16-row panels, so each 64-byte load feeds one FMA and the matrix is
 * read as one sequential stream:
 *
 *     P[N/16][K][16]      P[b][k][r] = W[16 b + r][k]
 */
#if defined(__AVX512F__)
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
#else
void tm_gemv_f32(const float *P, const float *x, const float *bias, float *y, int64_t N, int64_t K, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const float *blk = P + b * K * 16;
        float a0[16] = {0}, a1[16] = {0}, a2[16] = {0}, a3[16] = {0};
        int64_t k = 0;
        for (; k + 4 <= K; k += 4) {
            const float *p = blk + k * 16;
            const float x0 = x[k], x1 = x[k + 1], x2 = x[k + 2], x3 = x[k + 3];
            #pragma omp simd
            for (int r = 0; r < 16; r++) {
                a0[r] += p[r] * x0;
                a1[r] += p[16 + r] * x1;
                a2[r] += p[32 + r] * x2;
                a3[r] += p[48 + r] * x3;
            }
        }
        for (; k < K; k++) {
            const float x0 = x[k];
            #pragma omp simd
            for (int r = 0; r < 16; r++) a0[r] += blk[k * 16 + r] * x0;
        }
        #pragma omp simd
        for (int r = 0; r < 16; r++) {
            const float v = (a0[r] + a1[r]) + (a2[r] + a3[r]);
            y[b * 16 + r] = bias ? v + bias[b * 16 + r] : v;
        }
    }
}
#endif

/* A few rows (decode batches, speculative verification): y[M][N] = x[M][K] W^T (+ bias), 2 <= M <= 8, over
 * the same packed panels, each panel read from memory once for all M rows. Portable C on every CPU (gcc
 * vectorizes the 16 lanes of a panel for the CPU at hand); the row count is a compile-time constant in each
 * instance, so the accumulators stay in registers. Each weight element is one fused multiply-add into its
 * row's accumulator. Float32 accumulation, one rounding at the end (bf16).
 *
 * bfloat16 widens each panel line to float32 lanes (low k, high k) before the multiply-adds, and those lanes
 * take registers too: a panel is swept once per balanced group of at most BF16_ROW_GROUP rows (8 rows: 4 + 4;
 * 5: 3 + 2; the later sweeps find it in L2), whose 16-lane accumulators then fit AVX2's 16 registers with the
 * widened lanes and the broadcast x (8 rows at once spilled accumulators on every k, and `acc += lo x0 + hi x1`
 * cost a multiply, an FMA and an add per lane where two FMAs do). Groups of one or two rows keep the low and
 * high k in separate accumulators, so consecutive FMAs do not wait on each other. */
#define GEMM_MAX_ROWS 8
#define BF16_ROW_GROUP 4
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void rows_panel_f32(const float *blk, const float *x, int64_t K, const int M, float acc[][16]) {
    for (int64_t k = 0; k < K; k++) {
        const float *p = blk + k * 16;
        for (int m = 0; m < M; m++) {
            const float xv = x[m * K + k];
            #pragma omp simd
            for (int r = 0; r < 16; r++) acc[m][r] += p[r] * xv;
        }
    }
}

/* x widened to float32 [M][K]; each uint32 of a panel holds one row's pair (k = 2 k2, 2 k2 + 1) */
ALWAYS_INLINE void rows_panel_bf16(const uint32_t *blk, const float *x, int64_t K, const int M, float acc[][16]) {
    float hi[2][16] = {{0}};  /* M <= 2: the high k's own accumulators */
    for (int64_t k2 = 0; k2 < K / 2; k2++) {
        const uint32_t *p = blk + k2 * 16;
        STREAM_PREFETCH(p);
        for (int m = 0; m < M; m++) {
            const float x0 = x[m * K + 2 * k2], x1 = x[m * K + 2 * k2 + 1];
            float *h = M <= 2 ? hi[m] : acc[m];
            #pragma omp simd
            for (int r = 0; r < 16; r++) acc[m][r] += bits_f32(p[r] << 16) * x0;
            #pragma omp simd
            for (int r = 0; r < 16; r++) h[r] += bits_f32(p[r] & 0xFFFF0000u) * x1;
        }
    }
    if (M <= 2)
        for (int m = 0; m < M; m++) {
            #pragma omp simd
            for (int r = 0; r < 16; r++) acc[m][r] += hi[m][r];
        }
}

#define ROWS_CASES(CALL) \
    switch (M) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; case 5: CALL(5); break; \
                 case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }
#define GROUP_CASES(CALL) \
    switch (M) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; default: CALL(4); break; }

static void gemm_rows_f32(const float *P, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                          int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        float acc[GEMM_MAX_ROWS][16] = {{0}};
#define F32_ROWS(m) rows_panel_f32(P + b * K * 16, x, K, m, acc)
        ROWS_CASES(F32_ROWS)
        for (int64_t m = 0; m < M; m++) {
            #pragma omp simd
            for (int r = 0; r < 16; r++) y[m * N + b * 16 + r] = bias ? acc[m][r] + bias[b * 16 + r] : acc[m][r];
        }
    }
}

static void gemm_rows_bf16(const uint16_t *P, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t M_all,
                           int64_t N, int64_t K, int nthreads) {
    float xf[GEMM_MAX_ROWS * 4096], *xw = K <= 4096 ? xf : malloc(M_all * K * sizeof(float));
    for (int64_t i = 0; i < M_all * K; i++) xw[i] = bf16_to_f32(x[i]);
    const int64_t groups = row_chunks(M_all, BF16_ROW_GROUP);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t lo = row_chunk_start(M_all, groups, g), M = row_chunk_start(M_all, groups, g + 1) - lo;
            float acc[BF16_ROW_GROUP][16] = {{0}};
#define BF16_ROWS(m) rows_panel_bf16((const uint32_t *)P + b * (K / 2) * 16, xw + lo * K, K, m, acc)
            GROUP_CASES(BF16_ROWS)
            for (int64_t m = 0; m < M; m++) {
                #pragma omp simd
                for (int r = 0; r < 16; r++)
                    y[(lo + m) * N + b * 16 + r] =
                        f32_to_bf16(acc[m][r] + (bias ? bf16_to_f32(bias[b * 16 + r]) : 0.0f));
            }
        }
    }
    if (xw != xf) free(xw);
}

/* any M >= 1, in chunks of at most GEMM_MAX_ROWS (rows.h) */
void tm_gemm_rows_f32(const float *P, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                      int nthreads) {
    for (int64_t c = 0, n = row_chunks(M, GEMM_MAX_ROWS); c < n; c++) {
        const int64_t lo = row_chunk_start(M, n, c), hi = row_chunk_start(M, n, c + 1);
        gemm_rows_f32(P, x + lo * K, bias, y + lo * N, hi - lo, N, K, nthreads);
    }
}

void tm_gemm_rows_bf16(const uint16_t *P, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                       int64_t K, int nthreads) {
    for (int64_t c = 0, n = row_chunks(M, GEMM_MAX_ROWS); c < n; c++) {
        const int64_t lo = row_chunk_start(M, n, c), hi = row_chunk_start(M, n, c + 1);
        gemm_rows_bf16(P, x + lo * K, bias, y + lo * N, hi - lo, N, K, nthreads);
    }
}

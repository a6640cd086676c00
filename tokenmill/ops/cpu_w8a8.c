/* The two passes around oneDNN's int8 GEMM in a W8A8 linear (quantization/int8.py), one call each:
 * per-row activation quantization before it and the per-row rescale after it. In torch they were ~8
 * elementwise ops over [M, K] and [M, N] each, more time than the GEMM itself in a 2048-token prefill.
 * Both round exactly where their torch twins (int8.quantize_rows, Int8LinearMethod._w8a8) round, so the
 * results are bit-identical. Portable C that gcc vectorizes for the CPU at hand (-march=native). */
#pragma GCC optimize("fp-contract=off")  /* y * t + bias rounds twice, as in torch: no FMA */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))

INLINE float ld(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* round half to even for |v| < 2^22, as torch.round does */
INLINE float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* max and clamp as compares, not fmaxf/fminf, whose NaN rules keep gcc from vectorizing them */
INLINE float max_f(float a, float b) { return a > b ? a : b; }

INLINE void quantize_row(const void *x, uint8_t *xu, float *t, int64_t m, int64_t K, float qmax, int zp,
                         const int bf16) {
    float a = 0.0f;
    #pragma omp simd reduction(max:a)
    for (int64_t i = 0; i < K; i++) a = max_f(a, fabsf(ld(x, m * K + i, bf16)));
    const float tm = max_f(a, 1e-8f) / qmax;
    t[m] = tm;
    #pragma omp simd
    for (int64_t i = 0; i < K; i++) {
        float q = round_even(ld(x, m * K + i, bf16) / tm);
        q = q < -qmax ? -qmax : q;
        q = q > qmax ? qmax : q;
        xu[m * K + i] = (uint8_t)((int32_t)q + zp);
    }
}

/* x [M, K] (bfloat16 if bf16, else float32) -> t[m] = max(max_k |x[m, k]|, 1e-8) / qmax and
 * xu[m, k] = clamp(round(x[m, k] / t[m]), -qmax, qmax) + zp as uint8 (oneDNN's fast path wants unsigned
 * activations with a zero point). xu has Mp >= M rows; rows M..Mp (padding for oneDNN's shape cache) get zp. */
void tm_quantize_rows_u8(const void *x, uint8_t *xu, float *t, int64_t M, int64_t Mp, int64_t K, float qmax, int zp,
                         int bf16, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) {
        if (bf16) quantize_row(x, xu, t, m, K, qmax, zp, 1);
        else quantize_row(x, xu, t, m, K, qmax, zp, 0);
    }
    for (int64_t i = M * K; i < Mp * K; i++) xu[i] = (uint8_t)zp;
}

INLINE void rescale_row(const float *y, const float *t, const float *bias, void *out, int64_t m, int64_t N,
                        const int bf16) {
    const float tm = t[m];
    #pragma omp simd
    for (int64_t n = 0; n < N; n++) {
        const float v = y[m * N + n] * tm + (bias ? bias[n] : 0.0f);
        if (bf16) ((uint16_t *)out)[m * N + n] = f32_to_bf16(v);
        else ((float *)out)[m * N + n] = v;
    }
}

/* out[m, n] = y[m, n] * t[m] (+ bias[n]), rounded once to the output dtype (bfloat16 if bf16). */
void tm_rescale_rows(const float *y, const float *t, const float *bias, void *out, int64_t M, int64_t N, int bf16,
                     int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) {
        if (bf16) rescale_row(y, t, bias, out, m, N, 1);
        else rescale_row(y, t, bias, out, m, N, 0);
    }
}

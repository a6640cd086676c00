/* Fused per-layer small ops for decoding on AVX-512 CPUs: add + RMSNorm, SiLU-and-mul, rotary.
 * A decode step runs ~30 small torch ops per layer, each a few microseconds of dispatch for a few
 * hundred values; one call each here. Every kernel rounds where its torch twin (layers/*.py) rounds,
 * so bfloat16 results match it up to the order of the float32 sums.
 * Tensors are contiguous rows; bf16 != 0 means bfloat16 data, else float32.  */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

static inline __m512 ld(const void *p, int64_t i, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

static inline void st(void *p, int64_t i, __m512 v, int bf16) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_storeu_ps((float *)p + i, v);
}

/* the value a bf16 tensor would hold: round to nearest even and back */
static inline __m512 rnd(__m512 v, int bf16) {
    if (!bf16) return v;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* residual != NULL: residual = x + residual (rounded), out = w * round(norm(residual)).
 * residual == NULL: out = w * round(norm(x)).  D % 16 == 0. */
void tm_add_rmsnorm(const void *x, void *residual, const void *w, void *out, int64_t T, int64_t D, float eps,
                    int bf16, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const int64_t o = t * D;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
            __m512 h = ld(x, o + i, bf16);
            if (residual) {
                h = rnd(_mm512_add_ps(h, ld(residual, o + i, bf16)), bf16);
                st(residual, o + i, h, bf16);
            }
            ss = _mm512_fmadd_ps(h, h, ss);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)D + eps);
        const void *src = residual ? residual : x;
        for (int64_t i = 0; i < D; i += 16) {
            __m512 n = rnd(_mm512_mul_ps(ld(src, o + i, bf16), _mm512_set1_ps(inv)), bf16);
            st(out, o + i, _mm512_mul_ps(ld(w, i, bf16), n), bf16);
        }
    }
}

static inline __m512 exp_neg(__m512 v) {  /* exp(-v), through the scalar libm for exactness */
    float a[16];
    _mm512_storeu_ps(a, v);
    for (int j = 0; j < 16; j++) a[j] = expf(-a[j]);
    return _mm512_loadu_ps(a);
}

/* gu [T, 2I] = [gate | up] -> out [T, I] = round(silu(gate)) * up.  I % 16 == 0. */
void tm_silu_mul(const void *gu, void *out, int64_t T, int64_t I, int bf16, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < I; i += 16) {
            __m512 g = ld(gu, t * 2 * I + i, bf16), u = ld(gu, t * 2 * I + I + i, bf16);
            __m512 s = rnd(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_neg(g))), bf16);
            st(out, t * I + i, _mm512_mul_ps(s, u), bf16);
        }
    }
}

/* Rotary (NeoX half split) in place on the first H heads of each row of qkv [T, row_stride]:
 * x' = round(round(x cos) + round(rot(x) sin)), rot(x) = [-x2, x1]; cos/sin [T, hd].  hd % 32 == 0. */
void tm_rotary(void *qkv, const void *cos, const void *sin, int64_t T, int64_t H, int64_t hd, int64_t row_stride,
               int bf16, int nthreads) {
    const int64_t half = hd / 2;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t o = t * row_stride + h * hd;
            for (int64_t i = 0; i < half; i += 16) {
                __m512 x1 = ld(qkv, o + i, bf16), x2 = ld(qkv, o + half + i, bf16);
                __m512 c1 = ld(cos, t * hd + i, bf16), c2 = ld(cos, t * hd + half + i, bf16);
                __m512 s1 = ld(sin, t * hd + i, bf16), s2 = ld(sin, t * hd + half + i, bf16);
                __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
                __m512 y1 = _mm512_add_ps(rnd(_mm512_mul_ps(x1, c1), bf16), rnd(_mm512_mul_ps(neg_x2, s1), bf16));
                __m512 y2 = _mm512_add_ps(rnd(_mm512_mul_ps(x2, c2), bf16), rnd(_mm512_mul_ps(x1, s2), bf16));
                st(qkv, o + i, y1, bf16);
                st(qkv, o + half + i, y2, bf16);
            }
        }
    }
}

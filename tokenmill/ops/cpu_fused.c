/* Fused per-layer small ops for decoding: add + RMSNorm, SiLU-and-mul, rotary.
 * A decode step runs ~30 small torch ops per layer, each a few microseconds of dispatch for a few
 * hundred values; one call each here. Every kernel rounds where its torch twin (layers/norm.py,
 * activation.py, rotary.py) rounds, so bfloat16 results match it up to the order of the float32 sums.
 * Tensors are contiguous rows; bf16 != 0 means bfloat16 data, else float32.
 * Two paths, same semantics: AVX-512 intrinsics (with AVX512-BF16 for the conversions), and portable C
 * that gcc vectorizes for the CPU at hand (-march=native; AVX2 here).  */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))

/* e^x for any float x, lane by lane and branch-free (integer masks: gcc will not if-convert float compares
 * here), within 1 ulp of the exact value: Cephes' expf polynomial. |x| is clamped to 104, and 2^n is applied
 * as two normal powers of two, so overflow gives inf and underflow denormals or 0, as expf does. */
INLINE float exp_any(float x) {
    const uint32_t ux = f32_bits(x), mag = ux & 0x7FFFFFFFu;
    const uint32_t big = -(uint32_t)(mag > 0x42D00000u), nan = -(uint32_t)(mag > 0x7F800000u);
    const float xc = bits_f32((ux & ~big) | (((ux & 0x80000000u) | 0x42D00000u) & big));
    const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;  /* |n| <= 151 */
    const float y = p * bits_f32((uint32_t)(n1 + 127) << 23) * bits_f32((uint32_t)(n2 + 127) << 23);
    return bits_f32((f32_bits(y) & ~nan) | (ux & nan));
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

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

/* exp(-v): exp_any's steps in AVX-512 (libm's scalar expf, 16 calls per vector, made silu_mul several
 * times slower than torch's) */
static inline __m512 exp_neg(__m512 v) {
    const __m512i ux = _mm512_castps_si512(_mm512_sub_ps(_mm512_setzero_ps(), v));
    const __m512i mag = _mm512_and_si512(ux, _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 big = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x42D00000));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7F800000));
    const __m512i clamped = _mm512_or_si512(_mm512_and_si512(ux, _mm512_set1_epi32((int)0x80000000u)),
                                            _mm512_set1_epi32(0x42D00000));
    const __m512 xc = _mm512_castsi512_ps(_mm512_mask_mov_epi32(ux, big, clamped));
    const __m512 shift = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), shift), shift);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i ni = _mm512_cvttps_epi32(n), n1 = _mm512_srai_epi32(_mm512_add_epi32(ni, _mm512_srli_epi32(ni, 31)), 1);
    const __m512i n2 = _mm512_sub_epi32(ni, n1), bias = _mm512_set1_epi32(127);
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23))),
                                   _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23)));
    return _mm512_mask_mov_ps(y, nan, _mm512_castsi512_ps(ux));
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
#else
/* Portable path. Each kernel's row body is inlined twice, with bf16 a constant 0 or 1, so every loop
 * over a row is straight-line float math that gcc vectorizes. */

INLINE float ld(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void st(void *p, int64_t i, float v, const int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* the value a bf16 tensor would hold */
INLINE float rnd(float v, const int bf16) { return bf16 ? round_bf16(v) : v; }

INLINE void add_rmsnorm_row(const void *x, void *residual, const void *w, void *out, int64_t o, int64_t D, float eps,
                            const int bf16) {
    float ss[16] = {0};  /* 16 partial sums, as the 16 lanes of the AVX-512 path */
    if (residual) {  /* two loops: gcc vectorizes neither with the branch inside */
        for (int64_t i = 0; i < D; i += 16) {
            #pragma omp simd
            for (int j = 0; j < 16; j++) {
                const float h = rnd(ld(x, o + i + j, bf16) + ld(residual, o + i + j, bf16), bf16);
                st(residual, o + i + j, h, bf16);
                ss[j] += h * h;
            }
        }
    } else {
        for (int64_t i = 0; i < D; i += 16) {
            #pragma omp simd
            for (int j = 0; j < 16; j++) {
                const float h = ld(x, o + i + j, bf16);
                ss[j] += h * h;
            }
        }
    }
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += ss[j];
    const float inv = 1.0f / sqrtf(sum / (float)D + eps);
    const void *src = residual ? residual : x;
    #pragma omp simd
    for (int64_t i = 0; i < D; i++)
        st(out, o + i, ld(w, i, bf16) * rnd(ld(src, o + i, bf16) * inv, bf16), bf16);
}

void tm_add_rmsnorm(const void *x, void *residual, const void *w, void *out, int64_t T, int64_t D, float eps,
                    int bf16, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        if (bf16) add_rmsnorm_row(x, residual, w, out, t * D, D, eps, 1);
        else add_rmsnorm_row(x, residual, w, out, t * D, D, eps, 0);
    }
}

INLINE void silu_mul_row(const void *gu, void *out, int64_t t, int64_t I, const int bf16) {
    #pragma omp simd
    for (int64_t i = 0; i < I; i++) {
        const float g = ld(gu, t * 2 * I + i, bf16);
        st(out, t * I + i, rnd(g / (1.0f + exp_any(-g)), bf16) * ld(gu, t * 2 * I + I + i, bf16), bf16);
    }
}

void tm_silu_mul(const void *gu, void *out, int64_t T, int64_t I, int bf16, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        if (bf16) silu_mul_row(gu, out, t, I, 1);
        else silu_mul_row(gu, out, t, I, 0);
    }
}

INLINE void rotary_row(void *qkv, const void *cos, const void *sin, int64_t t, int64_t H, int64_t hd,
                       int64_t row_stride, const int bf16) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < H; h++) {
        const int64_t o = t * row_stride + h * hd;
        #pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float x1 = ld(qkv, o + i, bf16), x2 = ld(qkv, o + half + i, bf16);
            const float c1 = ld(cos, t * hd + i, bf16), c2 = ld(cos, t * hd + half + i, bf16);
            const float s1 = ld(sin, t * hd + i, bf16), s2 = ld(sin, t * hd + half + i, bf16);
            st(qkv, o + i, rnd(x1 * c1, bf16) + rnd(-x2 * s1, bf16), bf16);
            st(qkv, o + half + i, rnd(x2 * c2, bf16) + rnd(x1 * s2, bf16), bf16);
        }
    }
}

/* Rotary (NeoX half split) in place on the first H heads of each row of qkv [T, row_stride]:
 * x' = round(round(x cos) + round(rot(x) sin)), rot(x) = [-x2, x1]; cos/sin [T, hd].  hd % 32 == 0. */
void tm_rotary(void *qkv, const void *cos, const void *sin, int64_t T, int64_t H, int64_t hd, int64_t row_stride,
               int bf16, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        if (bf16) rotary_row(qkv, cos, sin, t, H, hd, row_stride, 1);
        else rotary_row(qkv, cos, sin, t, H, hd, row_stride, 0);
    }
}
#endif

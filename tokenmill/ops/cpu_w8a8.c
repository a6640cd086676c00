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

/* W8A8 product on AMX tiles, for CPUs with AMX-INT8: our own GEMM instead of oneDNN's, for two reasons
 * measured on a 2-vCPU Sapphire Rapids VM. oneDNN's kernel let the weight stream run latency-bound (16 GB/s
 * at 32 rows with a model-sized footprint, 29 in cache), and it wrote a float32 [M, N] that a second pass
 * then rescaled. Here the weight panels are prefetched ahead of use, and the epilogue applies both scales
 * and rounds once into the output.
 *
 * Weight layout: 1 KiB B tiles, 16 outputs x 64 k each, in the 4-byte groups that TDPBSSD multiplies:
 *
 *     P[N/16][K/64][16][16][4]       P[b][c][r][j][i] = q[16 b + j][64 c + 4 r + i]
 *
 * so the tiles of one 16-output block lie one after another along K. x is the int8 codes [Mp, K], Mp a
 * multiple of 16 (padding rows are zero). Each step of the inner loop multiplies 2 row blocks by 2 output
 * blocks: C[2][2] in tiles 0-3, A in 4-5, B in 6-7. Accumulation is exact in int32; the epilogue computes
 * (acc * t[m]) * s[n] (+ bias[n]) in float32, the order of the twin (quantization/int8.w8a8_linear_ref). */
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include "amx.h"
#include "stream.h"

int tm_amx_init(void) { return amx_request(); }

INLINE void epilogue(const int32_t c[16][16], const float *t, const float *s, const float *bias, void *y,
                     int64_t m0, int64_t M, int64_t n0, int64_t N, const int bf16) {
    for (int r = 0; r < 16 && m0 + r < M; r++) {
        const float tm = t[m0 + r];
        #pragma omp simd
        for (int j = 0; j < 16; j++) {
            float v = ((float)c[r][j] * tm) * s[n0 + j];
            if (bias) v = v + bias[n0 + j];
            if (bf16) ((uint16_t *)y)[(m0 + r) * N + n0 + j] = f32_to_bf16(v);
            else ((float *)y)[(m0 + r) * N + n0 + j] = v;
        }
    }
}

/* the tiles one pass of the K loop reads: B tiles of output blocks b and b + 1, A of row blocks a, a + 1 */
#define B_TILE(b, c) (P + ((b) * KC + (c)) * 1024)

void tm_w8a8_amx(const int8_t *x, const float *t, const int8_t *P, const float *s, const float *bias, void *y,
                 int64_t M, int64_t N, int64_t K, int bf16, int nthreads) {
    const int64_t KC = K / 64, NB = N / 16, MB = (M + 15) / 16;
    /* Many rows (prefill) go in chunks of row blocks whose codes fit in L2 (~512 KiB), each chunk taking
     * every output block: the weights are then read once per chunk, the codes once per output pair. */
    int64_t chunk = (512 * 1024 / K) / 32 * 2;
    if (chunk < 2) chunk = 2;
    #pragma omp parallel num_threads(nthreads)
    {
        amx_config_tiles();
        int32_t c[4][16][16];
        for (int64_t a0 = 0; a0 < MB; a0 += chunk) {
            const int64_t a1 = a0 + chunk < MB ? a0 + chunk : MB;
            #pragma omp for schedule(static)
            for (int64_t bp = 0; bp < NB / 2; bp++) {
                const int64_t b = 2 * bp;
                for (int64_t a = a0; a < a1; a += 2) {
                    const int two = a + 1 < a1;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    for (int64_t kc = 0; kc < KC; kc++) {
                        if (a == a0)  /* the chunk's first row pass streams the weights; later ones hit cache */
                            for (int l = 0; l < 16; l++) {
                                STREAM_PREFETCH(B_TILE(b, kc) + 64 * l);
                                STREAM_PREFETCH(B_TILE(b + 1, kc) + 64 * l);
                            }
                        _tile_loadd(6, B_TILE(b, kc), 64);
                        _tile_loadd(7, B_TILE(b + 1, kc), 64);
                        _tile_loadd(4, x + (a * 16) * K + kc * 64, K);
                        _tile_dpbssd(0, 4, 6);
                        _tile_dpbssd(1, 4, 7);
                        if (two) {
                            _tile_loadd(5, x + (a * 16 + 16) * K + kc * 64, K);
                            _tile_dpbssd(2, 5, 6);
                            _tile_dpbssd(3, 5, 7);
                        }
                    }
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    if (two) {
                        _tile_stored(2, c[2], 64);
                        _tile_stored(3, c[3], 64);
                    }
                    for (int i = 0; i < (two ? 4 : 2); i++) {
                        const int64_t m0 = (a + i / 2) * 16, n0 = (b + i % 2) * 16;
                        if (bf16) epilogue(c[i], t, s, bias, y, m0, M, n0, N, 1);
                        else epilogue(c[i], t, s, bias, y, m0, M, n0, N, 0);
                    }
                }
            }
        }
        _tile_release();
    }
}
#else
int tm_amx_init(void) { return 0; }

void tm_w8a8_amx(const int8_t *x, const float *t, const int8_t *P, const float *s, const float *bias, void *y,
                 int64_t M, int64_t N, int64_t K, int bf16, int nthreads) {
    (void)x; (void)t; (void)P; (void)s; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)bf16; (void)nthreads;
}
#endif

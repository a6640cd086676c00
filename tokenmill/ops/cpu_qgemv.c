/* Batch-1 GEMVs over quantized weights on CPUs: y[N] = W[N,K] x[K] (+ bias), float32 math.
 * Decoding one row is bound by reading the weights, so each layout is read as one sequential stream
 * of 16-row panels and widened to float32 in registers.
 *
 * int8, symmetric per output row (W[n,k] = q[n,k] * s[n]), 16-row panels in one of two layouts
 * (S8_QUAD_LINES; ops/cpu_qgemv.py pack_int8 asks the build which, tm_qgemv_s8_layout):
 *
 *   k lines (portable build):    P[N/16][K][16] int8        P[b][k][r] = q[16 b + r][k]       (16 bytes per k)
 *   quad lines (AVX-512 build):  P[N/16][K/4][16][4] uint8  P[b][k4][r][j] = q[16 b + r][4 k4 + j] + 128
 *
 *       one 64-byte line, k = 4c .. 4c + 3:   dword r = (q[r][4c], .., q[r][4c+3]) + 128    r = 0..15
 *
 *     so a line is 16 dword lanes of 4 unsigned bytes, one row's k quad each: one vpdpbusd (u8 x s8, 4
 *     products per lane) against a broadcast quad of x bytes takes 16 rows x 4 k, with no widening. The
 *     offset codes c = q + 128 (q ^ 0x80 as a byte) are undone once per block: sum c x = sum q x + 128 sum x.
 *     y[n] = s[n] * sum_k x[k] q[n,k]
 *
 * int4 with groups of G along K and zero points (AWQ: W[n,k] = (q[n,k] - z[g,n]) * s[g,n], g = k / G):
 *
 *     P[N/16][K/2][16] uint8       64-byte lines of 8 k x 16 rows, one of two layouts (U4_DWORD_LINES):
 *     S[N/16][K/G][16] float16     scales (AWQ's own fp16 values), Z [N/16][K/G][16] uint8 zero points
 *     y[n] = sum_g s[g,n] * (sum_{k in g} x[k] q[n,k]  -  z[g,n] * sum_{k in g} x[k])
 *
 *   byte lines (portable build):  P[b][k2][r] = q[16b+r][2 k2] | q[16b+r][2 k2 + 1] << 4
 *   dword lines (AVX-512 build):  line L of panel b is 16 uint32, one per row r, holding q[16b+r][8L + kk]
 *                                 at nibble p (bits 4p..4p+3) for
 *                                     p  = 0 1 2 3 4 5 6 7
 *                                     kk = 0 2 4 6 1 3 5 7
 *                                 so the pair (8L + 2j, 8L + 2j + 1) sits at bits 4j and 16 + 4j
 *   ops/cpu_qgemv.py pack_int4 asks the build which (tm_qgemv_u4_layout).
 *
 * x is float32, or bfloat16: rounded to int16 per group for the integer paths (below), else widened once per
 * call into a float32 copy.
 *
 * Two paths, same functions: AVX-512 intrinsics (bfloat16 x through VNNI integer dot products: int8 codes and
 * int4 nibbles x bytes of x with vpdpbusd; the int4 fallback for rows the integer path declines
 * makes exact AVX512-BF16 pairs), and portable C that gcc vectorizes over the 16 rows of a
 * panel (AVX2 here): int8 / nibbles widened to float32 lane-wise, float32 FMAs, bfloat16 x widened to float32
 * first, or integer dot products for bfloat16 x on AVX2. The dequantizing passes (more rows than the GEMVs
 * take) are one portable implementation for both, reading the build's layouts.
 *
 * Integer rows (`rows_to_int16`): bfloat16 x multiplied in int16 by the int8 and int4 kernels on AVX-512 and
 * AVX2. Per group g of K (an AWQ group; S8_BLOCK k for int8), x is scaled by a power of two,
 * xi[k] = x[k] * 2^(14 - e_g) with max|x| < 2^e_g, and rounded to int16: exact for every element within 2^7
 * of the group's largest (a bfloat16 has 8 significant bits), rounded below that, so the dot products keep
 * float32's precision relative to the group (ops/cpu_qgemv.py int16_twin). Each group's int32 sum is
 * scaled back by 2^(e_g - 14) in float32. */
#include <stdint.h>
#include <stdlib.h>

#include <math.h>
#include <string.h>

#include <immintrin.h>

#include "bf16.h"
#include "rows.h"
#include "stream.h"

/* sum(x) per group of G along K for each of M rows of x (bf16 or fp32): one pass, shared by every panel */
static float *group_sums(const void *x, int64_t M, int64_t K, int64_t G, int x_bf16) {
    const int64_t ngroups = K / G;
    float *sums = malloc(M * ngroups * sizeof(float));
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < ngroups; g++) {
            float t = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k++)
                t += x_bf16 ? bf16_to_f32(((const uint16_t *)x)[r * K + k]) : ((const float *)x)[r * K + k];
            sums[r * ngroups + g] = t;
        }
    return sums;
}

/* 16 values to out[idx ..], rounded to bfloat16 when out_bf16 */
static inline void store16(void *out, int64_t idx, const float *v, int out_bf16) {
    if (out_bf16) {
        #pragma omp simd
        for (int r = 0; r < 16; r++) ((uint16_t *)out)[idx + r] = f32_to_bf16(v[r]);
    } else {
        #pragma omp simd
        for (int r = 0; r < 16; r++) ((float *)out)[idx + r] = v[r];
    }
}

/* a group's 16 scales (fp16) and zero points (uint8) as float32 */
static inline void group_sz(const uint16_t *S, const uint8_t *Z, int64_t off, float s[16], float z[16]) {
    for (int r = 0; r < 16; r++) {
        s[r] = _cvtsh_ss(S[off + r]);
        z[r] = (float)Z[off + r];
    }
}

static const float *widen(const void *x, int64_t K, int x_bf16, float **owned) {
    *owned = NULL;
    if (!x_bf16) return (const float *)x;
    float *f = malloc(K * sizeof(float));
    for (int64_t k = 0; k < K; k++) f[k] = bf16_to_f32(((const uint16_t *)x)[k]);
    *owned = f;
    return f;
}

/* How `rows_to_int16` lays out each row's int16 x for the kernels that read it:
 *
 *   XI_PAIRS (int8 kernels; AVX2 int4): xe [K/4][8] int32, each a pair (xi[k], xi[k + 1]), low word first:
 *            chunk c = k / 4 is (pair 4c) x 4, then (pair 4c + 2) x 4
 *   XI_BYTES (AVX-512 int4, vpdpbusd): xi = 256 xh + xl with xl in [-128, 127], xh in [-64, 64], as signed
 *            bytes in the nibble order of a dword line (xe [K/8][4] int32 per line of 8 k at k0):
 *                [0] xh at k0 + (0, 4, 1, 5)   [1] xh at k0 + (2, 6, 3, 7)   [2], [3] the same of xl
 *            (the low nibbles of a line's bytes hold k0 + 0, 4, 1, 5, the high ones k0 + 2, 6, 3, 7)
 *   XI_QUADS (AVX-512 int8, vpdpbusd): the same bytes in k order, per quad of k at k0 (xe [K/4][2] int32):
 *                [0] xh at k0 + (0, 1, 2, 3)   [1] xl at k0 + (0, 1, 2, 3) */
enum { XI_PAIRS, XI_BYTES, XI_QUADS };

static void pack_xi(const int16_t *xi, int64_t G, int layout, int32_t *dst) {
    if (layout == XI_PAIRS) {
        for (int64_t c = 0; c < G / 4; c++) {
            int32_t lo, hi;  /* (xi[k], xi[k + 1]) as one int32: the low word first */
            const uint16_t p0[2] = {(uint16_t)xi[4 * c], (uint16_t)xi[4 * c + 1]};
            const uint16_t p1[2] = {(uint16_t)xi[4 * c + 2], (uint16_t)xi[4 * c + 3]};
            memcpy(&lo, p0, 4);
            memcpy(&hi, p1, 4);
            for (int j = 0; j < 4; j++) { dst[c * 8 + j] = lo; dst[c * 8 + 4 + j] = hi; }
        }
        return;
    }
    static const int order[2][8] = {{0, 4, 1, 5, 2, 6, 3, 7}, {0, 1, 2, 3, 4, 5, 6, 7}};
    const int quads = layout == XI_QUADS;
    for (int64_t l = 0; l < G / 8; l++) {
        int8_t b[16];  /* XI_BYTES: xh low-nibble order, xh high, xl low, xl high; XI_QUADS: xh, xl, xh, xl */
        for (int j = 0; j < 8; j++) {
            const int v = xi[l * 8 + order[quads][j]];
            const int xl = ((v + 128) & 255) - 128, at = quads ? (j / 4) * 8 + j % 4 : j;
            b[at] = (int8_t)((v - xl) / 256);
            b[at + (quads ? 4 : 8)] = (int8_t)xl;
        }
        memcpy(dst + l * 4, b, 16);
    }
}

/* One row of bfloat16 x -> int16 per group of G (the header's integer rows), packed by `layout`; xs[g] =
 * 2^(e_g - 14), xsum[g] = sum of the group's xi. 0 when x holds a NaN or an infinity. */
static int x_to_int16(const uint16_t *x, int64_t K, int64_t G, int layout, int32_t *xe, float *xs, float *xsum) {
    for (int64_t g = 0; g < K / G; g++) {
        const uint16_t *xg = x + g * G;
        /* probe turns NaN on a NaN or an infinity (the compare skips NaNs); no fmaxf, so that gcc vectorizes
         * the loop (as a libm call per element it was ~3 % of an int8 decode step) */
        float amax = 0.f, probe = 0.f;
        #pragma omp simd reduction(max : amax) reduction(+ : probe)
        for (int64_t k = 0; k < G; k++) {
            const float v = bf16_to_f32(xg[k]), a = fabsf(v);
            amax = a > amax ? a : amax;
            probe += v * 0.f;
        }
        if (probe != 0.f) return 0;  /* the float path carries them through */
        int e;
        frexpf(amax, &e);
        /* 2^(14 - e) in two factors: for a block of bfloat16 subnormals (e down to -132) one would overflow */
        const float inv_a = ldexpf(1.f, (14 - e) / 2), inv_b = ldexpf(1.f, 14 - e - (14 - e) / 2);
        int16_t xi[G];
        int32_t sum = 0;
        #pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < G; k++) {
            const float v = bf16_to_f32(xg[k]) * inv_a * inv_b;
            xi[k] = (int16_t)(v + copysignf(0.5f, v));  /* round half away from zero */
            sum += xi[k];
        }
        xs[g] = ldexpf(1.f, e - 14);
        xsum[g] = (float)sum;
        pack_xi(xi, G, layout, xe + (layout == XI_PAIRS ? g * G * 2 : g * G / 2));
    }
    return 1;
}

/* x rows [M][K] (bfloat16) -> xe (row m at m * 2K int32), xs and xsum [M][K/G]; 0 when a row holds a NaN or an
 * infinity */
static int rows_to_int16(const uint16_t *x, int64_t M, int64_t K, int64_t G, int layout, int32_t **xe, float **xs) {
    const int64_t ngroups = K / G;
    *xe = aligned_alloc(64, M * K * 2 * sizeof(int32_t));
    *xs = malloc(2 * M * ngroups * sizeof(float));
    int ok = 1;
    for (int64_t m = 0; m < M && ok; m++)
        ok = x_to_int16(x + m * K, K, G, layout, *xe + m * K * 2, *xs + m * ngroups, *xs + M * ngroups + m * ngroups);
    return ok;
}

#define S8_BLOCK 64  /* int8 integer rows: x scaled per this many k (ops/cpu_qgemv.py INT8_BLOCK) */

/* Several rows (M <= 8) at once: each weight line is read and widened once for all rows, so small
 * decode batches cost little more than one row. x [M, K] and y [M, N] are row-major. */
#define MAX_ROWS 8

/* The integer and int8 kernels below take rows two at a time through helpers inlined with a constant row
 * count (1 or 2), so that their accumulators stay in registers (and on AVX-512 their panels through helpers
 * inlined with M = 1 for a batch of one). */
#define ROWS_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define U4_DWORD_LINES 1
#define S8_QUAD_LINES 1

/* 16 fp16 scales / 16 uint8 zero points -> float32 */
static inline __m512 load_s16(const uint16_t *s) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s)); }
static inline __m512 load_z8(const uint8_t *z) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)z)));
}

static inline void store_row(__m512 acc, const float *bias, int64_t n0, void *y, int y_bf16) {
    if (bias)
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + n0));
    if (y_bf16) {
        float tmp[16];
        _mm512_storeu_ps(tmp, acc);
        for (int r = 0; r < 16; r++) ((uint16_t *)y)[n0 + r] = f32_to_bf16(tmp[r]);
    } else {
        _mm512_storeu_ps((float *)y + n0, acc);
    }
}

/* One 64-byte line of int4 codes (layout below) -> 4 vectors of 16 bf16 pairs (128 + q[k], 128 + q[k + 1]) for
 * k = k0, k0 + 2, k0 + 4, k0 + 6, exact. Here a line holds one dword per row with its 8 nibbles ordered so that
 * pair j sits at bits 4j and 16 + 4j: one shift and one ternary-logic op (mask, then OR in 128.0's bits)
 * per pair, 7 ops per line, where widening bytes took 16. */
static inline void line_to_bf16_pairs(const void *line, __m512i w[4]) {
    const __m512i d = _mm512_loadu_si512(line), mask = _mm512_set1_epi32(0x000F000F),
                  one28 = _mm512_set1_epi32(0x43004300);
    w[0] = _mm512_ternarylogic_epi32(d, mask, one28, 0xEA);  /* (d & mask) | 128.0 */
    w[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(d, 4), mask, one28, 0xEA);
    w[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(d, 8), mask, one28, 0xEA);
    w[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(d, 12), mask, one28, 0xEA);
}

/* int8 quad lines, float32 x rows x0 (and x1 when two), k in [0, K), K % 4 == 0. Each 16 bytes of a line,
 * back to signed codes and widened to float32, are 4 rows x 4 k (lane 4i + j: row 4 v + i, k + j for quarter v)
 * against the broadcast quad x[k .. k + 3]; a[v] sums rows 4v .. 4v + 3, 4 lanes each, added up at the end. */
ROWS_INLINE void s8_quads_f32(const uint8_t *blk, const float *x0, const float *x1, const int two, int64_t K,
                              __m512 out[2]) {
    const __m128i flip = _mm_set1_epi8((char)0x80);
    __m512 a[2][4];
    for (int m = 0; m < 2; m++)
        for (int v = 0; v < 4; v++) a[m][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 4) {
        const uint8_t *line = blk + k * 16;
        STREAM_PREFETCH(line);
        __m512 w[4];
        for (int v = 0; v < 4; v++)
            w[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_xor_si128(_mm_loadu_si128((const __m128i *)(line + 16 * v)), flip)));
        for (int m = 0; m < 1 + two; m++) {
            const __m512 xv = _mm512_broadcast_f32x4(_mm_loadu_ps((m ? x1 : x0) + k));
            for (int v = 0; v < 4; v++) a[m][v] = _mm512_fmadd_ps(w[v], xv, a[m][v]);
        }
    }
    /* lanes 4i .. 4i + 3 of a[v] -> row 4v + i: two in-lane swaps leave each row's sum in lane 4i, then two
     * two-source permutes and one 128-bit shuffle put rows 0-15 in order */
    const __m512i pick = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
    for (int m = 0; m < 1 + two; m++) {
        __m512 t[4];
        for (int v = 0; v < 4; v++) {
            t[v] = _mm512_add_ps(a[m][v], _mm512_permute_ps(a[m][v], _MM_SHUFFLE(2, 3, 0, 1)));
            t[v] = _mm512_add_ps(t[v], _mm512_permute_ps(t[v], _MM_SHUFFLE(1, 0, 3, 2)));
        }
        out[m] = _mm512_shuffle_f32x4(_mm512_permutex2var_ps(t[0], pick, t[1]),
                                      _mm512_permutex2var_ps(t[2], pick, t[3]), 0x44);
    }
}

static void qgemm_s8_f32(const uint8_t *P, const float *scales, const float *x, const float *bias, void *y,
                         int64_t M, int64_t N, int64_t K, int y_bf16, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const __m512 s = _mm512_loadu_ps(scales + b * 16);
        for (int64_t m = 0; m < M; m += 2) {
            __m512 acc[2];
            const float *x0 = x + m * K;
            if (m + 1 < M) s8_quads_f32(P + b * K * 16, x0, x0 + K, 1, K, acc);
            else s8_quads_f32(P + b * K * 16, x0, NULL, 0, K, acc);
            for (int64_t i = m; i < M && i < m + 2; i++)
                store_row(_mm512_mul_ps(acc[i - m], s), bias, b * 16,
                          y_bf16 ? (void *)((uint16_t *)y + i * N) : (void *)((float *)y + i * N), y_bf16);
        }
    }
}

/* int8 quad lines against int16 x rows in XI_QUADS (x0, and x1 when two), k in [k0, k1) (one block): per
 * 64-byte line and row, two vpdpbusd (the offset codes against the quad's high and low bytes of xi), two lines
 * per step so that four chains of accumulators overlap. The result is exact in int32, the same integer as
 * sum_k q xi: 256 sum(c xh) + sum(c xl) - 128 sum(xi), with |sum(c xh)| <= S8_BLOCK * 255 * 64 < 2^21 and
 * |sum(c xl)| < 2^22 per block. */
ROWS_INLINE void s8_quads_int16(const uint8_t *blk, const int32_t *xq0, const int32_t *xq1, const int two, int64_t k0,
                                int64_t k1, const int32_t xsum[2], __m512i dot[2]) {
    __m512i h[2][2], l[2][2];
    for (int m = 0; m < 2; m++) h[m][0] = h[m][1] = l[m][0] = l[m][1] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 8) {
        const uint8_t *line = blk + k * 16;
        STREAM_PREFETCH(line);
        STREAM_PREFETCH(line + 64);
        const __m512i w0 = _mm512_loadu_si512(line), w1 = _mm512_loadu_si512(line + 64);
        for (int m = 0; m < 1 + two; m++) {
            const int32_t *q = (m ? xq1 : xq0) + (k / 4) * 2;  /* quad k: xh q[0], xl q[1]; quad k + 4: q[2], q[3] */
            /* in asm, each x dword broadcast inside its vpdpbusd ({1to16}): from the intrinsics gcc 12 emitted a
             * vpbroadcastd and a register copy beside each vpdpbusd (1.14-1.25x at 128 rows, in cache) */
            __asm__("vpdpbusd 0(%[q])%{1to16%}, %[w0], %[h0]\n\t"
                    "vpdpbusd 4(%[q])%{1to16%}, %[w0], %[l0]\n\t"
                    "vpdpbusd 8(%[q])%{1to16%}, %[w1], %[h1]\n\t"
                    "vpdpbusd 12(%[q])%{1to16%}, %[w1], %[l1]"
                    : [h0] "+v"(h[m][0]), [l0] "+v"(l[m][0]), [h1] "+v"(h[m][1]), [l1] "+v"(l[m][1])
                    : [w0] "v"(w0), [w1] "v"(w1), [q] "r"(q), "m"(*(const int32_t(*)[4])q));
        }
    }
    for (int m = 0; m < 1 + two; m++) {
        const __m512i hh = _mm512_add_epi32(h[m][0], h[m][1]), ll = _mm512_add_epi32(l[m][0], l[m][1]);
        dot[m] = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hh, 8), ll), _mm512_set1_epi32(128 * xsum[m]));
    }
}

/* Panel b of qgemm_s8_int16 for M rows (xe, xs: rows_to_int16's). Inlined with M = 1 for a batch of one, so that
 * the row's float accumulator stays in a register across the blocks: with M a runtime value it lived in memory,
 * a load, an FMA and a store per block (~30 % of the one-row kernel's samples in `perf`). */
ROWS_INLINE void s8_int16_panel(const uint8_t *P, const float *scales, const int32_t *xe, const float *xs,
                                const float *bias, uint16_t *y, int64_t b, const int64_t M, int64_t N, int64_t K) {
    const int64_t nblocks = K / S8_BLOCK;
    const float *xsum = xs + M * nblocks;  /* exact: at most S8_BLOCK * 2^14 */
    const uint8_t *blk = P + b * K * 16;
    __m512 acc[MAX_ROWS];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nblocks; g++)
        for (int64_t m = 0; m < M; m += 2) {
            __m512i dot[2];
            const int32_t *xe0 = xe + m * K * 2;
            const int64_t k0 = g * S8_BLOCK, k1 = k0 + S8_BLOCK;
            const int32_t sums[2] = {(int32_t)xsum[m * nblocks + g],
                                     m + 1 < M ? (int32_t)xsum[(m + 1) * nblocks + g] : 0};
            if (m + 1 < M) s8_quads_int16(blk, xe0, xe0 + K * 2, 1, k0, k1, sums, dot);
            else s8_quads_int16(blk, xe0, NULL, 0, k0, k1, sums, dot);
            for (int64_t i = m; i < M && i < m + 2; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i - m]), _mm512_set1_ps(xs[i * nblocks + g]), acc[i]);
        }
    const __m512 s = _mm512_loadu_ps(scales + b * 16);
    for (int64_t m = 0; m < M; m++) store_row(_mm512_mul_ps(acc[m], s), bias, b * 16, y + m * N, 1);
}

/* bfloat16 x as int16 (blocks of S8_BLOCK), M <= MAX_ROWS rows; 0 (nothing written) when a row holds a NaN or
 * an infinity, or K is not a multiple of S8_BLOCK */
static int qgemm_s8_int16(const uint8_t *P, const float *scales, const uint16_t *x, const float *bias, uint16_t *y,
                          int64_t M, int64_t N, int64_t K, int nthreads) {
    if (K % S8_BLOCK) return 0;
    int32_t *xe;
    float *xs;
    const int ok = rows_to_int16(x, M, K, S8_BLOCK, XI_QUADS, &xe, &xs);
    if (ok) {
        /* guided: two threads' halves stream at different speeds; long chunks first keep each stream long, short
         * ones last even out the finish (1.06-1.10x over static on the 0.5B decoder's linears at ~60 GB/s; a
         * fixed chunk of 4 panels, interleaving the threads, lost 20 %) */
        #pragma omp parallel for num_threads(nthreads) schedule(guided)
        for (int64_t b = 0; b < N / 16; b++) {
            if (M == 1) s8_int16_panel(P, scales, xe, xs, bias, y, b, 1, N, K);
            else s8_int16_panel(P, scales, xe, xs, bias, y, b, M, N, K);
        }
    }
    free(xe);
    free(xs);
    return ok;
}

static void qgemm_s8(const int8_t *P, const float *scales, const void *x_in, const float *bias, void *y, int64_t M,
                     int64_t N, int64_t K, int y_bf16, int nthreads) {
    if (y_bf16 && qgemm_s8_int16((const uint8_t *)P, scales, x_in, bias, y, M, N, K, nthreads)) return;
    float *owned;
    const float *x = widen(x_in, M * K, y_bf16, &owned);
    qgemm_s8_f32((const uint8_t *)P, scales, x, bias, y, M, N, K, y_bf16, nthreads);
    free(owned);
}

void tm_qgemv_s8(const int8_t *P, const float *scales, const void *x_in, const float *bias, void *y, int64_t N,
                 int64_t K, int y_bf16, int nthreads) {
    qgemm_s8(P, scales, x_in, bias, y, 1, N, K, y_bf16, nthreads);
}

/* int4 dword lines against int16 x rows in XI_BYTES (x0, and x1 when two), k in [k0, k1) (one group, G % 16 == 0):
 * per line, the low and the high nibbles of each byte masked out are 16 rows x 4 k as unsigned bytes, and each
 * meets the high and the low byte of xi in one vpdpbusd (u8 x s8, 4 products per row lane), 7 vector ops per
 * 64-byte line where the exact bfloat16 pairs below take 11. Two lines per step, so that 8 chains of
 * accumulators per row overlap. dot = 256 sum(q xh) + sum(q xl) = sum_k q[r,k] xi[k], exact in int32: per group
 * at most G * 15 * 64 * 256 + G * 15 * 128 < 2^25 for G = 128. */
ROWS_INLINE void u4_vnni_dots(const uint8_t *blk, const int32_t *xq0, const int32_t *xq1, const int two, int64_t k0,
                              int64_t k1, __m512i dot[2]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i h[2][4], l[2][4];
    for (int m = 0; m < 2; m++)
        for (int j = 0; j < 4; j++) h[m][j] = l[m][j] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 16) {
        const uint8_t *line = blk + (k / 2) * 16;
        STREAM_PREFETCH(line);
        STREAM_PREFETCH(line + 64);
        const __m512i d = _mm512_loadu_si512(line), e = _mm512_loadu_si512(line + 64);
        const __m512i w[4] = {_mm512_and_si512(d, m4), _mm512_and_si512(_mm512_srli_epi32(d, 4), m4),
                              _mm512_and_si512(e, m4), _mm512_and_si512(_mm512_srli_epi32(e, 4), m4)};
        for (int m = 0; m < 1 + two; m++) {
            const int32_t *q = (m ? xq1 : xq0) + (k / 8) * 4;  /* line k: q[0..3], line k + 8: q[4..7] */
            /* w[j] meets xh at q[(j / 2) * 4 + j % 2] and xl two dwords further, each broadcast inside its
             * vpdpbusd (see s8_quads_int16) */
            __asm__("vpdpbusd 0(%[q])%{1to16%}, %[w0], %[h0]\n\t"
                    "vpdpbusd 8(%[q])%{1to16%}, %[w0], %[l0]\n\t"
                    "vpdpbusd 4(%[q])%{1to16%}, %[w1], %[h1]\n\t"
                    "vpdpbusd 12(%[q])%{1to16%}, %[w1], %[l1]\n\t"
                    "vpdpbusd 16(%[q])%{1to16%}, %[w2], %[h2]\n\t"
                    "vpdpbusd 24(%[q])%{1to16%}, %[w2], %[l2]\n\t"
                    "vpdpbusd 20(%[q])%{1to16%}, %[w3], %[h3]\n\t"
                    "vpdpbusd 28(%[q])%{1to16%}, %[w3], %[l3]"
                    : [h0] "+v"(h[m][0]), [l0] "+v"(l[m][0]), [h1] "+v"(h[m][1]), [l1] "+v"(l[m][1]),
                      [h2] "+v"(h[m][2]), [l2] "+v"(l[m][2]), [h3] "+v"(h[m][3]), [l3] "+v"(l[m][3])
                    : [w0] "v"(w[0]), [w1] "v"(w[1]), [w2] "v"(w[2]), [w3] "v"(w[3]), [q] "r"(q),
                      "m"(*(const int32_t(*)[8])q));
        }
    }
    for (int m = 0; m < 1 + two; m++) {
        const __m512i hh = _mm512_add_epi32(_mm512_add_epi32(h[m][0], h[m][1]), _mm512_add_epi32(h[m][2], h[m][3]));
        const __m512i ll = _mm512_add_epi32(_mm512_add_epi32(l[m][0], l[m][1]), _mm512_add_epi32(l[m][2], l[m][3]));
        dot[m] = _mm512_add_epi32(_mm512_slli_epi32(hh, 8), ll);
    }
}

/* Panel b of qgemm_u4_vnni for M rows, inlined with M = 1 for a batch of one (see s8_int16_panel) */
ROWS_INLINE void u4_vnni_panel(const uint8_t *P, const uint16_t *S, const uint8_t *Z, const int32_t *xq, const float *xs,
                               const float *bias, uint16_t *y, int64_t b, const int64_t M, int64_t N, int64_t K,
                               int64_t G) {
    const int64_t ngroups = K / G;
    const float *xsum = xs + M * ngroups;
    const uint8_t *blk = P + b * (K / 2) * 16;
    __m512 acc[MAX_ROWS];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        const int64_t sz = (b * ngroups + g) * 16;
        const __m512 sg = load_s16(S + sz), zg = load_z8(Z + sz);
        for (int64_t m = 0; m < M; m += 2) {
            __m512i dot[2];
            const int32_t *xq0 = xq + m * K * 2;
            if (m + 1 < M) u4_vnni_dots(blk, xq0, xq0 + K * 2, 1, g * G, (g + 1) * G, dot);
            else u4_vnni_dots(blk, xq0, NULL, 0, g * G, (g + 1) * G, dot);
            for (int64_t i = m; i < M && i < m + 2; i++) {
                const __m512 corrected = _mm512_fnmadd_ps(zg, _mm512_set1_ps(xsum[i * ngroups + g]),
                                                          _mm512_cvtepi32_ps(dot[i - m]));
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(sg, _mm512_set1_ps(xs[i * ngroups + g])), corrected, acc[i]);
            }
        }
    }
    for (int64_t m = 0; m < M; m++) store_row(acc[m], bias, b * 16, y + m * N, 1);
}

/* bfloat16 rows as int16 (XI_BYTES, per AWQ group), M <= MAX_ROWS; y += s 2^(e_g - 14) (dot - z sum(xi)) per
 * group. 0 (nothing written) when a row holds a NaN or an infinity, or G is not a multiple of 16. */
static int qgemm_u4_vnni(const uint8_t *P, const uint16_t *S, const uint8_t *Z, const uint16_t *x, const float *bias,
                         uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t G, int nthreads) {
    if (G % 16) return 0;
    int32_t *xq;
    float *xs;
    const int ok = rows_to_int16(x, M, K, G, XI_BYTES, &xq, &xs);
    if (ok) {
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t b = 0; b < N / 16; b++) {
            if (M == 1) u4_vnni_panel(P, S, Z, xq, xs, bias, y, b, 1, N, K, G);
            else u4_vnni_panel(P, S, Z, xq, xs, bias, y, b, M, N, K, G);
        }
    }
    free(xq);
    free(xs);
    return ok;
}

/* bfloat16 rows, M <= MAX_ROWS: the integer path, or where it declines (a row holding a NaN or an infinity)
 * exact bf16 pairs: each byte (two nibbles of one row) becomes a bfloat16 pair 128 + q by OR-ing the nibbles
 * into the mantissa of 128.0 (0x4300), and one vdpbf16ps takes 16 rows x 2 k. The sum then holds x (128 + q),
 * so the group correction subtracts (128 + z) sum(x). */
static void qgemm_u4_bf16(const uint8_t *P, const uint16_t *S, const uint8_t *Z, const uint16_t *x, const float *bias,
                          void *y, int64_t M, int64_t N, int64_t K, int64_t G, int nthreads) {
    if (qgemm_u4_vnni(P, S, Z, x, bias, y, M, N, K, G, nthreads)) return;
    const int64_t ngroups = K / G;
    float *xsum = group_sums(x, M, K, G, 1);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const uint8_t *blk = P + b * (K / 2) * 16;
        __m512 acc[MAX_ROWS];
        for (int64_t r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g < ngroups; g++) {
            __m512 d0[MAX_ROWS], d1[MAX_ROWS];
            for (int64_t r = 0; r < M; r++) d0[r] = d1[r] = _mm512_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
                const uint8_t *line = blk + (k / 2) * 16;
                STREAM_PREFETCH(line);
                __m512i w[4];
                line_to_bf16_pairs(line, w);
                for (int64_t r = 0; r < M; r++) {
                    const uint32_t *xp = (const uint32_t *)(x + r * K) + k / 2;
                    d0[r] = _mm512_dpbf16_ps(d0[r], (__m512bh)w[0], (__m512bh)_mm512_set1_epi32(xp[0]));
                    d1[r] = _mm512_dpbf16_ps(d1[r], (__m512bh)w[1], (__m512bh)_mm512_set1_epi32(xp[1]));
                    d0[r] = _mm512_dpbf16_ps(d0[r], (__m512bh)w[2], (__m512bh)_mm512_set1_epi32(xp[2]));
                    d1[r] = _mm512_dpbf16_ps(d1[r], (__m512bh)w[3], (__m512bh)_mm512_set1_epi32(xp[3]));
                }
            }
            const int64_t sz = (b * ngroups + g) * 16;
            const __m512 s = load_s16(S + sz);
            const __m512 zz = _mm512_add_ps(load_z8(Z + sz), _mm512_set1_ps(128.0f));
            for (int64_t r = 0; r < M; r++)
                acc[r] = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(zz, _mm512_set1_ps(xsum[r * ngroups + g]),
                                                             _mm512_add_ps(d0[r], d1[r])), acc[r]);
        }
        for (int64_t r = 0; r < M; r++) store_row(acc[r], bias, b * 16, (uint16_t *)y + r * N, 1);
    }
    free(xsum);
}

void tm_qgemv_u4(const uint8_t *P, const uint16_t *S, const uint8_t *Z, const void *x_in, const float *bias, void *y,
                 int64_t N, int64_t K, int64_t G, int y_bf16, int nthreads) {
    if (y_bf16) {
        qgemm_u4_bf16(P, S, Z, x_in, bias, y, 1, N, K, G, nthreads);
        return;
    }
    float *owned;
    const float *x = widen(x_in, K, y_bf16, &owned);
    const int64_t ngroups = K / G;
    float *xsum = group_sums(x, 1, K, G, 0);  /* shared by every row */
    const __m512i low4 = _mm512_set1_epi32(0xF);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const uint8_t *blk = P + b * (K / 2) * 16;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0; g < ngroups; g++) {
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            const int64_t k_end = (g + 1) * G;
            for (int64_t k = g * G; k < k_end; k += 8) {  /* one 64-byte line: 8 k of 16 rows */
                STREAM_PREFETCH(blk + (k / 2) * 16);
                const __m512i d = _mm512_loadu_si512(blk + (k / 2) * 16);  /* q[k + kk] at bits 4 p(kk) */
#define U4_AT(shift) _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d, shift), low4))
                a0 = _mm512_fmadd_ps(U4_AT(0), _mm512_set1_ps(x[k + 0]), a0);
                a1 = _mm512_fmadd_ps(U4_AT(16), _mm512_set1_ps(x[k + 1]), a1);
                a2 = _mm512_fmadd_ps(U4_AT(4), _mm512_set1_ps(x[k + 2]), a2);
                a3 = _mm512_fmadd_ps(U4_AT(20), _mm512_set1_ps(x[k + 3]), a3);
                a0 = _mm512_fmadd_ps(U4_AT(8), _mm512_set1_ps(x[k + 4]), a0);
                a1 = _mm512_fmadd_ps(U4_AT(24), _mm512_set1_ps(x[k + 5]), a1);
                a2 = _mm512_fmadd_ps(U4_AT(12), _mm512_set1_ps(x[k + 6]), a2);
                a3 = _mm512_fmadd_ps(U4_AT(28), _mm512_set1_ps(x[k + 7]), a3);
#undef U4_AT
            }
            __m512 dot = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
            const int64_t sz = (b * ngroups + g) * 16;
            __m512 corrected = _mm512_fnmadd_ps(load_z8(Z + sz), _mm512_set1_ps(xsum[g]), dot);
            acc = _mm512_fmadd_ps(load_s16(S + sz), corrected, acc);
        }
        store_row(acc, bias, b * 16, y, y_bf16);
    }
    free(xsum);
    free(owned);
}

#else
#define U4_DWORD_LINES 0
#define S8_QUAD_LINES 0
/* Portable path. Weights are widened 32 bytes (two panel lines) at a time into small float arrays: a loop
 * over 32 bytes is one 256-bit load and 256-bit conversions, while over a 16-byte line gcc picks 128-bit
 * vectors for the whole loop. The arrays stay in registers; the FMAs then run over the 16 rows of a panel. */

/* two int8 lines (32 bytes) -> float32 */
static inline void widen_s8x32(const int8_t *l, float w[32]) {
    #pragma omp simd
    for (int r = 0; r < 32; r++) w[r] = (float)l[r];
}

/* two int4 lines (32 bytes, k and k + 1 in each byte) -> low nibbles, high nibbles as float32 */
static inline void widen_u4x32(const uint8_t *l, float lo[32], float hi[32]) {
    #pragma omp simd
    for (int r = 0; r < 32; r++) {
        lo[r] = (float)(l[r] & 0xF);
        hi[r] = (float)(l[r] >> 4);
    }
}

/* 16 outputs (+ bias) to y, rounded to bfloat16 when y_bf16 */
static inline void store16_row(const float *acc, const float *bias, int64_t n0, void *y, int y_bf16) {
    float v[16];
    #pragma omp simd
    for (int r = 0; r < 16; r++) v[r] = bias ? acc[r] + bias[n0 + r] : acc[r];
    store16(y, n0, v, y_bf16);
}

/* sum_k x[k] q[n,k] over k in [k0, k1) for the 16 rows of an int8 panel */
static inline void s8_panel_dot(const int8_t *blk, const float *x, int64_t k0, int64_t k1, float dot[16]) {
    float a0[16] = {0}, a1[16] = {0};
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4) {  /* one 64-byte line: four k of 16 rows */
        float w0[32], w1[32];
        widen_s8x32(blk + k * 16, w0);
        widen_s8x32(blk + k * 16 + 32, w1);
        const float x0 = x[k], x1 = x[k + 1], x2 = x[k + 2], x3 = x[k + 3];
        #pragma omp simd
        for (int r = 0; r < 16; r++) {
            a0[r] += w0[r] * x0 + w1[r] * x2;
            a1[r] += w0[16 + r] * x1 + w1[16 + r] * x3;
        }
    }
    for (; k < k1; k++) {
        const float xk = x[k];
        #pragma omp simd
        for (int r = 0; r < 16; r++) a0[r] += (float)blk[k * 16 + r] * xk;
    }
    #pragma omp simd
    for (int r = 0; r < 16; r++) dot[r] = a0[r] + a1[r];
}

/* the same over an int4 panel, k0 and k1 multiples of 4 (G % 16 == 0) */
static inline void u4_panel_dot(const uint8_t *blk, const float *x, int64_t k0, int64_t k1, float dot[16]) {
    float a0[16] = {0}, a1[16] = {0};
    for (int64_t k = k0; k < k1; k += 4) {  /* two lines: bytes k/2 (k, k + 1) and k/2 + 1 (k + 2, k + 3) */
        float lo[32], hi[32];
        widen_u4x32(blk + (k / 2) * 16, lo, hi);
        const float x0 = x[k], x1 = x[k + 1], x2 = x[k + 2], x3 = x[k + 3];
        #pragma omp simd
        for (int r = 0; r < 16; r++) {
            a0[r] += lo[r] * x0 + lo[16 + r] * x2;
            a1[r] += hi[r] * x1 + hi[16 + r] * x3;
        }
    }
    #pragma omp simd
    for (int r = 0; r < 16; r++) dot[r] = a0[r] + a1[r];
}

#if defined(__AVX2__) && defined(__FMA__)
#define INT16_ROWS 1  /* bfloat16 rows of the int4 / int8 kernels take the integer path below */

/* AVX2, bfloat16 x: integer dot products (`rows_to_int16`) instead of widening every nibble to float32 (which
 * made the float loop compute-bound at a third of the memory's speed). Per 16-row panel and group, in int32:
 *
 *     dot[r] = sum_k xi[k] q[r,k]              (vpmaddwd: (q[r,k], q[r,k+1]) . (xi[k], xi[k+1]))
 *     y[r]  += s[g,r] 2^(e_g - 14) (dot[r] - z[g,r] sum_k xi[k])
 *
 * A 32-byte load is two panel lines, k = 4c .. 4c + 3 (chunk c); nibbles are split, interleaved per row and
 * widened to 16-bit words, so each 32-bit lane holds one row's (q[r,k], q[r,k+1]):
 *
 *     load      lane 0: line 2c   (16 rows x k = 4c, 4c+1)    lane 1: line 2c+1 (k = 4c+2, 4c+3)
 *     words     rows 0-3 | 4-7 | 8-11 | 12-15, each lane against xe[c] = (xi pair of its line) x 4
 *
 * Bounds: |xi| <= 2^14, so one lane sums at most G/4 * 2 * 15 * 2^14 < 2^24 per group. */
/* sum_k xi[k] q[r,k] over chunks [c0, c1) of a panel for one row (xe0) or two (xe0, xe1: `two`, a constant
 * where this is inlined): each chunk's weights are widened once for both rows. d0/d1: rows 0-7, 8-15. */
static inline __attribute__((always_inline)) void u4_int16_dots(const uint8_t *blk, int64_t c0, int64_t c1,
                                                                 const int32_t *xe0, const int32_t *xe1, const int two,
                                                                 __m256 d0[2], __m256 d1[2]) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    __m256i a[2][4] = {{zero, zero, zero, zero}, {zero, zero, zero, zero}};
    for (int64_t c = c0; c < c1; c++) {
        if (!(c & 1)) STREAM_PREFETCH(blk + c * 32);  /* one per 64-byte line */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + c * 32));
        const __m256i lo = _mm256_and_si256(v, m0f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
        const __m256i p0 = _mm256_unpacklo_epi8(lo, hi), p1 = _mm256_unpackhi_epi8(lo, hi);
        const __m256i w[4] = {_mm256_unpacklo_epi8(p0, zero), _mm256_unpackhi_epi8(p0, zero),
                              _mm256_unpacklo_epi8(p1, zero), _mm256_unpackhi_epi8(p1, zero)};
        for (int m = 0; m < 1 + two; m++) {
            const __m256i xv = _mm256_load_si256((const __m256i *)((m ? xe1 : xe0) + c * 8));
            for (int j = 0; j < 4; j++) a[m][j] = _mm256_add_epi32(a[m][j], _mm256_madd_epi16(w[j], xv));
        }
    }
    for (int m = 0; m < 1 + two; m++) {  /* the two lines' halves of each row summed: rows 0-7 and 8-15 in order */
        d0[m] = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(a[m][0], a[m][1], 0x20),
                                                    _mm256_permute2x128_si256(a[m][0], a[m][1], 0x31)));
        d1[m] = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(a[m][2], a[m][3], 0x20),
                                                    _mm256_permute2x128_si256(a[m][2], a[m][3], 0x31)));
    }
}

/* int8 panels ([K][16] lines), the same integer scheme with blocks of S8_BLOCK along K in place of groups:
 * two lines k, k + 1 sign-extended to words and interleaved give each row's (q[r,k], q[r,k+1]) in one
 * 32-bit lane (rows 0-3 and 8-11 | 4-7 and 12-15), against the broadcast pair (xi[k], xi[k+1]).
 * |q| <= 128, so a lane sums at most S8_BLOCK / 2 * 2 * 128 * 2^14 < 2^29 per block. */

static inline __attribute__((always_inline)) void s8_int16_dots(const int8_t *blk, int64_t k0, int64_t k1,
                                                                 const int32_t *xe0, const int32_t *xe1, const int two,
                                                                 __m256 d0[2], __m256 d1[2]) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i a[2][2] = {{zero, zero}, {zero, zero}};
    for (int64_t k = k0; k < k1; k += 2) {
        if (!(k & 3)) STREAM_PREFETCH(blk + k * 16);  /* one per 64-byte line (k0 is a multiple of 4) */
        const __m256i l0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + k * 16)));
        const __m256i l1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + (k + 1) * 16)));
        const __m256i lo = _mm256_unpacklo_epi16(l0, l1), hi = _mm256_unpackhi_epi16(l0, l1);
        /* xe holds the pair (xi[k], xi[k + 1]) at lane 0 of chunk k / 4 for even k / 2, lane 4 for odd */
        const int64_t at = (k / 4) * 8 + ((k / 2) & 1) * 4;
        for (int m = 0; m < 1 + two; m++) {
            const __m256i xv = _mm256_set1_epi32((m ? xe1 : xe0)[at]);
            a[m][0] = _mm256_add_epi32(a[m][0], _mm256_madd_epi16(lo, xv));
            a[m][1] = _mm256_add_epi32(a[m][1], _mm256_madd_epi16(hi, xv));
        }
    }
    for (int m = 0; m < 1 + two; m++) {
        d0[m] = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a[m][0], a[m][1], 0x20));
        d1[m] = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a[m][0], a[m][1], 0x31));
    }
}

/* a panel's 16 outputs (rows 0-7 in y0, 8-15 in y1) of M rows, + bias, to bfloat16 y [M][N] at column n0 */
static inline void store_panel_rows(const __m256 *y0, const __m256 *y1, int64_t M, const float *bias, int64_t n0,
                                    uint16_t *y, int64_t N) {
    for (int64_t m = 0; m < M; m++) {
        float acc[16];
        _mm256_storeu_ps(acc, y0[m]);
        _mm256_storeu_ps(acc + 8, y1[m]);
        store16_row(acc, bias, n0, y + m * N, 1);
    }
}

static int qgemm_s8_bf16_int16(const int8_t *P, const float *scales, const uint16_t *x, const float *bias,
                               uint16_t *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    if (K % S8_BLOCK) return 0;
    const int64_t nblocks = K / S8_BLOCK;
    int32_t *xe;
    float *xs;
    const int ok = rows_to_int16(x, M, K, S8_BLOCK, XI_PAIRS, &xe, &xs);
    if (ok) {  /* symmetric codes: no zero-point term */
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t b = 0; b < N / 16; b++) {
            const int8_t *blk = P + b * K * 16;
            __m256 y0[MAX_ROWS], y1[MAX_ROWS];
            for (int64_t m = 0; m < M; m++) y0[m] = y1[m] = _mm256_setzero_ps();
            for (int64_t g = 0; g < nblocks; g++)
                for (int64_t m = 0; m < M; m += 2) {
                    __m256 d0[2], d1[2];
                    const int32_t *xe0 = xe + m * K * 2;
                    const int64_t k0 = g * S8_BLOCK, k1 = k0 + S8_BLOCK;
                    if (m + 1 < M) s8_int16_dots(blk, k0, k1, xe0, xe0 + K * 2, 1, d0, d1);
                    else s8_int16_dots(blk, k0, k1, xe0, NULL, 0, d0, d1);
                    for (int64_t i = m; i < M && i < m + 2; i++) {
                        const __m256 xsg = _mm256_set1_ps(xs[i * nblocks + g]);
                        y0[i] = _mm256_fmadd_ps(d0[i - m], xsg, y0[i]);
                        y1[i] = _mm256_fmadd_ps(d1[i - m], xsg, y1[i]);
                    }
                }
            const __m256 s0 = _mm256_loadu_ps(scales + b * 16), s1 = _mm256_loadu_ps(scales + b * 16 + 8);
            for (int64_t m = 0; m < M; m++) {
                y0[m] = _mm256_mul_ps(y0[m], s0);
                y1[m] = _mm256_mul_ps(y1[m], s1);
            }
            store_panel_rows(y0, y1, M, bias, b * 16, y, N);
        }
    }
    free(xe);
    free(xs);
    return ok;
}

/* M <= MAX_ROWS bfloat16 rows; 0 (nothing written) when a row holds a NaN or an infinity */
static int qgemm_u4_bf16_int16(const uint8_t *P, const uint16_t *S, const uint8_t *Z, const uint16_t *x, const float *bias,
                               uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t G, int nthreads) {
    const int64_t ngroups = K / G;
    int32_t *xe;
    float *xs;
    const int ok = rows_to_int16(x, M, K, G, XI_PAIRS, &xe, &xs);
    if (ok) {
        const float *xsum = xs + M * ngroups;
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t b = 0; b < N / 16; b++) {
            const uint8_t *blk = P + b * (K / 2) * 16;
            __m256 y0[MAX_ROWS], y1[MAX_ROWS];
            for (int64_t m = 0; m < M; m++) y0[m] = y1[m] = _mm256_setzero_ps();
            for (int64_t g = 0; g < ngroups; g++) {
                float s[16], z[16];
                group_sz(S, Z, (b * ngroups + g) * 16, s, z);
                const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
                const __m256 z0 = _mm256_loadu_ps(z), z1 = _mm256_loadu_ps(z + 8);
                for (int64_t m = 0; m < M; m += 2) {
                    __m256 d0[2], d1[2];
                    const int32_t *xe0 = xe + m * K * 2;
                    if (m + 1 < M) u4_int16_dots(blk, g * G / 4, (g + 1) * G / 4, xe0, xe0 + K * 2, 1, d0, d1);
                    else u4_int16_dots(blk, g * G / 4, (g + 1) * G / 4, xe0, NULL, 0, d0, d1);
                    for (int64_t i = m; i < M && i < m + 2; i++) {  /* y += s 2^(e - 14) (dot - z sum(xi)) */
                        const __m256 xsg = _mm256_set1_ps(xs[i * ngroups + g]);
                        const __m256 sumg = _mm256_set1_ps(xsum[i * ngroups + g]);
                        y0[i] = _mm256_fmadd_ps(_mm256_fnmadd_ps(z0, sumg, d0[i - m]), _mm256_mul_ps(s0, xsg), y0[i]);
                        y1[i] = _mm256_fmadd_ps(_mm256_fnmadd_ps(z1, sumg, d1[i - m]), _mm256_mul_ps(s1, xsg), y1[i]);
                    }
                }
            }
            store_panel_rows(y0, y1, M, bias, b * 16, y, N);
        }
    }
    free(xe);
    free(xs);
    return ok;
}
#endif

void tm_qgemv_s8(const int8_t *P, const float *scales, const void *x_in, const float *bias, void *y, int64_t N,
                 int64_t K, int y_bf16, int nthreads) {
#ifdef INT16_ROWS
    if (y_bf16 && qgemm_s8_bf16_int16(P, scales, x_in, bias, y, 1, N, K, nthreads)) return;
#endif
    float *owned;
    const float *x = widen(x_in, K, y_bf16, &owned);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        float acc[16];
        s8_panel_dot(P + b * K * 16, x, 0, K, acc);
        #pragma omp simd
        for (int r = 0; r < 16; r++) acc[r] *= scales[b * 16 + r];
        store16_row(acc, bias, b * 16, y, y_bf16);
    }
    free(owned);
}

void tm_qgemv_u4(const uint8_t *P, const uint16_t *S, const uint8_t *Z, const void *x_in, const float *bias, void *y,
                 int64_t N, int64_t K, int64_t G, int y_bf16, int nthreads) {
#ifdef INT16_ROWS
    if (y_bf16 && qgemm_u4_bf16_int16(P, S, Z, x_in, bias, y, 1, N, K, G, nthreads)) return;
#endif
    float *owned;
    const float *x = widen(x_in, K, y_bf16, &owned);
    const int64_t ngroups = K / G;
    float *xsum = group_sums(x, 1, K, G, 0);  /* shared by every row */
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const uint8_t *blk = P + b * (K / 2) * 16;
        float acc[16] = {0};
        for (int64_t g = 0; g < ngroups; g++) {
            float dot[16];
            u4_panel_dot(blk, x, g * G, (g + 1) * G, dot);
            float s[16], z[16];
                group_sz(S, Z, (b * ngroups + g) * 16, s, z);
            const float xs = xsum[g];
            #pragma omp simd
            for (int r = 0; r < 16; r++) acc[r] += s[r] * (dot[r] - z[r] * xs);
        }
        store16_row(acc, bias, b * 16, y, y_bf16);
    }
    free(xsum);
    free(owned);
}

static void qgemm_s8(const int8_t *P, const float *scales, const void *x_in, const float *bias, void *y, int64_t M,
                     int64_t N, int64_t K, int y_bf16, int nthreads) {
#ifdef INT16_ROWS
    if (y_bf16 && qgemm_s8_bf16_int16(P, scales, x_in, bias, y, M, N, K, nthreads)) return;
#endif
    float *owned;
    const float *x = widen(x_in, M * K, y_bf16, &owned);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const int8_t *blk = P + b * K * 16;
        float acc[MAX_ROWS][16] = {{0}};
        int64_t k = 0;
        for (; k + 2 <= K; k += 2) {  /* each widened pair of lines serves every row */
            float w[32];
            widen_s8x32(blk + k * 16, w);
            for (int64_t m = 0; m < M; m++) {
                const float x0 = x[m * K + k], x1 = x[m * K + k + 1];
                #pragma omp simd
                for (int r = 0; r < 16; r++) acc[m][r] += w[r] * x0 + w[16 + r] * x1;
            }
        }
        for (; k < K; k++)
            for (int64_t m = 0; m < M; m++) {
                const float xk = x[m * K + k];
                #pragma omp simd
                for (int r = 0; r < 16; r++) acc[m][r] += (float)blk[k * 16 + r] * xk;
            }
        const float *s = scales + b * 16;
        for (int64_t m = 0; m < M; m++) {
            #pragma omp simd
            for (int r = 0; r < 16; r++) acc[m][r] *= s[r];
            store16_row(acc[m], bias, b * 16,
                        y_bf16 ? (void *)((uint16_t *)y + m * N) : (void *)((float *)y + m * N), y_bf16);
        }
    }
    free(owned);
}

static void qgemm_u4_bf16(const uint8_t *P, const uint16_t *S, const uint8_t *Z, const uint16_t *x_in, const float *bias,
                          void *y, int64_t M, int64_t N, int64_t K, int64_t G, int nthreads) {
#ifdef INT16_ROWS
    if (qgemm_u4_bf16_int16(P, S, Z, x_in, bias, y, M, N, K, G, nthreads)) return;
#endif
    const int64_t ngroups = K / G;
    float *x;
    widen(x_in, M * K, 1, &x);
    float *xsum = group_sums(x, M, K, G, 0);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const uint8_t *blk = P + b * (K / 2) * 16;
        float acc[MAX_ROWS][16] = {{0}};
        for (int64_t g = 0; g < ngroups; g++) {
            float d[MAX_ROWS][16] = {{0}};
            for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
                float lo[32], hi[32];
                widen_u4x32(blk + (k / 2) * 16, lo, hi);
                for (int64_t m = 0; m < M; m++) {
                    const float *xm = x + m * K + k;
                    const float x0 = xm[0], x1 = xm[1], x2 = xm[2], x3 = xm[3];
                    #pragma omp simd
                    for (int r = 0; r < 16; r++)
                        d[m][r] += (lo[r] * x0 + hi[r] * x1) + (lo[16 + r] * x2 + hi[16 + r] * x3);
                }
            }
            float s[16], z[16];
                group_sz(S, Z, (b * ngroups + g) * 16, s, z);
            for (int64_t m = 0; m < M; m++) {
                const float xs = xsum[m * ngroups + g];
                #pragma omp simd
                for (int r = 0; r < 16; r++) acc[m][r] += s[r] * (d[m][r] - z[r] * xs);
            }
        }
        for (int64_t m = 0; m < M; m++) store16_row(acc[m], bias, b * 16, (uint16_t *)y + m * N, 1);
    }
    free(xsum);
    free(x);
}
#endif

/* any M >= 1, in chunks of at most MAX_ROWS (rows.h) */
void tm_qgemm_s8(const int8_t *P, const float *scales, const void *x_in, const float *bias, void *y, int64_t M,
                 int64_t N, int64_t K, int y_bf16, int nthreads) {
    const int64_t e = y_bf16 ? 2 : 4;
    for (int64_t c = 0, n = row_chunks(M, MAX_ROWS); c < n; c++) {
        const int64_t lo = row_chunk_start(M, n, c), hi = row_chunk_start(M, n, c + 1);
        qgemm_s8(P, scales, (const char *)x_in + lo * K * e, bias, (char *)y + lo * N * e, hi - lo, N, K, y_bf16,
                 nthreads);
    }
}

void tm_qgemm_u4_bf16(const uint8_t *P, const uint16_t *S, const uint8_t *Z, const uint16_t *x, const float *bias, void *y,
                      int64_t M, int64_t N, int64_t K, int64_t G, int nthreads) {
    for (int64_t c = 0, n = row_chunks(M, MAX_ROWS); c < n; c++) {
        const int64_t lo = row_chunk_start(M, n, c), hi = row_chunk_start(M, n, c + 1);
        qgemm_u4_bf16(P, S, Z, x + lo * K, bias, (uint16_t *)y + lo * N, hi - lo, N, K, G, nthreads);
    }
}

/* Dequantize the panels to W^T [K, N] (bfloat16 when out_bf16, else float32), for steps with more rows
 * than the GEMVs take: the dense GEMM that follows (x @ W^T) amortizes this pass. Each panel row of
 * 16 outputs is one contiguous 16-value store, so no transpose is needed. One memory-bound pass per call,
 * so one portable implementation serves every CPU (gcc vectorizes it for the CPU at hand). */
void tm_dequant_s8(const int8_t *P, const float *scales, void *out, int64_t N, int64_t K, int out_bf16,
                   int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const int8_t *blk = P + b * K * 16;
        const float *s = scales + b * 16;
        for (int64_t k = 0; k < K; k++) {
            float w[16];
#if S8_QUAD_LINES
            const uint8_t *quad = (const uint8_t *)blk + (k / 4) * 64 + (k & 3);  /* row r's code at quad[4 r] */
            #pragma omp simd
            for (int r = 0; r < 16; r++) w[r] = (float)(quad[4 * r] - 128) * s[r];
#else
            #pragma omp simd
            for (int r = 0; r < 16; r++) w[r] = (float)blk[k * 16 + r] * s[r];
#endif
            store16(out, k * N + b * 16, w, out_bf16);
        }
    }
}

void tm_dequant_u4(const uint8_t *P, const uint16_t *S, const uint8_t *Z, void *out, int64_t N, int64_t K, int64_t G,
                   int out_bf16, int nthreads) {
    const int64_t ngroups = K / G;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
        const uint8_t *blk = P + b * (K / 2) * 16;
        for (int64_t k2 = 0; k2 < K / 2; k2++) {
            const int64_t sz = (b * ngroups + (2 * k2) / G) * 16;
            float s[16], z[16];
            group_sz(S, Z, sz, s, z);
            float lo[16], hi[16];
#if U4_DWORD_LINES
            /* k = 2 k2 is nibble p = j of each row's dword in its line, k + 1 nibble j + 4 (j = k2 % 4) */
            const uint32_t *line = (const uint32_t *)(blk + (k2 / 4) * 64);
            const int j = (int)(k2 % 4);
            #pragma omp simd
            for (int r = 0; r < 16; r++) {
                lo[r] = ((float)((line[r] >> (4 * j)) & 0xF) - z[r]) * s[r];
                hi[r] = ((float)((line[r] >> (16 + 4 * j)) & 0xF) - z[r]) * s[r];
            }
#else
            const uint8_t *line = blk + k2 * 16;
            #pragma omp simd
            for (int r = 0; r < 16; r++) {
                lo[r] = ((float)(line[r] & 0xF) - z[r]) * s[r];
                hi[r] = ((float)(line[r] >> 4) - z[r]) * s[r];
            }
#endif
            store16(out, (2 * k2) * N + b * 16, lo, out_bf16);
            store16(out, (2 * k2 + 1) * N + b * 16, hi, out_bf16);
        }
    }
}

/* which int4 panel layout this build reads (ops/cpu_qgemv.py pack_int4): 1 for dword lines */
int tm_qgemv_u4_layout(void) { return U4_DWORD_LINES; }

/* which int8 panel layout this build reads (ops/cpu_qgemv.py pack_int8): 1 for quad lines */
int tm_qgemv_s8_layout(void) { return S8_QUAD_LINES; }

/* whether the int8 and int4 kernels multiply bfloat16 rows in integers (ops/cpu_qgemv.py int16_rows) */
int tm_qgemv_int16_rows(void) {
#if S8_QUAD_LINES || defined(INT16_ROWS)
    return 1;
#else
    return 0;
#endif
}

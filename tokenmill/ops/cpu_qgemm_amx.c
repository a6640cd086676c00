/* Weight-only quantized GEMM on AMX-BF16 tiles, for steps with more rows than the GEMVs take (prefill,
 * large decode batches): y[M, N] = x[M, K] W^T (+ bias), x and y bfloat16, W the int8 or int4 panels of
 * ops/cpu_qgemv.c, read as they are stored.
 *
 * The path it replaces dequantized the whole weight to a bfloat16 [K, N] per call and handed it to oneDNN,
 * which reordered it again: about 1 ms per layer of the Qwen2.5-0.5B shape whatever the rows, which made a
 * 128-token AWQ prefill 1.9x bf16's. Here each pair of 16-output panels is widened once per row chunk into
 * bfloat16 B tiles, one unit of k at a time (an int4 group; 128 k of int8) into a per-thread buffer in L1,
 * and every row block of the chunk multiplies against them.
 *
 * Codes become bfloat16 exactly (int8 and q - z both have at most 8 significant bits), products of bf16
 * pairs are exact in float32, and the scale applies per group in float32 after the group's dot product:
 *
 *     int8:  y[m, n] = s[n] * sum_k x[m, k] q[n, k]
 *     int4:  y[m, n] = sum_g s[g, n] * sum_{k in g} x[m, k] (q[n, k] - z[g, n])
 *
 * so no weight is rounded to bfloat16 on the way, unlike the dequantizing path (a torch twin in
 * ops/cpu_qgemm_amx.py). TDPBF16PS takes B as 16 rows of k pairs x 16 outputs:
 *
 *     B tile for panel b, k block c (32 k):   row i = 16 x (w[16 b + j][32 c + 2 i], w[16 b + j][32 c + 2 i + 1])
 *                                             j = 0..15, 64 bytes
 *
 * One int4 dword line (8 k of 16 rows, cpu_qgemv.c) gives 4 such rows: pair (2 t, 2 t + 1) of the line sits at
 * bits 4 t and 16 + 4 t of each row's dword, one shift and mask away from two 16-bit lanes, and a table lookup
 * (vpermw) turns q - z + 16 into bfloat16. An int8 panel's k-quad line gives two rows, one per k pair.
 *
 * x is [Mp, K] with Mp a multiple of 16 (the tiles read whole row blocks; padding rows are not written out).
 * Tiles: C[2 row blocks][2 panels] in 0-3, A in 4-5, B in 6-7. */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include "amx.h"
#include "stream.h"

#define INLINE static inline __attribute__((always_inline))
#define ROW_CHUNK_BYTES (1024 * 1024)  /* x rows per chunk: about this many bytes (L2) */

/* int8 panel in k-quad lines (ops/cpu_qgemv.c), k in [k0, k1) -> (k1 - k0) / 32 B tiles. The low (high) word
 * of each row's dword, narrowed (vpmovdw) and flipped back to signed codes, is a tile row's order for the pair
 * k, k + 1 (k + 2, k + 3): 16 x (w[k], w[k + 1]). Widened to float32 as rows 0-7 and 8-15, they round to
 * bfloat16 exactly (|q| <= 128) and in place. */
static void widen_s8(const int8_t *blk, int64_t k0, int64_t k1, uint8_t *tiles) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int64_t k = k0; k < k1; k += 4) {
        const int8_t *line = blk + k * 16;
        STREAM_PREFETCH(line);
        const __m512i d = _mm512_loadu_si512(line);
        for (int h = 0; h < 2; h++) {
            const __m256i pair = _mm256_xor_si256(_mm512_cvtepi32_epi16(h ? _mm512_srli_epi32(d, 16) : d), flip);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(pair)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(pair, 1)));
            /* tile (k + 2h - k0) / 32 */
            _mm512_store_si512(tiles + (k + 2 * h - k0) * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* int4 panel (dword lines), k in [k0, k1) inside one group with zero points z[16] -> B tiles of q - z;
 * table holds bf16(i - 16) for i = 0..31 */
static void widen_u4(const uint8_t *blk, const uint8_t *z, int64_t k0, int64_t k1, __m512i table, uint8_t *tiles) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F);
    /* 16 - z in both 16-bit halves of each row's lane */
    const __m512i zi = _mm512_sub_epi32(_mm512_set1_epi32(16), _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)z)));
    const __m512i off = _mm512_or_si512(zi, _mm512_slli_epi32(zi, 16));
    for (int64_t k = k0; k < k1; k += 8) {
        const uint8_t *line = blk + (k / 2) * 16;
        STREAM_PREFETCH(line);
        const __m512i d = _mm512_loadu_si512(line);
        uint8_t *row = tiles + (k - k0) * 32;  /* 4 rows of 64 bytes */
        for (int t = 0; t < 4; t++) {
            const __m512i q = _mm512_and_si512(_mm512_srli_epi32(d, 4 * t), mask);
            _mm512_store_si512(row + 64 * t, _mm512_permutexvar_epi16(_mm512_add_epi16(q, off), table));
        }
    }
}

/* n k blocks from block c0 of x, row blocks a (and a + 1 when two), against tiles t0 / t1 (one per panel) */
INLINE void dot_unit(const uint16_t *x, int64_t K, int64_t a, int two, const uint8_t *t0, const uint8_t *t1,
                     int64_t c0, int64_t n) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t c = 0; c < n; c++) {
        _tile_loadd(6, t0 + c * 1024, 64);
        _tile_loadd(7, t1 + c * 1024, 64);
        _tile_loadd(4, x + (a * 16) * K + (c0 + c) * 32, K * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + (a * 16 + 16) * K + (c0 + c) * 32, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* C tiles of row blocks a (, a + 1) x the panel pair -> ac [32 rows][32 outputs]: ac = c * s (first unit of k)
 * or ac += c * s, s[i] the 16 scales of panel i for this unit */
INLINE void scale_into(float c[4][16][16], int two, const __m512 s[2], float *ac, int first) {
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (two) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
    }
    for (int t = 0; t < (two ? 4 : 2); t++) {
        const __m512 sc = s[t % 2];
        for (int r = 0; r < 16; r++) {
            float *o = ac + ((t / 2) * 16 + r) * 32 + (t % 2) * 16;
            const __m512 v = _mm512_load_ps(c[t][r]);
            _mm512_store_ps(o, first ? _mm512_mul_ps(v, sc) : _mm512_fmadd_ps(v, sc, _mm512_load_ps(o)));
        }
    }
}

/* bits 8 or 4. int8: P k-quad lines [N/16][K/4][16][4], S float32 [N], Z unused, G = K. int4: P dword lines [N/16][K/2][16],
 * S float16 and Z uint8 [N/16][K/G][16]. bias float32 [N] or NULL.
 *
 * Two loop orders. A chunk of at most 2 row blocks (decode batches): per panel pair, per unit of k (an int4
 * group; 128 k of int8 where K allows), the unit's B tiles (4 KiB for 128 k) are widened into L1 and
 * multiplied at once. More row blocks (prefill): the pair's whole K is widened into L2 once, then each row
 * block pair runs every group (int8: all of K in one accumulation) with its sums in L1. */
void tm_qgemm_amx_bf16(int bits, const void *P, const void *S, const uint8_t *Z, const uint16_t *x,
                       const float *bias, uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t G, int nthreads) {
    const int64_t NB = N / 16, MB = (M + 15) / 16, KC = K / 32, ngroups = K / G;
    const int64_t U = bits == 4 ? G : (K % 128 == 0 ? 128 : K % 64 == 0 ? 64 : 32);  /* widening unit, small chunks */
    /* rows per chunk: x's chunk (~1 MiB) stays in L2 while every panel pair passes over it */
    int64_t chunk = (ROW_CHUNK_BYTES / (2 * K)) / 32 * 2;
    if (chunk < 2) chunk = 2;
    #pragma omp parallel num_threads(nthreads)
    {
        amx_config_tiles();
        __m512i table;
        {
            uint16_t t[32];
            for (int i = 0; i < 32; i++) t[i] = f32_to_bf16((float)(i - 16));
            table = _mm512_loadu_si512(t);
        }
        uint8_t *tiles = aligned_alloc(64, 2 * KC * 1024);  /* [2 panels][KC] in whole mode, [2][U / 32] per unit */
        float c[4][16][16] __attribute__((aligned(64)));
        float *acc = aligned_alloc(64, (size_t)chunk * 16 * 32 * sizeof(float));  /* [chunk rows][32 outputs] */
        for (int64_t a0 = 0; a0 < MB; a0 += chunk) {
            const int64_t a1 = a0 + chunk < MB ? a0 + chunk : MB;
            const int whole = a1 - a0 > 2;
            const int64_t W = whole ? K : U, CW = W / 32;  /* k widened per call */
            #pragma omp for schedule(static)
            for (int64_t bp = 0; bp < NB / 2; bp++) {
                for (int64_t w = 0; w < K / W; w++) {
                    for (int i = 0; i < 2; i++) {
                        const int64_t b = 2 * bp + i;
                        uint8_t *t = tiles + i * CW * 1024;
                        if (bits == 8) {
                            widen_s8((const int8_t *)P + b * K * 16, w * W, (w + 1) * W, t);
                        } else {
                            for (int64_t g = w * W / G; g < (w + 1) * W / G; g++)
                                widen_u4((const uint8_t *)P + b * (K / 2) * 16, Z + (b * ngroups + g) * 16, g * G,
                                         (g + 1) * G, table, t + (g * G - w * W) * 32);
                        }
                    }
                    /* epilogue units within this widening: int4 groups; int8 one (its scale is the row's) */
                    const int64_t E = bits == 4 ? G : W, CE = E / 32;
                    for (int64_t a = a0; a < a1; a += 2) {
                        const int two = a + 1 < a1;
                        float *ac = acc + (a - a0) * 16 * 32;  /* 32 rows x 32 outputs */
                        for (int64_t e = 0; e < W / E; e++) {
                            const int64_t g = (w * W + e * E) / E;  /* unit index along K */
                            __m512 s[2];
                            for (int i = 0; i < 2; i++)
                                s[i] = bits == 8 ? _mm512_loadu_ps((const float *)S + (2 * bp + i) * 16)
                                                 : _mm512_cvtph_ps(_mm256_loadu_si256(
                                                       (const __m256i *)((const uint16_t *)S + ((2 * bp + i) * ngroups + g) * 16)));
                            dot_unit(x, K, a, two, tiles + e * CE * 1024, tiles + (CW + e * CE) * 1024, g * CE, CE);
                            scale_into(c, two, s, ac, g == 0);
                        }
                    }
                }
                for (int64_t r = 0; r < (a1 - a0) * 16 && a0 * 16 + r < M; r++)
                    for (int j = 0; j < 32; j++) {
                        float v = acc[r * 32 + j];
                        if (bias) v += bias[bp * 32 + j];
                        y[(a0 * 16 + r) * N + bp * 32 + j] = f32_to_bf16(v);
                    }
            }
        }
        free(acc);
        free(tiles);
        _tile_release();
    }
}

int tm_qgemm_amx_available(void) { return amx_request(); }
#else
void tm_qgemm_amx_bf16(int bits, const void *P, const void *S, const uint8_t *Z, const uint16_t *x,
                       const float *bias, uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t G, int nthreads) {
    (void)bits; (void)P; (void)S; (void)Z; (void)x; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)G;
    (void)nthreads;
}

int tm_qgemm_amx_available(void) { return 0; }
#endif

/* Paged decode attention on CPUs: one query token per sequence, over its cached keys/values.
 *
 *   q            [B][Hq][D]                 bfloat16 or float32 (the cache's dtype); rows q_stride apart
 *   key/value    [num_blocks][bs][Hkv][D]   the paged cache, read in place through the block table
 *   block_tables int32 [B][table_stride]    token t of sequence b is in block tables[b][t / bs], slot t % bs
 *   seq_lens     int32 [B]                  keys 0 .. seq_lens[b]-1 are attended
 *   out          [B][Hq][D]
 *
 * Query head h reads KV head h / (Hq / Hkv). Consecutive rows that read the same blocks (the 1 + k rows of a
 * speculative verification: one sequence at lengths L .. L+k) form one group, whose keys and values are read
 * once, 16 tokens (a tile) at a time, and shared by the group's rows times Hq / Hkv query heads, each query
 * masked at its own row's length. So verifying k drafts reads a long context once, not 1 + k times.
 *
 * A group's tokens are cut into chunks of CHUNK at fixed positions, and each (group, chunk) is one task, over
 * every KV head in turn: so one long sequence keeps every thread streaming its own part of the cache (split
 * by KV head instead, the threads read alternate 256-byte pieces of the same blocks, and at batch 1 there are
 * as few tasks as KV heads). A task leaves a softmax state (max, sum, unnormalized output) per query; states
 * are merged chunk by chunk in order. A group of one chunk writes its output directly.
 *
 *   rows     b0: L      b1: L+1     b2: L+2        same block-table entries up to each row's own length
 *   tokens   | chunk 0: 0..511 | chunk 1: 512..1023 | ... | chunk c: ..L+2 |     one task each
 *   queries  b0 heads | b1 heads | b2 heads        per KV head: tile t0..t0+15 read once,
 *                                                  query j scores lanes t0+t < len(j) only
 *
 * Each query's arithmetic is what a task of its row alone would do, in the same order (chunk edges do not
 * depend on the group or the thread count), so grouping changes no bit of the output.
 *
 * Softmax
 * is computed online (running max and sum, FlashAttention-style) in float32, once per tile: 16 scores (from
 * the tile's keys transposed in registers, so no horizontal sums), one vector exp and one rescale of the
 * accumulator, so nothing of size seq_len is materialized. Float32 rows are read in place; bfloat16 rows
 * are widened into a per-tile buffer. The next tile's rows are prefetched: they sit in scattered blocks. Both
 * paths spread the prefetches over the tile's work, so that the loads overlap it (the AVX-512 path one 64-byte
 * slice of each row beside each slice of its arithmetic, the portable path a row beside each row it reads);
 * asked for all at the tile's start they were no better than none.
 *
 *   tile over token positions t0 .. t0+15 of sequence b, KV head h (bs = 16 shown):
 *     pos -> block tables[b][pos / bs], slot pos % bs -> row ((block * bs + slot) * Hkv + h) * D
 *
 * The portable path (no AVX-512) keeps the tiles, the online softmax and the exp polynomial, in loops gcc
 * vectorizes: the tile's keys are transposed once into a buffer (kt[i][t]) so each head's 16 scores are
 * 16-lane FMAs, and the values are added four keys per pass over the head's accumulator row.
 *
 * The task loop, the queries and the merge are shared; each path supplies `attend`, a run of tiles.
 *
 * D must be a multiple of 16 and (Hq / Hkv) * D at most MAX_GROUP_FLOATS (a group takes as many rows as fit).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* the g query heads of one KV head: acc / l, stored as float32 or rounded to bfloat16 */
static inline void write_heads(void *out, const float *acc, const float *l, int64_t o, int64_t g, int64_t D,
                               int bf16) {
    for (int64_t j = 0; j < g; j++) {
        const float inv = 1.0f / l[j];
        for (int64_t i = 0; i < D; i++) {
            const float val = acc[j * D + i] * inv;
            if (bf16) ((uint16_t *)out)[o + j * D + i] = f32_to_bf16(val);
            else ((float *)out)[o + j * D + i] = val;
        }
    }
}

#define MAX_D 256
#define MAX_GROUP_FLOATS 4096
#define TILE 16  /* keys per online-softmax update: one AVX-512 vector of scores */
#define CHUNK 512  /* tokens per task: a long context is split over threads at fixed positions */

static const float ZERO_ROW[MAX_D];  /* stands in for the missing keys of a short tile */

/* element offset of token `pos`'s row for KV head h: through the block table, then [bs][Hkv][D] */
static inline int64_t cache_row(const int32_t *table, int64_t pos, int64_t bs, int64_t Hkv, int64_t h, int64_t D) {
    return (((int64_t)table[pos / bs] * bs + pos % bs) * Hkv + h) * D;
}

/* The element offsets of the rows of the tile at t0 (a multiple of TILE) for KV head h, before L; returns how
 * many (0 past L). When blocks hold whole tiles (bs % TILE == 0, the engine's block sizes) one block-table lookup
 * and a stride, else a lookup per row. Each tile's rows are found once: as the next tile's, to prefetch them, and
 * then used as the current tile's. */
static inline int tile_rows(const int32_t *table, int64_t t0, int64_t L, int64_t bs, int64_t Hkv, int64_t h,
                            int64_t D, int64_t rows[TILE]) {
    const int n = t0 < L ? (int)(L - t0 < TILE ? L - t0 : TILE) : 0;
    if (n && bs % TILE == 0) {
        const int64_t base = cache_row(table, t0, bs, Hkv, h, D);
        for (int t = 0; t < n; t++) rows[t] = base + t * Hkv * D;
    } else {
        for (int t = 0; t < n; t++) rows[t] = cache_row(table, t0 + t, bs, Hkv, h, D);
    }
    return n;
}

/* keys of this tile that query j attends: those before its row's length (0 when the tile is past it) */
static inline int tile_keys(int64_t len, int64_t t0) {
    return (int)(len - t0 >= TILE ? TILE : len - t0 > 0 ? len - t0 : 0);
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline void row_to_f32(const void *base, int64_t offset, int bf16, float *dst, int64_t D) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < D; i += 16) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
    } else {
        memcpy(dst, (const float *)base + offset, D * sizeof(float));
    }
}

/* e^x for x <= 0, lanes at most a couple of ulp off expf: x = n ln2 + r with |r| <= ln2 / 2, a
 * degree-7 Taylor polynomial for e^r, then scale by 2^n. Below -87 the result is clamped to ~1e-38. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* In place: r[t] holds 16 floats of key t; afterwards r[c] holds element c of keys 0..15, so that a query
 * head's 16 scores come out of 16 FMAs with no horizontal sums. Three rounds of shuffles:
 *   unpack 32-bit pairs, unpack 64-bit pairs -> u[m] lane L = element 4L+m of keys 4q..4q+3 (u index 4q+m),
 *   then two rounds of 128-bit lane shuffles gather the four key groups of element c = 4L+m. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int q = 0; q < 16; q += 4) {
        u[q] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[q]), _mm512_castps_pd(t[q + 2])));
        u[q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[q]), _mm512_castps_pd(t[q + 2])));
        u[q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[q + 1]), _mm512_castps_pd(t[q + 3])));
        u[q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[q + 1]), _mm512_castps_pd(t[q + 3])));
    }
    for (int m = 0; m < 4; m++) {
        const __m512 x = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44), y = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
        const __m512 x2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
        const __m512 y2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
        r[m] = _mm512_shuffle_f32x4(x, x2, 0x88);
        r[4 + m] = _mm512_shuffle_f32x4(x, x2, 0xDD);
        r[8 + m] = _mm512_shuffle_f32x4(y, y2, 0x88);
        r[12 + m] = _mm512_shuffle_f32x4(y, y2, 0xDD);
    }
}

/* one task's share of KV head h: g query heads over the cached tokens T0 .. L-1 (T0 a multiple of TILE),
 * query j attending those before len[j], online softmax state in (m, l, acc), queries qf already scaled */
static void attend(const float *qf, float *acc, float *m, float *l, const void *key_cache, const void *value_cache,
                   const int32_t *table, const int64_t *len, int64_t T0, int64_t L, int64_t g, int64_t Hkv, int64_t h,
                   int64_t D, int64_t bs, int bf16) {
    const int64_t elem = bf16 ? 2 : 4;
    float kbuf[TILE * MAX_D], vbuf[TILE * MAX_D], probs[MAX_GROUP_FLOATS], rescale[MAX_GROUP_FLOATS / 16];
    const float *k[TILE], *v[TILE];
    __m512 sacc[MAX_GROUP_FLOATS / 16], lsum[MAX_GROUP_FLOATS / 16];  /* lsum: each query's l, 16 lanes to add up */
    for (int64_t j = 0; j < g; j++) lsum[j] = _mm512_mask_mov_ps(_mm512_setzero_ps(), 1, _mm512_set1_ps(l[j]));
    int64_t rows[TILE], next[TILE];
    int n = tile_rows(table, T0, L, bs, Hkv, h, D, rows);
    for (int64_t t0 = T0; t0 < L; t0 += TILE) {
        /* the tile's key and value rows, as float32, shared by the group's query heads */
        for (int t = 0; t < n; t++) {
            const int64_t row = rows[t];
            if (bf16) {
                row_to_f32(key_cache, row, 1, kbuf + t * D, D);
                row_to_f32(value_cache, row, 1, vbuf + t * D, D);
                k[t] = kbuf + t * D;
                v[t] = vbuf + t * D;
            } else {
                k[t] = (const float *)key_cache + row;
                v[t] = (const float *)value_cache + row;
            }
        }
        for (int t = n; t < TILE; t++) k[t] = ZERO_ROW;
        /* the next tile's rows, asked for a slice of each at a time below: spread over this tile's compute
         * rather than 8 lines per row at once, which left the loads waiting for the prefetches */
        const int n1 = tile_rows(table, t0 + TILE, L, bs, Hkv, h, D, next);
        /* scores: every head's 16 at once, from the tile transposed 16 elements at a time */
        for (int64_t j = 0; j < g; j++) sacc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
            for (int t = 0; t < n1; t++) __builtin_prefetch((const char *)key_cache + (next[t] + i) * elem, 0, 3);
            __m512 col[16];
            for (int t = 0; t < TILE; t++) col[t] = _mm512_loadu_ps(k[t] + i);
            transpose16(col);
            for (int64_t j = 0; j < g; j++) {
                const float *qj = qf + j * D + i;
                __m512 a = sacc[j];
                for (int c = 0; c < 16; c++) a = _mm512_fmadd_ps(_mm512_set1_ps(qj[c]), col[c], a);
                sacc[j] = a;
            }
        }
        /* each query's new running max; then the rescales of what earlier tiles summed, 16 queries per vector
         * exp (a libm expf per query was ~15 % of a nine-row verification), ~1e-38 rather than 0 at the start,
         * where it multiplies zeros; then each query's probabilities (0 past its length), its sum kept as a
         * vector until the task ends */
        __mmask16 valid[MAX_GROUP_FLOATS / 16];  /* the keys each query attends (0: none, the tile is past it) */
        float m_new[MAX_GROUP_FLOATS / 16];
        for (int64_t j = 0; j < g; j++) {
            valid[j] = (__mmask16)((1u << tile_keys(len[j], t0)) - 1);
            sacc[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[j], sacc[j]);
            m_new[j] = valid[j] ? fmaxf(m[j], _mm512_reduce_max_ps(sacc[j])) : m[j];
        }
        for (int64_t j0 = 0; j0 < g; j0 += 16) {
            const __mmask16 lanes = (__mmask16)(g - j0 >= 16 ? 0xFFFF : (1u << (g - j0)) - 1);
            const __m512 diff = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, m + j0), _mm512_maskz_loadu_ps(lanes, m_new + j0));
            _mm512_mask_storeu_ps(rescale + j0, lanes, exp512(diff));
        }
        for (int64_t j = 0; j < g; j++) {
            if (!valid[j]) continue;
            const __m512 p = _mm512_maskz_mov_ps(valid[j], exp512(_mm512_sub_ps(sacc[j], _mm512_set1_ps(m_new[j]))));
            lsum[j] = _mm512_fmadd_ps(lsum[j], _mm512_set1_ps(rescale[j]), p);
            m[j] = m_new[j];
            _mm512_storeu_ps(probs + j * TILE, p);
        }
        /* values 16 elements at a time: the tile's 16 rows stay in registers for every query, which adds
         * them in key order as alone (a key past a query's length adds p = 0, which leaves the sum as is) */
        for (int64_t i = 0; i < D; i += 16) {
            for (int t = 0; t < n1; t++) __builtin_prefetch((const char *)value_cache + (next[t] + i) * elem, 0, 3);
            __m512 vr[TILE];
            for (int t = 0; t < TILE; t++) vr[t] = t < n ? _mm512_loadu_ps(v[t] + i) : _mm512_setzero_ps();
            for (int64_t j = 0; j < g; j++) {
                if (!valid[j]) continue;
                const float *pj = probs + j * TILE;
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + j * D + i), _mm512_set1_ps(rescale[j]));
                for (int t = 0; t < TILE; t++) a = _mm512_fmadd_ps(_mm512_set1_ps(pj[t]), vr[t], a);
                _mm512_storeu_ps(acc + j * D + i, a);
            }
        }
        memcpy(rows, next, sizeof(rows));  /* the next tile's rows are the next iteration's */
        n = n1;
    }
    for (int64_t j = 0; j < g; j++) l[j] = _mm512_reduce_add_ps(lsum[j]);
}
#else
static inline void row_to_f32(const void *base, int64_t offset, int bf16, float *dst, int64_t D) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        #pragma omp simd
        for (int64_t i = 0; i < D; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, D * sizeof(float));
    }
}

/* e^x for -87 <= x <= 0 (the caller clamps), the AVX-512 path's polynomial lane by lane: x = n ln2 + r,
 * degree-7 Taylor for e^r, times 2^n built in the exponent bits. n is rounded to nearest by adding and
 * subtracting 1.5 * 2^23. No compares in here: gcc if-converts a float select only where it is stored. */
static inline float exp_le0(float x) {
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * bits_f32((uint32_t)((int32_t)n + 127) << 23);  /* n >= -126: a normal power of two */
}

/* y += sum_u a[u] x[u] over a whole row (in L1), four keys per pass over y. Not inlined: in the loop over
 * keys gcc 12 unrolls-and-jams it and reads the rows with gathers. */
static __attribute__((noinline)) void axpy4(float *restrict y, const float *const x[4], const float a[4], int64_t D) {
    const float *restrict x0 = x[0], *restrict x1 = x[1], *restrict x2 = x[2], *restrict x3 = x[3];
    const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    #pragma omp simd
    for (int64_t i = 0; i < D; i++) y[i] += (a0 * x0[i] + a1 * x1[i]) + (a2 * x2[i] + a3 * x3[i]);
}

/* one task's share of KV head h: g query heads over the cached tokens T0 .. L-1 (T0 a multiple of TILE),
 * query j attending those before len[j], online softmax state in (m, l, acc), queries qf already scaled */
static void attend(const float *qf, float *acc, float *m, float *l, const void *key_cache, const void *value_cache,
                   const int32_t *table, const int64_t *len, int64_t T0, int64_t L, int64_t g, int64_t Hkv, int64_t h,
                   int64_t D, int64_t bs, int bf16) {
    const int64_t elem = bf16 ? 2 : 4;
    /* the tile's keys transposed, kt[i][t] = element i of key t, so a head's 16 scores are 16-lane FMAs
     * (no horizontal sums); written once per tile, read by the group's query heads */
    float kt[MAX_D * TILE], vbuf[TILE * MAX_D];
    const float *v[TILE];
    int64_t rows[TILE], next[TILE];
    int n = tile_rows(table, T0, L, bs, Hkv, h, D, rows);
    for (int64_t t0 = T0; t0 < L; t0 += TILE) {
        /* the next tile's rows, asked for one at a time beside this tile's rows as they are read (not all at once) */
        const int n1 = tile_rows(table, t0 + TILE, L, bs, Hkv, h, D, next);
        for (int t = 0; t < n; t++) {
            const int64_t row = rows[t];
            if (t < n1) {
                for (int64_t off = 0; off < D * elem; off += 64) {
                    __builtin_prefetch((const char *)key_cache + next[t] * elem + off, 0, 3);
                    __builtin_prefetch((const char *)value_cache + next[t] * elem + off, 0, 3);
                }
            }
            if (bf16) {
                const uint16_t *kr = (const uint16_t *)key_cache + row;
                for (int64_t i = 0; i < D; i++) kt[i * TILE + t] = bf16_to_f32(kr[i]);
                row_to_f32(value_cache, row, 1, vbuf + t * D, D);
                v[t] = vbuf + t * D;
            } else {
                const float *kr = (const float *)key_cache + row;
                for (int64_t i = 0; i < D; i++) kt[i * TILE + t] = kr[i];
                v[t] = (const float *)value_cache + row;
            }
        }
        for (int t = n; t < TILE; t++)  /* a short last tile: defined values in lanes masked below */
            for (int64_t i = 0; i < D; i++) kt[i * TILE + t] = 0.0f;
        for (int64_t j = 0; j < g; j++) {
            const int nj = tile_keys(len[j], t0);
            if (nj == 0) continue;
            const float *qj = qf + j * D;
            float s0[TILE] = {0}, s1[TILE] = {0}, s2[TILE] = {0}, s3[TILE] = {0};  /* 4 chains: D % 16 == 0 */
            for (int64_t i = 0; i < D; i += 4) {
                const float q0 = qj[i], q1 = qj[i + 1], q2 = qj[i + 2], q3 = qj[i + 3];
                const float *k0 = kt + i * TILE;
                #pragma omp simd
                for (int t = 0; t < TILE; t++) {
                    s0[t] += q0 * k0[t];
                    s1[t] += q1 * k0[TILE + t];
                    s2[t] += q2 * k0[2 * TILE + t];
                    s3[t] += q3 * k0[3 * TILE + t];
                }
            }
            float smax = m[j];
            for (int t = 0; t < nj; t++) {
                s0[t] = (s0[t] + s1[t]) + (s2[t] + s3[t]);
                smax = s0[t] > smax ? s0[t] : smax;  /* not fmaxf: gcc calls libm for it */
            }
            for (int t = nj; t < TILE; t++) s0[t] = -INFINITY;  /* keys this query does not attend */
            const float c = expf(m[j] - smax);  /* rescales what earlier tiles summed; 0 at the start */
            float x[TILE], p[TILE], psum = 0.0f;
            #pragma omp simd
            for (int t = 0; t < TILE; t++) {
                const float d = s0[t] - smax;
                x[t] = d < -87.0f ? -87.0f : d;  /* ~1e-38 below, as the AVX-512 path */
            }
            #pragma omp simd
            for (int t = 0; t < TILE; t++) p[t] = exp_le0(x[t]);
            for (int t = nj; t < TILE; t++) p[t] = 0.0f;
            #pragma omp simd reduction(+ : psum)
            for (int t = 0; t < TILE; t++) psum += p[t];
            l[j] = l[j] * c + psum;
            m[j] = smax;
            float *aj = acc + j * D;
            #pragma omp simd
            for (int64_t i = 0; i < D; i++) aj[i] *= c;
            int t = 0;
            for (; t + 4 <= nj; t += 4) axpy4(aj, v + t, p + t, D);
            for (; t < nj; t++) axpy4(aj, (const float *[4]){v[t], ZERO_ROW, ZERO_ROW, ZERO_ROW},
                                     (const float[4]){p[t], 0.0f, 0.0f, 0.0f}, D);
        }
        memcpy(rows, next, sizeof(rows));  /* the next tile's rows are the next iteration's */
        n = n1;
    }
}
#endif

/* Rows b0 .. b-1 and row b read the same blocks up to row b's length: b may join b0's group (read through
 * b0's table). Rows of a speculative verification always do; unrelated rows differ in some block. */
static int same_blocks(const int32_t *tables, int64_t table_stride, int64_t b0, int64_t b, int64_t len, int64_t bs) {
    return memcmp(tables + b0 * table_stride, tables + b * table_stride, ((len + bs - 1) / bs) * sizeof(int32_t)) == 0;
}

/* The thread-local scratch for partial softmax states, grown as needed and kept: a long context's partials
 * are rewritten every layer, so allocating them per call would fault fresh pages in each time. */
static float *partials(size_t floats) {
    static __thread float *buf;
    static __thread size_t cap;
    if (floats > cap) {
        free(buf);
        cap = floats + floats / 2;
        buf = malloc(cap * sizeof(float));
        if (!buf) cap = 0;
    }
    return buf;
}

/* the group of task `task`: the last grp with first[grp] <= task */
static int64_t task_group(const int64_t *first, int64_t G, int64_t task) {
    int64_t lo = 0, hi = G - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= task) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* softmax partial states (m, l, acc[D]) of one query over its chunks, in order, into out: each chunk's sum
 * rescaled to the largest max. Chunks past the query's length hold l = 0 and add nothing. */
static void merge_chunks(const float *part, int64_t nchunks, int64_t chunk_stride, int64_t D, void *out,
                         int64_t o, int bf16) {
    float mx = -INFINITY, l = 0.0f, acc[MAX_D];
    for (int64_t c = 0; c < nchunks; c++)
        if (part[c * chunk_stride + 1] > 0.0f && part[c * chunk_stride] > mx) mx = part[c * chunk_stride];
    memset(acc, 0, D * sizeof(float));
    for (int64_t c = 0; c < nchunks; c++) {
        const float *pc = part + c * chunk_stride;
        if (pc[1] == 0.0f) continue;
        const float w = expf(pc[0] - mx);
        l += pc[1] * w;
        for (int64_t i = 0; i < D; i++) acc[i] += pc[2 + i] * w;
    }
    write_heads(out, acc, &l, o, 1, D, bf16);
}

void tm_paged_decode_attention(const void *q, int64_t q_stride, const void *key_cache, const void *value_cache,
                               const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                               void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                               float scale, int bf16, int nthreads) {
    const int64_t g = Hq / Hkv, rows_per_group = MAX_GROUP_FLOATS / (g * D), state = D + 2;
    int64_t starts[B + 1], G = 0;  /* group i is rows starts[i] .. starts[i+1]-1 */
    for (int64_t b = 0; b < B; b++)
        if (b == 0 || b - starts[G - 1] >= rows_per_group ||
            !same_blocks(block_tables, table_stride, starts[G - 1], b, seq_lens[b], bs))
            starts[G++] = b;
    starts[G] = B;
    /* group grp's chunks are tasks first[grp] .. first[grp+1]-1; its partial states start at part_at[grp] */
    int64_t first[G + 1], part_at[G + 1], longest[G];
    first[0] = part_at[0] = 0;
    for (int64_t grp = 0; grp < G; grp++) {
        longest[grp] = 0;
        for (int64_t b = starts[grp]; b < starts[grp + 1]; b++)
            longest[grp] = seq_lens[b] > longest[grp] ? seq_lens[b] : longest[grp];
        const int64_t chunks = (longest[grp] + CHUNK - 1) / CHUNK;
        first[grp + 1] = first[grp] + chunks;
        /* one chunk: its task writes the output itself */
        part_at[grp + 1] = part_at[grp] + (chunks > 1 ? chunks * Hkv * (starts[grp + 1] - starts[grp]) * g * state : 0);
    }
    float *part = part_at[G] ? partials((size_t)part_at[G]) : NULL;
    if (part_at[G] && !part) return;  /* out of memory: leave the output unwritten rather than crash */
    #pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t task = 0; task < first[G]; task++) {
        const int64_t grp = task_group(first, G, task), c = task - first[grp], chunks = first[grp + 1] - first[grp];
        const int64_t b0 = starts[grp], nq = (starts[grp + 1] - b0) * g;
        const int64_t T0 = c * CHUNK, T1 = longest[grp] < T0 + CHUNK ? longest[grp] : T0 + CHUNK;
        float qf[MAX_GROUP_FLOATS], acc[MAX_GROUP_FLOATS], m[MAX_GROUP_FLOATS / 16], l[MAX_GROUP_FLOATS / 16];
        int64_t len[MAX_GROUP_FLOATS / 16];
        for (int64_t h = 0; h < Hkv; h++) {
            for (int64_t b = b0; b < starts[grp + 1]; b++)
                for (int64_t j = (b - b0) * g; j < (b - b0 + 1) * g; j++) {
                    row_to_f32(q, b * q_stride + (h * g + j % g) * D, bf16, qf + j * D, D);
                    for (int64_t i = 0; i < D; i++) qf[j * D + i] *= scale;
                    m[j] = -INFINITY;
                    l[j] = 0.0f;
                    len[j] = seq_lens[b];
                }
            memset(acc, 0, nq * D * sizeof(float));
            attend(qf, acc, m, l, key_cache, value_cache, block_tables + b0 * table_stride, len, T0, T1, nq, Hkv, h,
                   D, bs, bf16);
            if (chunks == 1) {
                for (int64_t b = b0; b < starts[grp + 1]; b++)
                    write_heads(out, acc + (b - b0) * g * D, l + (b - b0) * g, (b * Hq + h * g) * D, g, D, bf16);
                continue;
            }
            /* partial states laid out [query j][KV head h][chunk c][m, l, acc]: a query's chunks are adjacent */
            for (int64_t j = 0; j < nq; j++) {
                float *dst = part + part_at[grp] + ((j * Hkv + h) * chunks + c) * state;
                dst[0] = m[j];
                dst[1] = l[j];
                memcpy(dst + 2, acc + j * D, D * sizeof(float));
            }
        }
    }
    if (!part) return;
    /* a few groups' merges (a batch-1 verification: a microsecond) stay on this thread: no second fork */
    #pragma omp parallel for schedule(dynamic) num_threads(nthreads) if (G >= 4 * nthreads)
    for (int64_t grp = 0; grp < G; grp++) {
        const int64_t chunks = first[grp + 1] - first[grp], b0 = starts[grp];
        if (chunks == 1) continue;
        for (int64_t j = 0; j < (starts[grp + 1] - b0) * g; j++)
            for (int64_t h = 0; h < Hkv; h++)
                merge_chunks(part + part_at[grp] + (j * Hkv + h) * chunks * state, chunks, state, D, out,
                             ((b0 + j / g) * Hq + h * g + j % g) * D, bf16);
    }
}

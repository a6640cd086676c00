/* Paged decode attention on AVX-512 CPUs: one query token per sequence, over its cached keys/values.
 *
 *   q            [B][Hq][D]                 bfloat16 or float32 (the cache's dtype); rows q_stride apart
 *   key/value    [num_blocks][bs][Hkv][D]   the paged cache, read in place through the block table
 *   block_tables int32 [B][table_stride]    token t of sequence b is in block tables[b][t / bs], slot t % bs
 *   seq_lens     int32 [B]                  keys 0 .. seq_lens[b]-1 are attended
 *   out          [B][Hq][D]
 *
 * Query head h reads KV head h / (Hq / Hkv). Each (sequence, KV head) pair is one task: its keys and values
 * are read once, converted to float32 a row at a time, and shared by the Hq / Hkv query heads of the group.
 * Softmax is computed online (running max and sum, FlashAttention-style) in float32, so nothing of size
 * seq_len is materialized. D must be a multiple of 16 and (Hq / Hkv) * D at most MAX_GROUP_FLOATS.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_D 256
#define MAX_GROUP_FLOATS 4096

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

static inline uint16_t f32_to_bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float dot(const float *a, const float *b, int64_t D) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
}

/* acc = acc * c + p * v */
static inline void scale_add(float *acc, float c, float p, const float *v, int64_t D) {
    __m512 vc = _mm512_set1_ps(c), vp = _mm512_set1_ps(p);
    for (int64_t i = 0; i < D; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(vp, _mm512_loadu_ps(v + i), _mm512_mul_ps(vc, _mm512_loadu_ps(acc + i))));
}

void tm_paged_decode_attention(const void *q, int64_t q_stride, const void *key_cache, const void *value_cache,
                               const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                               void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                               float scale, int bf16, int nthreads) {
    const int64_t g = Hq / Hkv;
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(nthreads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hkv; h++) {
            float qf[MAX_GROUP_FLOATS], acc[MAX_GROUP_FLOATS], kf[MAX_D], vf[MAX_D], m[MAX_GROUP_FLOATS / 16],
                l[MAX_GROUP_FLOATS / 16];
            const int32_t *table = block_tables + b * table_stride;
            const int64_t L = seq_lens[b];
            for (int64_t j = 0; j < g; j++) {
                row_to_f32(q, b * q_stride + (h * g + j) * D, bf16, qf + j * D, D);
                for (int64_t i = 0; i < D; i++) qf[j * D + i] *= scale;
                m[j] = -INFINITY;
                l[j] = 0.0f;
            }
            memset(acc, 0, g * D * sizeof(float));
            for (int64_t t = 0; t < L; t++) {
                const int64_t row = (((int64_t)table[t / bs] * bs + t % bs) * Hkv + h) * D;
                row_to_f32(key_cache, row, bf16, kf, D);
                row_to_f32(value_cache, row, bf16, vf, D);
                for (int64_t j = 0; j < g; j++) {
                    const float s = dot(qf + j * D, kf, D);
                    if (s > m[j]) {  /* a new running max rescales what was summed so far */
                        const float c = expf(m[j] - s);
                        m[j] = s;
                        l[j] = l[j] * c + 1.0f;
                        scale_add(acc + j * D, c, 1.0f, vf, D);
                    } else {
                        const float p = expf(s - m[j]);
                        l[j] += p;
                        scale_add(acc + j * D, 1.0f, p, vf, D);
                    }
                }
            }
            for (int64_t j = 0; j < g; j++) {
                const float inv = 1.0f / l[j];
                const int64_t o = (b * Hq + h * g + j) * D;
                for (int64_t i = 0; i < D; i++) {
                    const float v = acc[j * D + i] * inv;
                    if (bf16) ((uint16_t *)out)[o + i] = f32_to_bf16_rne(v);
                    else ((float *)out)[o + i] = v;
                }
            }
        }
    }
}

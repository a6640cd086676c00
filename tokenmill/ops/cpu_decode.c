/* A decode step of up to 64 rows (one token each) through the whole Llama decoder in one call (CPU).
 *
 * A decode step of a small model is ~10 kernel calls per layer from Python, and the Python, ctypes and
 * torch dispatch between them costs more than their math; the OpenMP workers also fall asleep in the gaps
 * and must be woken for each call. This driver makes the same calls, in the same order, on the same
 * kernels (linked from cpu_gemv.c, cpu_qgemv.c, cpu_fused.c and cpu_attention.c into this library), so
 * its hidden state is bit-identical to the per-op path's (models/llama.py), which stays its twin:
 *
 *   x = embed[tokens]                                        (B rows: decodes, or verification rows)
 *   per layer:  h = norm(x [+ residual])  qkv = h Wqkv  rotary(q, k)  cache[slot] = k, v
 *               a = attention(q, cache[table, :seq_len])  x = a Wo  h = norm(x + residual)
 *               x = silu(h Wgate) * (h Wup) Wdown
 *   out = norm(x + residual)                                 (the LM head stays outside, as in the graphs)
 *
 * KV caches are [num_blocks][block_size][Hkv][D]; row b's token at position pos[b] sits in block
 * tables[b][pos / bs], slot pos % bs, and slot[b] = that block * bs + pos % bs is where its K/V go.
 * A linear layer takes its one-row kernel for one row and its few-row kernel for more, as `apply` does.
 *
 * Scratch (dtype elements, carved from one buffer, MAX_ROWS rows each):
 *   residual [D] | x [D] | h [D] | qkv [(Hq + 2 Hkv) hd] | attn [Hq hd] | gate_up [2 I] | act [I] | cos, sin [hd]
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

void tm_gemv_f32(const float *P, const float *x, const float *bias, float *y, int64_t N, int64_t K, int nthreads);
void tm_gemv_bf16_vnni(const uint16_t *P, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t N, int64_t K,
                       int nthreads);
void tm_qgemv_s8(const int8_t *P, const float *scales, const void *x_in, const float *bias, void *y, int64_t N,
                 int64_t K, int y_bf16, int nthreads);
void tm_qgemv_u4(const uint8_t *P, const uint16_t *S, const uint8_t *Z, const void *x_in, const float *bias, void *y,
                 int64_t N, int64_t K, int64_t G, int y_bf16, int nthreads);
void tm_gemm_rows_f32(const float *P, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                      int nthreads);
void tm_gemm_rows_bf16(const uint16_t *P, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                       int64_t K, int nthreads);
void tm_qgemm_s8(const int8_t *P, const float *scales, const void *x_in, const float *bias, void *y, int64_t M,
                 int64_t N, int64_t K, int y_bf16, int nthreads);
void tm_qgemm_u4_bf16(const uint8_t *P, const uint16_t *S, const uint8_t *Z, const uint16_t *x, const float *bias,
                      uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t G, int nthreads);
void tm_add_rmsnorm(const void *x, void *residual, const void *w, void *out, int64_t T, int64_t D, float eps,
                    int bf16, int nthreads);
void tm_silu_mul(const void *gu, void *out, int64_t T, int64_t I, int bf16, int nthreads);
void tm_rotary(void *qkv, const void *cos, const void *sin, int64_t T, int64_t H, int64_t hd, int64_t row_stride,
               int bf16, int nthreads);
void tm_paged_decode_attention(const void *q, int64_t q_stride, const void *key_cache, const void *value_cache,
                               const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                               void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                               float scale, int bf16, int nthreads);

enum { LIN_F32 = 0, LIN_BF16 = 1, LIN_S8 = 2, LIN_U4 = 3 };

typedef struct {
    int64_t kind, n, k, group;
    const void *w, *scales, *zeros, *bias;  /* bias: the weights' dtype for LIN_F32/BF16, float32 otherwise */
} tm_linear;

typedef struct {
    const void *input_norm, *post_norm;
    tm_linear qkv, o, gate_up, down;
    void *key_cache, *value_cache;
} tm_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, bf16;
    float eps, scale;
    const void *embed, *final_norm, *cos, *sin;  /* cos/sin [max_positions][head_dim] */
    const tm_layer *layers;
    void *scratch;
} tm_decoder;

#define MAX_ROWS 64  /* the linears' kernels take any row count (in chunks of 8, rows.h) */

/* M rows: the kernel the layer's `apply` takes for M rows (layers/linear.py, quantization/) */
static void linear(const tm_linear *l, const char *x, char *y, int64_t M, int bf16, int nt) {
    const int64_t e = bf16 ? 2 : 4;
    switch (l->kind) {
    case LIN_F32:
        if (M == 1) tm_gemv_f32(l->w, (const float *)x, l->bias, (float *)y, l->n, l->k, nt);
        else tm_gemm_rows_f32(l->w, (const float *)x, l->bias, (float *)y, M, l->n, l->k, nt);
        break;
    case LIN_BF16:
        if (M == 1) tm_gemv_bf16_vnni(l->w, (const uint16_t *)x, l->bias, (uint16_t *)y, l->n, l->k, nt);
        else tm_gemm_rows_bf16(l->w, (const uint16_t *)x, l->bias, (uint16_t *)y, M, l->n, l->k, nt);
        break;
    case LIN_S8:
        if (M == 1) tm_qgemv_s8(l->w, l->scales, x, l->bias, y, l->n, l->k, bf16, nt);
        else tm_qgemm_s8(l->w, l->scales, x, l->bias, y, M, l->n, l->k, bf16, nt);
        break;
    default:
        if (M > 1 && bf16) {
            tm_qgemm_u4_bf16(l->w, l->scales, l->zeros, (const uint16_t *)x, l->bias, (uint16_t *)y, M, l->n, l->k,
                             l->group, nt);
        } else {  /* float32 rows go one at a time, as in ops/cpu_qgemv.py */
            for (int64_t m = 0; m < M; m++)
                tm_qgemv_u4(l->w, l->scales, l->zeros, x + m * l->k * e, l->bias, y + m * l->n * e, l->n, l->k,
                            l->group, bf16, nt);
        }
        break;
    }
}

int64_t tm_decode_max_rows(void) { return MAX_ROWS; }

int64_t tm_decode_scratch_elems(const tm_decoder *m) {
    return MAX_ROWS * (3 * m->hidden + (2 * m->num_heads + 2 * m->num_kv_heads) * m->head_dim + 3 * m->intermediate
                       + 2 * m->head_dim);
}

/* B <= MAX_ROWS rows. tokens, pos, slot: int64 [B]; tables: int32 [B][table_stride]; seq_lens: int32 [B]
 * (pos + 1 for a decode; a verification row's own length). out [B][hidden]. */
void tm_decode_rows(const tm_decoder *m, int64_t B, const int64_t *tokens, const int64_t *pos, const int64_t *slot,
                    const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, void *out, int nt) {
    const int bf16 = (int)m->bf16;
    const int64_t e = bf16 ? 2 : 4, D = m->hidden, hd = m->head_dim, I = m->intermediate;
    const int64_t nh = m->num_heads, nkv = m->num_kv_heads, row = (nh + 2 * nkv) * hd, kv_row = nkv * hd;
    char *s = m->scratch;
    char *residual = s, *x = residual + MAX_ROWS * D * e, *h = x + MAX_ROWS * D * e, *qkv = h + MAX_ROWS * D * e;
    char *attn = qkv + MAX_ROWS * row * e, *gu = attn + MAX_ROWS * nh * hd * e, *act = gu + MAX_ROWS * 2 * I * e;
    char *cos = act + MAX_ROWS * I * e, *sin = cos + MAX_ROWS * hd * e;

    for (int64_t b = 0; b < B; b++) {  /* the embedding rows, and each row's cos / sin (gathered once) */
        memcpy(x + b * D * e, (const char *)m->embed + tokens[b] * D * e, D * e);
        memcpy(cos + b * hd * e, (const char *)m->cos + pos[b] * hd * e, hd * e);
        memcpy(sin + b * hd * e, (const char *)m->sin + pos[b] * hd * e, hd * e);
    }
    for (int64_t i = 0; i < m->num_layers; i++) {
        const tm_layer *L = &m->layers[i];
        if (i == 0) {  /* the embedding is the first residual */
            memcpy(residual, x, B * D * e);
            tm_add_rmsnorm(x, NULL, L->input_norm, h, B, D, m->eps, bf16, nt);
        } else {
            tm_add_rmsnorm(x, residual, L->input_norm, h, B, D, m->eps, bf16, nt);
        }
        linear(&L->qkv, h, qkv, B, bf16, nt);
        tm_rotary(qkv, cos, sin, B, nh + nkv, hd, row, bf16, nt);
        for (int64_t b = 0; b < B; b++) {
            const char *r = qkv + b * row * e;
            memcpy((char *)L->key_cache + slot[b] * kv_row * e, r + nh * hd * e, kv_row * e);
            memcpy((char *)L->value_cache + slot[b] * kv_row * e, r + (nh + nkv) * hd * e, kv_row * e);
        }
        tm_paged_decode_attention(qkv, row, L->key_cache, L->value_cache, tables, table_stride, seq_lens, attn, B, nh,
                                  nkv, hd, m->block_size, m->scale, bf16, nt);
        linear(&L->o, attn, x, B, bf16, nt);
        tm_add_rmsnorm(x, residual, L->post_norm, h, B, D, m->eps, bf16, nt);
        linear(&L->gate_up, h, gu, B, bf16, nt);
        tm_silu_mul(gu, act, B, I, bf16, nt);
        linear(&L->down, act, x, B, bf16, nt);
    }
    tm_add_rmsnorm(x, residual, m->final_norm, out, B, D, m->eps, bf16, nt);
}

/* Whether any of a request's first s tokens is one of its nstop stop tokens. */
static int is_stop(const int64_t *toks, int64_t s, const int64_t *stop, int64_t nstop) {
    for (int64_t i = 0; i < s; i++)
        for (int64_t j = 0; j < nstop; j++)
            if (toks[i] == stop[j]) return 1;
    return 0;
}

/* index of the first maximum of v[0 .. n) (dtype elements), as torch's max(dim).indices */
static int64_t argmax_row(const char *v, int64_t n, int bf16) {
    int64_t best = 0;
    float bv = bf16 ? bf16_to_f32(((const uint16_t *)v)[0]) : ((const float *)v)[0];
    for (int64_t i = 1; i < n; i++) {
        const float x = bf16 ? bf16_to_f32(((const uint16_t *)v)[i]) : ((const float *)v)[i];
        if (x > bv) { bv = x; best = i; }
    }
    return best;
}

/* Greedy steps for B requests in one call (a draft model's proposal, or a target's burst of decode steps):
 * kmax decode steps, each through the decoder, the LM head and an argmax, the argmax fed back as the next
 * step's token.
 *
 *   step 0: the R rows given (a draft's catch-ups, or a burst's decodes: decode / verification rows, as
 *           tm_decode_rows takes them); request b's first draft is the argmax at its row last[b]
 *   step s: one row per request with ks[b] > s (ks descending, so a prefix of the requests), its draft
 *           s - 1 at position pos[last[b]] + s, its KV slot from its block table (row last[b] of tables):
 *
 *               p = pos[last[b]] + s      slot = table[p / block_size] * block_size + p % block_size
 *
 * The scheduler reserved those slots (lookahead). drafts [B][kmax]; hidden [MAX_ROWS][hidden] and logits
 * [B][head->n] (dtype) are the caller's scratch. Each step makes the calls that a step from Python makes
 * (decoder, head on the gathered last rows, argmax), so its tokens are the same.
 *
 * stops [B][nstop] (-1 padded; NULL: none): tokens that end request b (a burst's EOS). Once every request
 * still stepping has made one, the later steps are skipped. Returns the steps run: request b's tokens are
 * drafts[b][0 .. min(ks[b], returned) - 1]. */
int64_t tm_decode_greedy(const tm_decoder *m, const tm_linear *head, int64_t R, const int64_t *tokens,
                         const int64_t *pos, const int64_t *slot, const int32_t *tables, int64_t table_stride,
                         const int32_t *seq_lens, int64_t B, const int64_t *last, const int64_t *ks, int64_t kmax,
                         int64_t *drafts, void *hidden, void *logits, const int64_t *stops, int64_t nstop, int nt) {
    const int bf16 = (int)m->bf16;
    const int64_t e = bf16 ? 2 : 4, D = m->hidden, V = head->n, bs = m->block_size;
    int64_t *tok = malloc(3 * B * sizeof(int64_t)), *p = tok + B, *sl = p + B;
    int32_t *tbl = malloc(B * table_stride * sizeof(int32_t)), *lens = malloc(B * sizeof(int32_t));
    char *h = hidden, *gathered = malloc(B * D * e);
    tm_decode_rows(m, R, tokens, pos, slot, tables, table_stride, seq_lens, h, nt);
    for (int64_t b = 0; b < B; b++) {
        memcpy(gathered + b * D * e, h + last[b] * D * e, D * e);
        memcpy(tbl + b * table_stride, tables + last[b] * table_stride, table_stride * sizeof(int32_t));
    }
    linear(head, gathered, logits, B, bf16, nt);
    for (int64_t b = 0; b < B; b++) drafts[b * kmax] = argmax_row((const char *)logits + b * V * e, V, bf16);
    int64_t ran = kmax, stopped = 0;  /* requests 0 .. stopped - 1 have made a stop token */
    for (int64_t s = 1; s < kmax; s++) {
        int64_t n = 0;
        while (n < B && ks[n] > s) n++;
        if (n == 0) break;
        if (stops) {
            while (stopped < n && is_stop(drafts + stopped * kmax, s, stops + stopped * nstop, nstop)) stopped++;
            if (stopped >= n) {
                ran = s;
                break;
            }
        }
        for (int64_t b = 0; b < n; b++) {
            tok[b] = drafts[b * kmax + s - 1];
            p[b] = pos[last[b]] + s;
            sl[b] = (int64_t)tbl[b * table_stride + p[b] / bs] * bs + p[b] % bs;
            lens[b] = (int32_t)(p[b] + 1);
        }
        tm_decode_rows(m, n, tok, p, sl, tbl, table_stride, lens, h, nt);
        linear(head, h, logits, n, bf16, nt);
        for (int64_t b = 0; b < n; b++) drafts[b * kmax + s] = argmax_row((const char *)logits + b * V * e, V, bf16);
    }
    free(tok);
    free(tbl);
    free(lens);
    free(gathered);
    return ran;
}

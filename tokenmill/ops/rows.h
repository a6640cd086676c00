/* Row chunks of the multi-row kernels: M rows go in ceil(M / max) balanced chunks (9 rows: 5 + 4), each
 * chunk reading the weights once, so any decode batch takes the few-row kernels. Chunk c is rows
 * [row_chunk_start(M, n, c), row_chunk_start(M, n, c + 1)). */
#pragma once
#include <stdint.h>

static inline int64_t row_chunks(int64_t M, int64_t max) { return (M + max - 1) / max; }

static inline int64_t row_chunk_start(int64_t M, int64_t chunks, int64_t c) { return M * c / chunks; }

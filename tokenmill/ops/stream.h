/* Weight streams: the GEMV kernels (and the AMX W8A8 GEMM) read each weight panel once, front to back.
 * On a 2-vCPU AMX VM the hardware prefetchers kept too few lines in flight for that stream once the
 * weights outgrew the cache: the int4 GEMV read 5.9 GB/s with a model-sized footprint (96 layers of
 * 4864 x 896, 209 MB) against 17.5 with 13 MB. Asking for the line STREAM_AHEAD bytes ahead of each one
 * read brought it to 18 GB/s; 16 KiB was about the best of 0.5-64 KiB (benchmarks/bench_qkernels.py
 * --layers 96). A prefetch past the end of the weights is harmless: it never faults. */
#pragma once

#ifndef STREAM_AHEAD
#define STREAM_AHEAD 16384
#endif

/* call once per 64-byte line read from a stream */
#define STREAM_PREFETCH(p) __builtin_prefetch((const char *)(p) + STREAM_AHEAD, 0, 3)

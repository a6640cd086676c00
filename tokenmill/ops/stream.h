/* Weight streams: the GEMV kernels (and the AMX W8A8 GEMM) read each weight panel once, front to back.
 * On a 2-vCPU AMX VM the hardware prefetchers kept too few lines in flight for that stream once the
 * weights outgrew the cache: the int4 GEMV read 5.9 GB/s with a model-sized footprint (96 layers of
 * 4864 x 896, 209 MB) against 17.5 with 13 MB. Asking for the line STREAM_AHEAD bytes ahead of each one
 * read brought it to 18 GB/s. The hint is prefetcht1 (into L2), not prefetcht0: an L1 prefetch holds one
 * of the core's few L1 fill buffers until its line arrives, which caps the lines in flight; L2 tracks
 * more. With T1 and 32 KiB ahead, decode at B = 1 went +10-14 % end to end over T0 and 16 KiB (bf16, int8,
 * AWQ; BENCHMARKS.md). A prefetch past the end of the weights is harmless: it never faults. */
#pragma once

#ifndef STREAM_AHEAD
#define STREAM_AHEAD 32768
#endif
#ifndef STREAM_LOCALITY
#define STREAM_LOCALITY 2
#endif

/* call once per 64-byte line read from a stream; locality 2 = prefetcht1. Built without it on AMD CPUs
 * (ops/native.py stream_prefetch): on a Zen 4 the hardware prefetchers alone read the stream 1.2-1.3x faster. */
#ifdef TM_NO_STREAM_PREFETCH
#define STREAM_PREFETCH(p) ((void)(p))
#else
#define STREAM_PREFETCH(p) __builtin_prefetch((const char *)(p) + STREAM_AHEAD, 0, STREAM_LOCALITY)
#endif

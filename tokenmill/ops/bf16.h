/* bfloat16 <-> float32 scalars shared by the C kernels (bfloat16 is the top half of a float32).
 * Branch-free, so loops over them auto-vectorize in the portable kernels. */
#pragma once
#include <stdint.h>
#include <string.h>

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, as torch does (a NaN stays a quiet NaN instead of carrying into the exponent) */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    const uint32_t r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
    const uint32_t nan = -(uint32_t)((u & 0x7FFFFFFF) > 0x7F800000);  /* a mask, not a branch: vectorizes */
    return (uint16_t)((r & ~nan) | (0x7FC0 & nan));
}

static inline float bf16_to_f32(uint16_t v) {
    return bits_f32((uint32_t)v << 16);
}

/* the value a bfloat16 tensor would hold: round to nearest even and back */
static inline float round_bf16(float f) {
    return bf16_to_f32(f32_to_bf16(f));
}

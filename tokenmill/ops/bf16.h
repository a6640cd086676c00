/* bfloat16 <-> float32 scalars shared by the C kernels (bfloat16 is the top half of a float32). */
#pragma once
#include <stdint.h>
#include <string.h>

/* round to nearest even, as torch does */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* AMX tile plumbing shared by the AMX kernels (cpu_w8a8.c, cpu_qgemm_amx.c): Linux's permission request
 * and one tile configuration, eight tiles of 16 rows x 64 bytes. */
#pragma once
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* Linux hands out AMX state only to processes that ask (once per process). 1 when usable. */
static inline int amx_request(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* per thread, before its first tile instruction */
static inline void amx_config_tiles(void) {
    amx_tile_config cfg = {0};
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif

/* AMX tile registers for the bfloat16 products (Sapphire Rapids and later Xeons).
 *
 * Linux hands the tile state to a process only when asked (arch_prctl); each library that
 * uses the tiles asks once, through its own amx_enable(), before its first product (the
 * grant covers every thread of the process), and each thread loads a tile configuration
 * before its first tile instruction of a call and releases the tiles at its end.
 * One configuration serves every user here:
 *
 *   tiles 0-3  float32 sums, mr rows x 16 columns
 *   tiles 4, 5 left operands, mr rows x 32 bfloat16 (64 bytes)
 *   tiles 6, 7 right operands, 16 pairs x 16 columns x 2 bfloat16 (the VNNI layout)
 *
 * so that a loop can load one right operand while the product reading the other runs.
 */
#ifndef SEQSERVE_AMX_H
#define SEQSERVE_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(HAVE_AVX512_BF16)
#define HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_granted = 0;

/* 1 once Linux has granted this process the tile state (asked once). */
static int amx_request(void) {
    if (!amx_granted && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
        amx_granted = 1;
    return amx_granted;
}

struct amx_tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* GCC's _tile_loadd takes its address as a plain value, not as memory it reads: before
 * tile loads of memory that plain C code has just written, this keeps those stores in
 * place (the loads of weights and packed KV, written before the call, need none). */
#define amx_memory_barrier() __asm__ __volatile__("" ::: "memory")

/* Loads the configuration above for mr (1-16) rows on the calling thread. */
static void amx_configure(int mr) {
    struct amx_tile_config cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) {
        cfg.rows[t] = (uint8_t)mr;
        cfg.colsb[t] = 64;
    }
    for (int t = 6; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Loads the configuration for mr rows unless the calling thread's tiles (*configured rows,
 * 0: none yet) already have it. */
static inline void amx_ensure(int *configured, int mr) {
    if (mr != *configured) {
        amx_configure(mr);
        *configured = mr;
    }
}
#endif

#endif

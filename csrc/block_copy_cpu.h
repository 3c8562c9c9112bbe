// CPU block gather/scatter over a paged KV cache (see block_copy_geometry.h).
// Torch-free: raw pointers in, a status code out.
#pragma once

#include <stdint.h>

#include "block_copy_geometry.h"

#ifdef __cplusplus
extern "C" {
#endif

// Status codes of kvp_block_copy_cpu.
#define KVP_OK 0
#define KVP_ERR_BLOCK_ID 1    // a block id outside [0, num_cache_blocks)
#define KVP_ERR_GEOMETRY 2    // inconsistent geometry (negative count, empty token range)

// Copies n blocks between the cache segments (ptr_table, num_layers *
// num_segments base addresses) and `staging` (n slots, kvp_slot_bytes(g) each).
// gather != 0: cache -> staging; gather == 0: staging -> cache.
// Uses up to num_threads OpenMP threads (<= 0: OpenMP default). Block ids are
// validated before any byte is copied. Thread safe; no global state.
int kvp_block_copy_cpu(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n,
                       uint8_t* staging, const KvpGeometry* g, int gather, int num_threads);

#ifdef __cplusplus
}  // extern "C"
#endif

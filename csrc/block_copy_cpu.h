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
#define KVP_ERR_MISALIGNED 3  // (emulation only) a word address not a multiple of the word size

// Copies n blocks between the cache segments (ptr_table, num_layers *
// num_segments base addresses) and `staging` (n slots, kvp_slot_bytes(g) each).
// gather != 0: cache -> staging; gather == 0: staging -> cache.
// Uses up to num_threads OpenMP threads (<= 0: OpenMP default). Block ids are
// validated before any byte is copied. Thread safe; no global state.
int kvp_block_copy_cpu(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n,
                       uint8_t* staging, const KvpGeometry* g, int gather, int num_threads);

// Test aid: performs the same copy by walking every unit word by word exactly as
// block_copy.cu's kernel does (same kvp_plan, kvp_pick_vec, kvp_word_offsets), on
// the CPU, single threaded. Returns KVP_ERR_MISALIGNED if any word address is not
// a multiple of the chosen word size (a vectorized load the GPU would fault on).
int kvp_block_copy_emulate_cuda(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n,
                                uint8_t* staging, const KvpGeometry* g, int gather, int64_t ptr_align);

#ifdef __cplusplus
}  // extern "C"
#endif

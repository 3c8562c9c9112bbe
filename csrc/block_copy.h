// CUDA block gather/scatter over a paged KV cache: plain C launcher.
// Only CUDA runtime types; no torch header (see ../shared ENGINES.md: this lets
// nvcc compile-check the kernel on machines whose torch has no CUDA headers).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "block_copy_geometry.h"

#ifdef __cplusplus
extern "C" {
#endif

// One launch for every layer, segment and block.
//   d_ptr_table  device array of num_layers * num_segments segment base addresses
//                (device memory, or host memory the device can address: pinned/UVA)
//   d_block_ids  device array of n int64 block ids, each in [0, num_cache_blocks)
//   staging      n * kvp_slot_bytes(*g) bytes, device or pinned host memory
//   ptr_align    a power of two that divides every address in d_ptr_table
//                (the launcher checks everything else itself and uses 16-, 8-,
//                4- or 1-byte loads/stores accordingly)
//   gather       != 0: cache -> staging; 0: staging -> cache
// Out-of-range block ids are not checked on the device: the caller validates.
// Returns the launch status (asynchronous errors surface on the stream).
cudaError_t kvp_block_copy_cuda(const uint64_t* d_ptr_table, const int64_t* d_block_ids,
                                int64_t n, uint8_t* staging, const KvpGeometry* g,
                                int64_t ptr_align, int gather, cudaStream_t stream);

#ifdef __cplusplus
}  // extern "C"
#endif

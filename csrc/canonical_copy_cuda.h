// CUDA canonical copy (canonical_copy.cu): plain C launcher, CUDA runtime types only
// (no torch header), like block_copy.h.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "canonical_copy.h"

#ifdef __cplusplus
extern "C" {
#endif

// One launch for every block, layer, K/V and head of `g`.
//   d_ptr_table  device array of num_layers * num_kv segment base addresses
//   d_block_ids  device array of n int64 block ids (validated by the caller)
//   staging      n * kvp_canon_obj_bytes(g) bytes, device or pinned host memory
//   ptr_align    a power of two dividing every address in d_ptr_table
//   gather       != 0: cache -> objects; 0: objects -> cache
cudaError_t kvp_canonical_copy_cuda(const uint64_t* d_ptr_table, const int64_t* d_block_ids, int64_t n,
                                    uint8_t* staging, const KvpCanonGeometry* g, int64_t ptr_align, int gather,
                                    cudaStream_t stream);

#ifdef __cplusplus
}  // extern "C"
#endif

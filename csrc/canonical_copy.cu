// CUDA kernel: paged KV blocks <-> canonical objects (canonical_copy.h), all layers,
// K/V and heads in one launch; the layout conversion is the copy.
//
// Grid: x = (block, layer, kv, head) unit, y = chunk of that unit's tile. Threads stride
// over the tile's VEC-byte words; kvp_canon_word gives each word's cache and object
// offsets (the same function the CPU emulation checks). VEC is the widest word every
// address, stride and run of the launch allows (kvp_canon_pick_vec): 16 bytes for the
// GPU backends' NHD and HND caches of 8 or more 2-byte dims per head.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_words.h"
#include "canonical_copy.h"
#include "canonical_copy_cuda.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kBytesPerCta = 32 * 1024;

template <int VEC>
__global__ void __launch_bounds__(kThreads)
    canonical_copy_kernel(const uint64_t* __restrict__ ptr_table, const int64_t* __restrict__ block_ids,
                          uint8_t* __restrict__ staging, KvpCanonGeometry g, int gather) {
  using W = typename KvpWord<VEC>::T;
  uint8_t* cache;
  uint8_t* obj;
  const int s = kvp_canon_unit(&g, ptr_table, block_ids, staging, blockIdx.x, &cache, &obj);
  const int64_t words = kvp_canon_tile_bytes(&g) / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; w < words; w += stride) {
    int64_t co, oo;
    kvp_canon_word(&g, s, w, VEC, &co, &oo);
    W* c = reinterpret_cast<W*>(cache + co);
    W* o = reinterpret_cast<W*>(obj + oo);
    if (gather) {
      *o = *c;
    } else {
      *c = *o;
    }
  }
}

template <int VEC>
cudaError_t launch(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n, uint8_t* staging,
                   const KvpCanonGeometry& g, int gather, cudaStream_t stream) {
  const int64_t units = n * g.num_layers * g.num_kv * g.n_heads;
  if (units > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  int64_t chunks = (kvp_canon_tile_bytes(&g) + kBytesPerCta - 1) / kBytesPerCta;
  if (chunks < 1) chunks = 1;
  if (chunks > 65535) chunks = 65535;
  dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(chunks));
  canonical_copy_kernel<VEC><<<grid, kThreads, 0, stream>>>(ptr_table, block_ids, staging, g, gather);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t kvp_canonical_copy_cuda(const uint64_t* d_ptr_table, const int64_t* d_block_ids, int64_t n,
                                               uint8_t* staging, const KvpCanonGeometry* gp, int64_t ptr_align,
                                               int gather, cudaStream_t stream) {
  if (gp == nullptr || n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const KvpCanonGeometry g = *gp;
  if (g.num_layers <= 0 || (g.num_kv != 1 && g.num_kv != 2) || g.tokens <= 0 || g.head_dim <= 0 || g.elem_bytes <= 0 ||
      g.n_heads <= 0 || g.obj_h0 < 0 || g.obj_h0 + g.n_heads > g.obj_heads || g.cache_h0 < 0) {
    return cudaErrorInvalidValue;
  }
  for (int s = 0; s < g.num_kv; ++s) {
    if (g.dg[s] <= 0 || g.head_dim % g.dg[s] != 0 || g.tg[s] <= 0 || g.tokens % g.tg[s] != 0) return cudaErrorInvalidValue;
  }
  switch (kvp_canon_pick_vec(&g, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(staging)), ptr_align)) {
    case 16: return launch<16>(d_ptr_table, d_block_ids, n, staging, g, gather, stream);
    case 8: return launch<8>(d_ptr_table, d_block_ids, n, staging, g, gather, stream);
    case 4: return launch<4>(d_ptr_table, d_block_ids, n, staging, g, gather, stream);
    case 2: return launch<2>(d_ptr_table, d_block_ids, n, staging, g, gather, stream);
    default: return launch<1>(d_ptr_table, d_block_ids, n, staging, g, gather, stream);
  }
}

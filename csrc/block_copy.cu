// CUDA kernel: paged KV blocks <-> contiguous staging, all layers in one launch.
//
// Grid: x = (block i, layer, segment) unit, y = chunk of that unit's bytes.
// Each unit is reduced by kvp_plan() to na x nb runs of run_len bytes; threads
// stride over the unit's VEC-byte words, so short rows (e.g. one head of one
// token) still keep every thread busy. VEC is the widest of 16/8/4/1 bytes that
// divides every address, stride and run length of this launch.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_words.h"
#include "block_copy.h"
#include "block_copy_geometry.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kBytesPerCta = 64 * 1024;

template <int VEC>
__global__ void __launch_bounds__(kThreads)
    block_copy_kernel(const uint64_t* __restrict__ ptr_table, const int64_t* __restrict__ block_ids,
                      int64_t n, uint8_t* __restrict__ staging, KvpGeometry g, int gather) {
  using W = typename KvpWord<VEC>::T;
  const int64_t segs = g.num_layers * g.num_segments;
  const int64_t unit = blockIdx.x;
  const int64_t i = unit / segs;
  const int64_t ls = unit % segs;
  const KvpRuns r = kvp_plan(g, i, n);

  const int64_t words_per_run = r.run_len / VEC;
  const int64_t total = words_per_run * r.na * r.nb;
  uint8_t* cache = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(ptr_table[ls])) +
                   block_ids[i] * g.block_stride + r.src_off;
  uint8_t* stage = staging + i * kvp_slot_bytes(g) + ls * kvp_segment_bytes(g) + r.dst_off;

  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  if (r.na == 1 && r.nb == 1) {  // one dense run: no index arithmetic
    W* c = reinterpret_cast<W*>(cache);
    W* s = reinterpret_cast<W*>(stage);
    for (int64_t w = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; w < total; w += stride) {
      if (gather) {
        s[w] = c[w];
      } else {
        c[w] = s[w];
      }
    }
    return;
  }
  // Strided runs: 32-bit index math (the launcher guarantees a unit has < 2^32 words).
  const uint32_t wpr = static_cast<uint32_t>(words_per_run);
  for (uint32_t w = blockIdx.y * blockDim.x + threadIdx.x; w < static_cast<uint32_t>(total);
       w += static_cast<uint32_t>(stride)) {
    int64_t src_off, dst_off;
    kvp_word_offsets(r, w, wpr, VEC, &src_off, &dst_off);
    W* c = reinterpret_cast<W*>(cache + src_off);
    W* s = reinterpret_cast<W*>(stage + dst_off);
    if (gather) {
      *s = *c;
    } else {
      *c = *s;
    }
  }
}

template <int VEC>
cudaError_t launch(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n, uint8_t* staging,
                   const KvpGeometry& g, int gather, cudaStream_t stream) {
  const int64_t units = n * g.num_layers * g.num_segments;
  // The largest unit is a whole block-segment; size the chunk count from it.
  const int64_t unit_bytes = kvp_segment_bytes(g);
  int64_t chunks = (unit_bytes + kBytesPerCta - 1) / kBytesPerCta;
  if (chunks < 1) chunks = 1;
  if (chunks > 65535) chunks = 65535;
  if (units > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  if (unit_bytes / VEC >= 0xffffffffLL - static_cast<int64_t>(chunks) * kThreads) {
    return cudaErrorInvalidConfiguration;  // the strided path indexes words in 32 bits
  }
  dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(chunks));
  block_copy_kernel<VEC><<<grid, kThreads, 0, stream>>>(ptr_table, block_ids, n, staging, g, gather);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t kvp_block_copy_cuda(const uint64_t* d_ptr_table, const int64_t* d_block_ids,
                                           int64_t n, uint8_t* staging, const KvpGeometry* gp,
                                           int64_t ptr_align, int gather, cudaStream_t stream) {
  if (gp == nullptr || n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const KvpGeometry g = *gp;
  if (g.num_layers <= 0 || g.num_segments <= 0 || g.row_bytes <= 0) return cudaErrorInvalidValue;

  const int64_t align = kvp_pick_vec(g, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(staging)), ptr_align);
  if (align >= 16) return launch<16>(d_ptr_table, d_block_ids, n, staging, g, gather, stream);
  if (align >= 8) return launch<8>(d_ptr_table, d_block_ids, n, staging, g, gather, stream);
  if (align >= 4) return launch<4>(d_ptr_table, d_block_ids, n, staging, g, gather, stream);
  return launch<1>(d_ptr_table, d_block_ids, n, staging, g, gather, stream);
}

// CPU kernel: one memcpy per contiguous run over (block, layer, segment).
//
// Serial unless the caller asks for more than one thread. The copies run on
// kvpack's background threads inside an engine process: an OpenMP team started
// there stays behind and competes with the engine's own threads, slowing every later
// decode step (benchmarks/RESULTS.md, "the kernel is now serial"). One thread
// already copies at memcpy speed.
#include "block_copy_cpu.h"

#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

extern "C" int kvp_block_copy_cpu(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n,
                                  uint8_t* staging, const KvpGeometry* gp, int gather,
                                  int num_threads) {
  const KvpGeometry g = *gp;
  if (n < 0 || g.num_layers <= 0 || g.num_segments <= 0 || g.row_bytes <= 0 ||
      g.outer_count <= 0 || g.inner_count <= 0) {
    return KVP_ERR_GEOMETRY;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (block_ids[i] < 0 || block_ids[i] >= g.num_cache_blocks) return KVP_ERR_BLOCK_ID;
  }
  if (n == 0) return KVP_OK;
  {
    KvpRuns first = kvp_plan(g, 0, n);
    KvpRuns last = kvp_plan(g, n - 1, n);
    if (first.na <= 0 || first.nb <= 0 || last.na <= 0 || last.nb <= 0) return KVP_ERR_GEOMETRY;
  }

  const int64_t segs = g.num_layers * g.num_segments;
  const int64_t seg_bytes = kvp_segment_bytes(g);
  const int64_t slot_bytes = kvp_slot_bytes(g);
  const int64_t units = n * segs;
  int threads = num_threads > 1 ? num_threads : 1;
  if (units < threads) threads = (int)units;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
#endif
  for (int64_t u = 0; u < units; ++u) {
    const int64_t i = u / segs;
    const int64_t ls = u % segs;
    const KvpRuns r = kvp_plan(g, i, n);
    uint8_t* cache = (uint8_t*)(uintptr_t)ptr_table[ls] + block_ids[i] * g.block_stride + r.src_off;
    uint8_t* stage = staging + i * slot_bytes + ls * seg_bytes + r.dst_off;
    for (int64_t a = 0; a < r.na; ++a) {
      for (int64_t b = 0; b < r.nb; ++b) {
        uint8_t* c = cache + a * r.src_a + b * r.src_b;
        uint8_t* s = stage + a * r.dst_a + b * r.dst_b;
        if (gather) {
          memcpy(s, c, (size_t)r.run_len);
        } else {
          memcpy(c, s, (size_t)r.run_len);
        }
      }
    }
  }
  return KVP_OK;
}

extern "C" int kvp_block_copy_emulate_cuda(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n,
                                           uint8_t* staging, const KvpGeometry* gp, int gather,
                                           int64_t ptr_align) {
  const KvpGeometry g = *gp;
  for (int64_t i = 0; i < n; ++i) {
    if (block_ids[i] < 0 || block_ids[i] >= g.num_cache_blocks) return KVP_ERR_BLOCK_ID;
  }
  const int64_t vec = kvp_pick_vec(g, (uint64_t)(uintptr_t)staging, ptr_align);
  const int64_t segs = g.num_layers * g.num_segments;
  for (int64_t unit = 0; unit < n * segs; ++unit) {
    const int64_t i = unit / segs;
    const int64_t ls = unit % segs;
    const KvpRuns r = kvp_plan(g, i, n);
    if (r.na <= 0 || r.nb <= 0 || r.run_len % vec != 0) return KVP_ERR_GEOMETRY;
    const int64_t words_per_run = r.run_len / vec;
    const int64_t total = words_per_run * r.na * r.nb;
    uint8_t* cache = (uint8_t*)(uintptr_t)ptr_table[ls] + block_ids[i] * g.block_stride + r.src_off;
    uint8_t* stage = staging + i * kvp_slot_bytes(g) + ls * kvp_segment_bytes(g) + r.dst_off;
    for (int64_t w = 0; w < total; ++w) {
      int64_t src_off = w * vec, dst_off = w * vec;  // the kernel's dense path
      if (!(r.na == 1 && r.nb == 1)) {
        kvp_word_offsets(r, (uint32_t)w, (uint32_t)words_per_run, vec, &src_off, &dst_off);
      }
      uint8_t* c = cache + src_off;
      uint8_t* s = stage + dst_off;
      if (((uintptr_t)c % (uintptr_t)vec) != 0 || ((uintptr_t)s % (uintptr_t)vec) != 0) return KVP_ERR_MISALIGNED;
      if (gather) {
        memcpy(s, c, (size_t)vec);
      } else {
        memcpy(c, s, (size_t)vec);
      }
    }
  }
  return KVP_OK;
}

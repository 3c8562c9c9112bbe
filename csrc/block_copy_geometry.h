// Geometry of a paged-KV block copy, shared by the CPU and the CUDA kernels.
//
// Dependency-free (only <stdint.h>) so that block_copy.cu can include it without
// any torch header. Every size and stride is in BYTES.
//
// Model. A cache has `num_layers` layers; each layer has `num_segments` segments
// (2 for layouts that keep K and V apart, 1 when K|V are fused or for MLA).
// Segment (l, s) starts at ptr_table[l * num_segments + s]. Block b of a segment
// starts at that base plus b * block_stride and holds
//     outer_count x inner_count rows of row_bytes bytes,
// row (a, i) at offset a * outer_stride + i * inner_stride. One of the two loop
// dims is the token dim (token_dim 0 = outer, 1 = inner) unless the layout is not
// token addressable (token_dim -1: whole blocks only).
//
// Staging ("object") layout, fixed and dense:
//     staging[block_i][layer][segment][outer][inner][row_bytes]
// i.e. slot i starts at i * num_layers * num_segments * segment_bytes, where
// segment_bytes = outer_count * inner_count * row_bytes.
//
// Partial blocks: the first block copies tokens [first_token_offset, T) and the
// last block tokens [0, last_token_count) (one block: [offset, count)). Staging
// bytes of tokens outside that range are neither read nor written.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define KVP_HD __host__ __device__ __forceinline__
#else
#define KVP_HD inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef struct KvpGeometry {
  int64_t num_layers;
  int64_t num_segments;
  int64_t block_stride;   // bytes between block b and b+1 of one segment
  int64_t outer_count;
  int64_t outer_stride;   // bytes
  int64_t inner_count;
  int64_t inner_stride;   // bytes
  int64_t row_bytes;      // contiguous bytes per row
  int64_t token_dim;      // 0: outer, 1: inner, -1: whole blocks only
  int64_t first_token_offset;  // tokens skipped at the start of the first block
  int64_t last_token_count;    // tokens copied from the start of the last block
  int64_t num_cache_blocks;    // valid block ids are [0, num_cache_blocks)
} KvpGeometry;

// Number of int64 values in the packed form (see kvp_geometry_unpack).
#define KVP_GEOMETRY_FIELDS 12

#ifdef __cplusplus
}  // extern "C"
#endif

// The copy of one block-segment, reduced to na x nb runs of run_len bytes.
// Run (a, b) reads cache bytes at src_off + a * src_a + b * src_b and staging
// bytes at dst_off + a * dst_a + b * dst_b (offsets relative to the block /
// slot-segment start).
struct KvpRuns {
  int64_t na, nb, run_len;
  int64_t src_off, src_a, src_b;
  int64_t dst_off, dst_a, dst_b;
};

KVP_HD int64_t kvp_segment_bytes(const KvpGeometry& g) {
  return g.outer_count * g.inner_count * g.row_bytes;
}

KVP_HD int64_t kvp_slot_bytes(const KvpGeometry& g) {
  return g.num_layers * g.num_segments * kvp_segment_bytes(g);
}

// Runs for block i of n (i selects the token range for partial blocks).
// Coalesces rows that are adjacent in the cache (the staging side is dense).
KVP_HD KvpRuns kvp_plan(const KvpGeometry& g, int64_t i, int64_t n) {
  int64_t a0 = 0, a1 = g.outer_count, b0 = 0, b1 = g.inner_count;
  if (g.token_dim >= 0) {
    int64_t t0 = (i == 0) ? g.first_token_offset : 0;
    int64_t t1 = (i == n - 1) ? g.last_token_count : (g.token_dim == 0 ? g.outer_count : g.inner_count);
    if (g.token_dim == 0) { a0 = t0; a1 = t1; } else { b0 = t0; b1 = t1; }
  }
  KvpRuns r;
  r.na = a1 - a0;
  r.nb = b1 - b0;
  r.run_len = g.row_bytes;
  r.src_a = g.outer_stride;
  r.src_b = g.inner_stride;
  r.dst_a = g.inner_count * g.row_bytes;
  r.dst_b = g.row_bytes;
  r.src_off = a0 * g.outer_stride + b0 * g.inner_stride;
  r.dst_off = a0 * r.dst_a + b0 * r.dst_b;
  if (g.inner_stride == g.row_bytes) {
    bool whole_inner = (r.nb == g.inner_count);
    r.run_len = r.nb * g.row_bytes;
    r.nb = 1;
    if (whole_inner && g.outer_stride == g.inner_count * g.row_bytes) {
      r.run_len *= r.na;
      r.na = 1;
    }
  }
  return r;
}

// Largest power of two <= 16 dividing v (16 for v == 0).
KVP_HD int64_t kvp_align_of(int64_t v) {
  if (v == 0) return 16;
  int64_t a = 1;
  while (a < 16 && (v % (a * 2)) == 0) a *= 2;
  return a;
}

// Word size (16, 8, 4 or 1 bytes) for a launch: it must divide every address the
// copy forms, i.e. the segment bases (ptr_align), the staging address, every
// stride and every run length (all run lengths are multiples of row_bytes).
KVP_HD int64_t kvp_pick_vec(const KvpGeometry& g, uint64_t staging_addr, int64_t ptr_align) {
  int64_t a = kvp_align_of(ptr_align);
  const int64_t terms[6] = {(int64_t)(staging_addr & 0xff), g.block_stride, g.outer_stride,
                            g.inner_stride, g.row_bytes, kvp_segment_bytes(g)};
  for (int k = 0; k < 6; ++k) {
    const int64_t t = kvp_align_of(terms[k]);
    if (t < a) a = t;
  }
  return a >= 16 ? 16 : a >= 8 ? 8 : a >= 4 ? 4 : 1;
}

// Byte offsets of word w of a unit (relative to the unit's cache and staging
// starts), as the CUDA kernel walks a unit: na x nb runs of wpr words of vec bytes,
// run-major. 32-bit word index: a unit holds < 2^32 words (checked by the launcher).
KVP_HD void kvp_word_offsets(const KvpRuns& r, uint32_t w, uint32_t wpr, int64_t vec, int64_t* src,
                             int64_t* dst) {
  const uint32_t run = w / wpr;
  const int64_t in_run = (int64_t)(w - run * wpr) * vec;
  const uint32_t nb = (uint32_t)r.nb;
  const uint32_t a = (nb == 1) ? run : run / nb;
  const uint32_t b = run - a * nb;
  *src = (int64_t)a * r.src_a + (int64_t)b * r.src_b + in_run;
  *dst = (int64_t)a * r.dst_a + (int64_t)b * r.dst_b + in_run;
}

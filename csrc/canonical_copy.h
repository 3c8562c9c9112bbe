// Canonical KV objects: one chunk of every layer in kvpack's engine-neutral layout.
//
// Object bytes for one block (chunk) holding `obj_heads` KV heads, dense:
//     object[layer][kv][head][token][dim]          kv: 0 = K, 1 = V (MLA: K only)
// with `elem_bytes`-byte elements in the engine's KV dtype, little-endian as stored.
//
// Engine side. Segment (layer l, kv s) starts at ptr_table[l * num_kv + s]; block b
// of it at + b * block_stride, head h at + h * head_stride. Inside one head's tile of
// T tokens x D dims, element (t, d) sits at byte offset
//     (t / tg) * t_outer + (t % tg) * t_inner + (d / dg) * d_outer + (d % dg) * d_inner
// (a two-level split of each dim; per kv). Row-major tiles (GPU NHD/HND, SGLang host
// pools, vLLM CPU V under `vec`) have dg == D, d_inner == elem_bytes: one run per token.
// Panel tiles (vLLM CPU K: `vec` packs [D][T], `amx` [T/16][D/2][16][2]) have dg-element
// units with the tokens of a group adjacent: the copy is a transpose of units. Token
// pairs (vLLM CPU V under `amx`, [D/16][T/2][16][2]) interleave two tokens' rows.
// Anything else is copied element by element.
// Head range: heads [obj_h0, obj_h0 + n_heads) of the object <-> heads
// [cache_h0, cache_h0 + n_heads) of the cache (a rank's local heads).
//
// The CUDA kernel (canonical_copy.cu) copies words of `vec` bytes of each (block, layer,
// kv, head) tile with the indexing below, shared with its CPU emulation (the test of
// that indexing on machines without a GPU).
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define KVP_CANON_HD __host__ __device__ __forceinline__
#else
#define KVP_CANON_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef struct KvpCanonGeometry {
  int64_t num_layers;
  int64_t num_kv;          // 2 (K and V) or 1 (MLA latent)
  int64_t block_stride;    // bytes
  int64_t head_stride;     // bytes
  int64_t tokens;          // T
  int64_t head_dim;        // D, in elements
  int64_t elem_bytes;
  int64_t tg[2], t_inner[2], t_outer[2];  // per kv: token group (tokens), strides (bytes)
  int64_t dg[2], d_inner[2], d_outer[2];  // per kv: dim group (elements), strides (bytes)
  int64_t obj_heads;
  int64_t obj_h0;
  int64_t cache_h0;
  int64_t n_heads;
  int64_t num_cache_blocks;
} KvpCanonGeometry;

#define KVP_CANON_FIELDS 24

// Bytes of one head's tile (T tokens x D dims) and of one object.
KVP_CANON_HD int64_t kvp_canon_tile_bytes(const KvpCanonGeometry* g) { return g->tokens * g->head_dim * g->elem_bytes; }
KVP_CANON_HD int64_t kvp_canon_obj_bytes(const KvpCanonGeometry* g) {
  return g->num_layers * g->num_kv * g->obj_heads * kvp_canon_tile_bytes(g);
}

// Unit u of a launch (u = ((i * num_layers + l) * num_kv + s) * n_heads + h): where its
// cache tile and object tile start, and its kv index s.
KVP_CANON_HD int kvp_canon_unit(const KvpCanonGeometry* g, const uint64_t* ptr_table, const int64_t* block_ids,
                                uint8_t* staging, int64_t u, uint8_t** cache, uint8_t** obj) {
  const int64_t h = u % g->n_heads;
  const int64_t ls = (u / g->n_heads) % (g->num_layers * g->num_kv);
  const int64_t i = u / (g->n_heads * g->num_layers * g->num_kv);
  *cache = (uint8_t*)(uintptr_t)ptr_table[ls] + block_ids[i] * g->block_stride + (g->cache_h0 + h) * g->head_stride;
  *obj = staging + i * kvp_canon_obj_bytes(g) + (ls * g->obj_heads + g->obj_h0 + h) * kvp_canon_tile_bytes(g);
  return (int)(ls % g->num_kv);
}

// Word w (`vec` bytes) of a tile of kv `s`: its byte offset in the cache tile and in the
// object tile (object: token-major rows of D elements).
KVP_CANON_HD void kvp_canon_word(const KvpCanonGeometry* g, int s, int64_t w, int64_t vec, int64_t* cache_off,
                                 int64_t* obj_off) {
  const int64_t row = g->head_dim * g->elem_bytes;
  const int64_t b = w * vec;
  const int64_t t = b / row, rb = b - t * row;
  const int64_t d = rb / g->elem_bytes, eb = rb - d * g->elem_bytes;
  *obj_off = b;
  *cache_off = (t / g->tg[s]) * g->t_outer[s] + (t % g->tg[s]) * g->t_inner[s] + (d / g->dg[s]) * g->d_outer[s] +
               (d % g->dg[s]) * g->d_inner[s] + eb;
}

// The widest word (16, 8, 4, 2 or 1 bytes) for which every word of the launch is
// contiguous on both sides and aligned: it divides the row, the element or (when wider)
// a run of adjacent dims of one dim group, every stride, `ptr_align` (a power of two
// dividing every base address) and the staging address.
KVP_CANON_HD int64_t kvp_canon_pick_vec(const KvpCanonGeometry* g, uint64_t staging_addr, int64_t ptr_align) {
  for (int64_t v = 16; v > 1; v /= 2) {
    bool ok = (g->head_dim * g->elem_bytes) % v == 0 && ptr_align % v == 0 && staging_addr % (uint64_t)v == 0 &&
              g->block_stride % v == 0 && g->head_stride % v == 0;
    for (int s = 0; s < g->num_kv && ok; ++s) {
      ok = g->t_inner[s] % v == 0 && g->t_outer[s] % v == 0 && g->d_outer[s] % v == 0;
      if (v > g->elem_bytes) {
        ok = ok && g->d_inner[s] == g->elem_bytes && (g->dg[s] * g->elem_bytes) % v == 0;
      } else {
        ok = ok && g->elem_bytes % v == 0 && g->d_inner[s] % v == 0;
      }
    }
    if (ok) return v;
  }
  return 1;
}

// SIMD levels of the CPU copy, narrowest first. Every level writes the same bytes.
#define KVP_SIMD_SCALAR 0
#define KVP_SIMD_SSE2 1
#define KVP_SIMD_AVX512 2  // AVX-512 F + BW

// The widest level this build runs on this CPU (checked once, at run time).
int kvp_cpu_simd(void);

// Copies n blocks between the cache and `staging` (n objects); gather != 0: cache ->
// staging. Uses the widest SIMD level the CPU has, at most `max_simd` (KVP_SIMD_*; the
// engine passes KVP_SIMD_AVX512, tests pass each level). 0 on success; KVP_ERR_* codes
// of block_copy_cpu.h otherwise.
int kvp_canonical_copy_cpu(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n,
                           uint8_t* staging, const KvpCanonGeometry* g, int gather, int max_simd);

// The same copy with object i at host address obj_addrs[i] (16-byte aligned for the
// streamed paths; any alignment is copied correctly) instead of `staging + i * object
// bytes`: one call over a batch of objects wherever they lie. Objects must not overlap.
int kvp_canonical_copy_cpu_at(const uint64_t* ptr_table, const int64_t* block_ids, const uint64_t* obj_addrs,
                              int64_t n, const KvpCanonGeometry* g, int gather, int max_simd);

// Test aid: canonical_copy.cu's word-by-word copy run on the CPU with the same indexing;
// KVP_ERR_MISALIGNED when a word address is not a multiple of the word size (a GPU
// fault). `*vec_out` (if not null) receives the word size used.
int kvp_canonical_emulate_cuda(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n, uint8_t* staging,
                               const KvpCanonGeometry* g, int gather, int64_t ptr_align, int64_t* vec_out);

#ifdef __cplusplus
}
#endif

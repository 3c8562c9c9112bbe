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
// units with the tokens of a group adjacent: the copy is a transpose of units. Anything
// else (vLLM CPU V under `amx`, [D/16][T/2][16][2]) is copied element by element.
// Head range: heads [obj_h0, obj_h0 + n_heads) of the object <-> heads
// [cache_h0, cache_h0 + n_heads) of the cache (a rank's local heads).
#pragma once

#include <stdint.h>

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

// 0 on success; KVP_ERR_* codes of block_copy_cpu.h otherwise.
int kvp_canonical_copy_cpu(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n,
                           uint8_t* staging, const KvpCanonGeometry* g, int gather);

#ifdef __cplusplus
}
#endif

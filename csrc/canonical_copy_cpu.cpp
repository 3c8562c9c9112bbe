// CPU kernel for canonical KV objects (see canonical_copy.h), serial like
// block_copy_cpu.cpp: it runs on kvpack's background threads inside the engine.
//
// Row-major tiles copy one run of D elements per token (one run per tile when
// the tokens are dense). Panel tiles are a transpose of dg-element units between
// [D/dg][tg] (engine, per token group) and [tg][D/dg] (object), in SIMD blocks: 32x32
// (2-byte units) or 16x16 (4-byte units) of whole 64-byte rows with AVX-512
// (transpose_avx512.h), else 8x8 or 4x4 with SSE2 (transpose_sse2.h), else scalar. The
// caller caps the level (`max_simd`); every level writes the same bytes.
//
// Copies larger than the caches (`stream_min_bytes`) stream: each tile's source is
// prefetched in address order, a strip of transposed rows is built in an L1 bounce
// buffer and written out with non-temporal stores of whole cache lines. Plain
// stores of a transpose fill each destination line piecewise, so the CPU reads every
// line before writing it (3 memory passes to memcpy's 2); whole lines streamed make it 2.
// In cache, plain stores are faster (benchmarks/RESULTS.md, "Canonical objects").
// Streamed calls use the SSE2 blocks: there memory is the limit, not the shuffles.
// A streamed gather out of token-major pages (SGLang page_first) walks each page in its
// address order instead of tile by tile (`gather_token_major`).
// Objects lie back to back in one buffer, or each at its own address
// (`kvp_canonical_copy_cpu_at`: a memory tier's slots, in short runs across slabs); the
// streaming decision is on the whole call either way. One call per run of adjacent slots
// left runs of 1-16 objects under `stream_min_bytes`, and paid a torch call each.
#include "canonical_copy.h"

#include <string.h>
#include <unistd.h>

#include "block_copy_cpu.h"

#include "transpose_avx512.h"
#include "transpose_sse2.h"

namespace {

// Transpose of units (U bytes each) between the cache's [panels][tokens] (dense
// tokens: token_stride == U) and the object's [tokens][panels]; SIMD blocks of
// W x W units where available, scalar edges. Returns false if it did nothing.
#ifdef KVP_HAVE_SSE2
using namespace kvp_sse2;

constexpr int64_t kBounceBytes = 16384;

// Asks for the source of one panel tile's transpose in address order (gather: the
// cache's `panels` runs of `tokens` units; scatter: the object's `tokens` rows), ahead
// of the transpose that reads it column by column.
template <int U>
inline void prefetch_tile(const uint8_t* cache, int64_t panel_stride, const uint8_t* obj, int64_t obj_row, int64_t panels,
                          int64_t tokens, bool gather) {
  if (gather) prefetch_span(cache, (panels - 1) * panel_stride + tokens * U); else prefetch_span(obj, tokens * obj_row);
}

// The streamed transpose: strips of W destination rows through an L1 bounce buffer.
template <int U, int W>
bool transpose_streamed(uint8_t* cache, int64_t panel_stride, uint8_t* obj, int64_t obj_row, int64_t panels,
                        int64_t tokens, bool gather) {
  const int64_t run = tokens * U;  // bytes of one panel's tokens in the cache
  if ((((uintptr_t)obj | (uintptr_t)cache | (uintptr_t)obj_row | (uintptr_t)panel_stride | (uintptr_t)run) & 15) != 0 ||
      W * obj_row > kBounceBytes || W * run > kBounceBytes) {
    return false;
  }
  alignas(64) uint8_t strip[kBounceBytes];
  prefetch_tile<U>(cache, panel_stride, obj, obj_row, panels, tokens, gather);
  if (gather) {
    for (int64_t t = 0; t < tokens; t += W) {
      for (int64_t p = 0; p < panels; p += W) {
        const uint8_t* c = cache + p * panel_stride + t * U;
        if (U == 4) transpose4_u32(c, panel_stride, strip + p * U, obj_row); else transpose8_u16(c, panel_stride, strip + p * U, obj_row);
      }
      stream_out(obj + t * obj_row, strip, W * obj_row);
    }
  } else {
    for (int64_t p = 0; p < panels; p += W) {
      for (int64_t t = 0; t < tokens; t += W) {
        const uint8_t* o = obj + t * obj_row + p * U;
        if (U == 4) transpose4_u32(o, obj_row, strip + t * U, run); else transpose8_u16(o, obj_row, strip + t * U, run);
      }
      for (int k = 0; k < W; ++k) stream_out(cache + (p + k) * panel_stride, strip + k * run, run);
    }
  }
  return true;
}
#endif

#ifdef KVP_HAVE_AVX512
// The in-cache transpose in blocks of 64-byte rows, each tile's source first asked for
// in address order (so the hardware prefetcher sees one forward stream per tile).
template <int U>
KVP_AVX512_FN bool transpose_wide(uint8_t* cache, int64_t panel_stride, uint8_t* obj, int64_t obj_row,
                                  int64_t panels, int64_t tokens, bool gather) {
  constexpr int64_t W = 64 / U;
  if (panels % W != 0 || tokens % W != 0) return false;
  prefetch_tile<U>(cache, panel_stride, obj, obj_row, panels, tokens, gather);
  if (gather) {
    for (int64_t t = 0; t < tokens; t += W) {
      for (int64_t p = 0; p < panels; p += W) {
        const uint8_t* c = cache + p * panel_stride + t * U;
        uint8_t* o = obj + t * obj_row + p * U;
        if (U == 2) kvp_avx512::transpose32_u16(c, panel_stride, o, obj_row); else kvp_avx512::transpose16_u32(c, panel_stride, o, obj_row);
      }
    }
  } else {
    for (int64_t p = 0; p < panels; p += W) {
      for (int64_t t = 0; t < tokens; t += W) {
        uint8_t* c = cache + p * panel_stride + t * U;
        const uint8_t* o = obj + t * obj_row + p * U;
        if (U == 2) kvp_avx512::transpose32_u16(o, obj_row, c, panel_stride); else kvp_avx512::transpose16_u32(o, obj_row, c, panel_stride);
      }
    }
  }
  return true;
}

// Token pairs (vLLM CPU V under `amx`) 32 dims at a time: `dg` a multiple of 16, D of 32.
KVP_AVX512_FN void pairs_wide(uint8_t* cache, uint8_t* obj, int64_t T, int64_t D, int64_t dg, int64_t to, int64_t dout,
                              bool gather) {
  const int64_t row = D * 2;
  for (int64_t t = 0; t < T; t += 2) {
    uint8_t* c = cache + (t / 2) * to;
    for (int64_t d = 0; d < D; d += 32) {
      uint8_t* o0 = obj + t * row + d * 2;
      kvp_avx512::pairs32_u16(c + (d / dg) * dout + (d % dg) * 4, c + ((d + 16) / dg) * dout + ((d + 16) % dg) * 4, o0,
                              o0 + row, gather);
    }
  }
}
#endif

template <int U, int W>
bool transpose_simd(uint8_t* cache, int64_t panel_stride, int64_t token_stride, uint8_t* obj, int64_t obj_row,
                    int64_t panels, int64_t tokens, bool gather, bool stream, int simd) {
#ifdef KVP_HAVE_SSE2
  if (simd < KVP_SIMD_SSE2 || token_stride != U || panels % W != 0 || tokens % W != 0) return false;
#ifdef KVP_HAVE_AVX512
  if (!stream && simd >= KVP_SIMD_AVX512 && transpose_wide<U>(cache, panel_stride, obj, obj_row, panels, tokens, gather)) {
    return true;
  }
#endif
  if (stream && transpose_streamed<U, W>(cache, panel_stride, obj, obj_row, panels, tokens, gather)) return true;
  // The destination's rows are filled one after another (gather: object rows are
  // tokens; scatter: cache rows are panels), so few of its cache lines are open at a
  // time. 2-byte units ask for the tile's source in address order first.
  // 4-byte units gained nothing from that; their 4x4 blocks are small, so the copy walks
  // strips of several blocks (gather: 16 tokens across every panel; scatter: 8 panels
  // across every token). For 2-byte units a strip is one block: the order above.
  // (Each step's gain: benchmarks/RESULTS.md, "Canonical objects".)
  if (U == 2) prefetch_tile<U>(cache, panel_stride, obj, obj_row, panels, tokens, gather);
  constexpr int64_t kTokenStrip = U == 4 ? 16 : W, kPanelStrip = U == 4 ? 8 : W;
  if (gather) {
    for (int64_t t0 = 0; t0 < tokens; t0 += kTokenStrip) {
      for (int64_t p = 0; p < panels; p += W) {
        for (int64_t t = t0; t < t0 + kTokenStrip && t < tokens; t += W) {
          uint8_t* c = cache + p * panel_stride + t * U;
          uint8_t* o = obj + t * obj_row + p * U;
          if (U == 4) transpose4_u32(c, panel_stride, o, obj_row); else transpose8_u16(c, panel_stride, o, obj_row);
        }
      }
    }
  } else {
    for (int64_t p0 = 0; p0 < panels; p0 += kPanelStrip) {
      for (int64_t t = 0; t < tokens; t += W) {
        for (int64_t p = p0; p < p0 + kPanelStrip && p < panels; p += W) {
          uint8_t* c = cache + p * panel_stride + t * U;
          uint8_t* o = obj + t * obj_row + p * U;
          if (U == 4) transpose4_u32(o, obj_row, c, panel_stride); else transpose8_u16(o, obj_row, c, panel_stride);
        }
      }
    }
  }
  return true;
#else
  (void)cache; (void)panel_stride; (void)token_stride; (void)obj; (void)obj_row; (void)panels; (void)tokens; (void)gather;
  (void)stream; (void)simd;
  return false;
#endif
}

template <typename U>
void transpose_units(uint8_t* cache, int64_t panel_stride, int64_t token_stride, uint8_t* obj,
                     int64_t obj_row, int64_t panels, int64_t tokens, bool gather) {
  constexpr int64_t B = 8;
  for (int64_t t0 = 0; t0 < tokens; t0 += B) {
    const int64_t t1 = t0 + B < tokens ? t0 + B : tokens;
    for (int64_t p0 = 0; p0 < panels; p0 += B) {
      const int64_t p1 = p0 + B < panels ? p0 + B : panels;
      for (int64_t t = t0; t < t1; ++t) {
        U* o = reinterpret_cast<U*>(obj + t * obj_row);
        for (int64_t p = p0; p < p1; ++p) {
          U* c = reinterpret_cast<U*>(cache + p * panel_stride + t * token_stride);
          if (gather) {
            o[p] = *c;
          } else {
            *c = o[p];
          }
        }
      }
    }
  }
}

struct Unit16 {
  uint64_t a, b;
};

void copy_tile(uint8_t* cache, uint8_t* obj, const KvpCanonGeometry& g, int s, bool gather, bool stream, int simd) {
  const int64_t T = g.tokens, D = g.head_dim, E = g.elem_bytes;
  const int64_t row = D * E;
  const int64_t tg = g.tg[s], ti = g.t_inner[s], to = g.t_outer[s];
  const int64_t dg = g.dg[s], di = g.d_inner[s], dout = g.d_outer[s];
  if (dg == D && di == E) {  // row-major: one run of D elements per token
    if (tg == T && ti == row) {
      uint8_t* dst = gather ? obj : cache;
      const uint8_t* src = gather ? cache : obj;
#ifdef KVP_HAVE_SSE2
      if (stream && (((uintptr_t)dst | (uintptr_t)(T * row)) & 15) == 0) {
        stream_copy(dst, src, T * row);
        return;
      }
#endif
      memcpy(dst, src, (size_t)(T * row));
      return;
    }
#ifdef KVP_HAVE_SSE2
    // scatter, a run per token (SGLang's page_first: a token holds every layer): whole cache
    // lines streamed, so memory sees 2 passes, not 3 (no line read before it is written).
    // A gather streamed this way was slower than plain stores, so it stays plain
    // (benchmarks/RESULTS.md, "Memory tier and page-cache gets after the streamed scatter").
    if (stream && !gather && ((row | ti | to) & 15) == 0 && ((uintptr_t)cache & 15) == 0) {
      for (int64_t t = 0; t < T; ++t) stream_copy(cache + (t / tg) * to + (t % tg) * ti, obj + t * row, row);
      return;
    }
#endif
    for (int64_t t = 0; t < T; ++t) {
      uint8_t* c = cache + (t / tg) * to + (t % tg) * ti;
      if (gather) memcpy(obj + t * row, c, (size_t)row); else memcpy(c, obj + t * row, (size_t)row);
    }
    return;
  }
  const int64_t unit = dg * E, panels = D / dg;
  if (di == E && ti == unit) {  // panels of dg-element units, tokens of a group adjacent
    for (int64_t t0 = 0; t0 < T; t0 += tg) {
      uint8_t* c0 = cache + (t0 / tg) * to;
      uint8_t* o0 = obj + t0 * row;
      if (unit == 4 && transpose_simd<4, 4>(c0, dout, ti, o0, row, panels, tg, gather, stream, simd)) continue;
      if (unit == 2 && transpose_simd<2, 8>(c0, dout, ti, o0, row, panels, tg, gather, stream, simd)) continue;
      switch (unit) {
        case 1: transpose_units<uint8_t>(c0, dout, ti, o0, row, panels, tg, gather); continue;
        case 2: transpose_units<uint16_t>(c0, dout, ti, o0, row, panels, tg, gather); continue;
        case 4: transpose_units<uint32_t>(c0, dout, ti, o0, row, panels, tg, gather); continue;
        case 8: transpose_units<uint64_t>(c0, dout, ti, o0, row, panels, tg, gather); continue;
        case 16: transpose_units<Unit16>(c0, dout, ti, o0, row, panels, tg, gather); continue;
        default:
          for (int64_t t = 0; t < tg; ++t) {
            for (int64_t p = 0; p < panels; ++p) {
              uint8_t* c = c0 + p * dout + t * ti;
              uint8_t* o = o0 + t * row + p * unit;
              if (gather) memcpy(o, c, (size_t)unit); else memcpy(c, o, (size_t)unit);
            }
          }
      }
    }
    return;
  }
#ifdef KVP_HAVE_SSE2
#ifdef KVP_HAVE_AVX512
  if (E == 2 && tg == 2 && ti == 2 && di == 4 && dg % 16 == 0 && D % 32 == 0 && !stream && simd >= KVP_SIMD_AVX512) {
    pairs_wide(cache, obj, T, D, dg, to, dout, gather);
    return;
  }
#endif
  if (E == 2 && tg == 2 && ti == 2 && di == 4 && dg % 8 == 0 && simd >= KVP_SIMD_SSE2) {  // token pairs (vLLM CPU V under amx)
    const bool streamed = stream && gather && (((uintptr_t)obj | (uintptr_t)row) & 15) == 0;
    if (streamed) prefetch_span(cache, (D / dg - 1) * dout + (T / 2) * to);
    for (int64_t t = 0; t < T; t += 2) {
      for (int64_t d0 = 0; d0 < D; d0 += dg) {
        uint8_t* c = cache + (t / 2) * to + (d0 / dg) * dout;
        uint8_t* o0 = obj + t * row + d0 * 2;
        if (streamed) pairs_u16<true>(c, o0, o0 + row, dg, true); else pairs_u16(c, o0, o0 + row, dg, gather);
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < T; ++t) {  // any other two-level split: element by element
    uint8_t* ct = cache + (t / tg) * to + (t % tg) * ti;
    uint8_t* ot = obj + t * row;
    for (int64_t d = 0; d < D; ++d) {
      uint8_t* c = ct + (d / dg) * dout + (d % dg) * di;
      if (gather) memcpy(ot + d * E, c, (size_t)E); else memcpy(c, ot + d * E, (size_t)E);
    }
  }
}

// Where a call's objects lie: object i at `staging + i * obj_bytes` (contiguous rows), or at
// `addrs[i]` (anywhere: a memory tier's slots; `kvp_canonical_copy_cpu_at`).
struct Objects {
  uint8_t* staging;
  const uint64_t* addrs;  // null: contiguous rows from `staging`
  int64_t obj_bytes;
  uint8_t* at(int64_t i) const { return addrs != nullptr ? (uint8_t*)(uintptr_t)addrs[i] : staging + i * obj_bytes; }
  // Every object starts on a 16-byte boundary.
  bool aligned16(int64_t n) const {
    if (addrs == nullptr) return ((uintptr_t)staging & 15) == 0 && (n <= 1 || (obj_bytes & 15) == 0);
    uint64_t any = 0;
    for (int64_t i = 0; i < n; ++i) any |= addrs[i];
    return (any & 15) == 0;
  }
};

#ifdef KVP_HAVE_SSE2
// Token-major pages (SGLang's page_first host pools: [token][layer][head][dim] per K/V
// region): the byte step from one token's row to the next when it is one constant `pitch`
// and every (layer, head) row of a token lies inside one pitch; 0 otherwise.
int64_t token_major_pitch(const KvpCanonGeometry& g, const uint64_t* ptr_table, int s) {
  const int64_t row = g.head_dim * g.elem_bytes;
  const int64_t tg = g.tg[s], ti = g.t_inner[s], to = g.t_outer[s];
  if (g.dg[s] != g.head_dim || g.d_inner[s] != g.elem_bytes || (row & 15) != 0) return 0;
  const int64_t pitch = tg == 1 ? to : ti;
  if (pitch <= 0 || (tg > 1 && tg < g.tokens && ti * tg != to) || (g.n_heads > 1 && g.head_stride < row)) return 0;
  uint64_t lo = UINT64_MAX, hi = 0;
  for (int64_t l = 0; l < g.num_layers; ++l) {
    const uint64_t first = ptr_table[l * g.num_kv + s] + (uint64_t)(g.cache_h0 * g.head_stride);
    const uint64_t last = first + (uint64_t)((g.n_heads - 1) * g.head_stride);
    lo = first < lo ? first : lo;
    hi = last + (uint64_t)row > hi ? last + (uint64_t)row : hi;
  }
  return hi - lo <= (uint64_t)pitch ? pitch : 0;
}

// A DRAM-sized gather out of token-major pages in the pages' address order: per block
// and K/V region, token by token, every (layer, head) row of the token streamed to its
// tile (one read stream, layers x heads write streams of whole lines). Walked tile by
// tile instead, each tile reads runs at a stride of a whole token, so once a page is
// larger than L2 its lines come back from L3 once per tile; in address order each line
// is read once (RESULTS.md, "the gather in address order", has the measurements).
// False: not this shape (the caller copies tile by tile).
bool gather_token_major(const KvpCanonGeometry& g, const uint64_t* ptr_table, const int64_t* block_ids, int64_t n,
                        const Objects& objs) {
  int64_t pitch[2] = {0, 0};
  for (int s = 0; s < g.num_kv; ++s) {
    pitch[s] = token_major_pitch(g, ptr_table, s);
    if (pitch[s] == 0) return false;
  }
  if (!objs.aligned16(n)) return false;
  const int64_t row = g.head_dim * g.elem_bytes, tile = g.tokens * row;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = block_ids[i] * g.block_stride + g.cache_h0 * g.head_stride;
    for (int s = 0; s < g.num_kv; ++s) {
      for (int64_t t = 0; t < g.tokens; ++t) {
        for (int64_t l = 0; l < g.num_layers; ++l) {
          const uint8_t* c = (const uint8_t*)(uintptr_t)ptr_table[l * g.num_kv + s] + block + t * pitch[s];
          uint8_t* o = objs.at(i) + ((l * g.num_kv + s) * g.obj_heads + g.obj_h0) * tile + t * row;
          for (int64_t h = 0; h < g.n_heads; ++h) stream_copy(o + h * tile, c + h * g.head_stride, row);
        }
      }
    }
  }
  return true;
}
#endif

// Calls moving at least this many bytes stream (see the top of the file): 16x the
// per-core L2, about where a copy stops fitting the caches and plain stores stop winning
// (the crossover: benchmarks/RESULTS.md, "Canonical objects").
int64_t stream_min_bytes() {
  static const int64_t bytes = [] {
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return (int64_t)16 * (l2 > 0 ? l2 : (1 << 20));
  }();
  return bytes;
}

}  // namespace

extern "C" int kvp_cpu_simd(void) {
#ifdef KVP_HAVE_AVX512
  if (kvp_avx512::cpu_has()) return KVP_SIMD_AVX512;
#endif
#ifdef KVP_HAVE_SSE2
  return KVP_SIMD_SSE2;
#else
  return KVP_SIMD_SCALAR;
#endif
}

namespace {

// One call over n objects wherever they lie (`Objects`): the checks, the streaming
// decision on the call's total bytes, then the token-major gather or tile by tile.
int copy_objects(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n, const Objects& objs,
                 const KvpCanonGeometry& g, int gather, int max_simd) {
  const int cpu = kvp_cpu_simd();
  const int simd = max_simd < cpu ? max_simd : cpu;
  if (n < 0 || g.num_layers <= 0 || (g.num_kv != 1 && g.num_kv != 2) || g.tokens <= 0 || g.head_dim <= 0 ||
      g.elem_bytes <= 0 || g.n_heads <= 0 || g.obj_h0 < 0 || g.obj_h0 + g.n_heads > g.obj_heads ||
      g.cache_h0 < 0) {
    return KVP_ERR_GEOMETRY;
  }
  for (int s = 0; s < g.num_kv; ++s) {
    if (g.dg[s] <= 0 || g.head_dim % g.dg[s] != 0 || g.tg[s] <= 0 || g.tokens % g.tg[s] != 0) return KVP_ERR_GEOMETRY;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (block_ids[i] < 0 || block_ids[i] >= g.num_cache_blocks) return KVP_ERR_BLOCK_ID;
  }
  const int64_t tile = g.tokens * g.head_dim * g.elem_bytes;
  const bool stream = simd >= KVP_SIMD_SSE2 && n * g.num_layers * g.num_kv * g.n_heads * tile >= stream_min_bytes();
#ifdef KVP_HAVE_SSE2
  if (stream && gather && gather_token_major(g, ptr_table, block_ids, n, objs)) {
    _mm_sfence();
    return KVP_OK;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* obj_block = objs.at(i);
    for (int64_t l = 0; l < g.num_layers; ++l) {
      for (int s = 0; s < g.num_kv; ++s) {
        uint8_t* seg = (uint8_t*)(uintptr_t)ptr_table[l * g.num_kv + s] + block_ids[i] * g.block_stride;
        uint8_t* obj_seg = obj_block + (l * g.num_kv + s) * g.obj_heads * tile;
        for (int64_t h = 0; h < g.n_heads; ++h) {
          copy_tile(seg + (g.cache_h0 + h) * g.head_stride, obj_seg + (g.obj_h0 + h) * tile, g, s, gather != 0, stream,
                    simd);
        }
      }
    }
  }
#ifdef KVP_HAVE_SSE2
  if (stream) _mm_sfence();  // streamed stores are visible before the caller reports the copy done
#endif
  return KVP_OK;
}

}  // namespace

extern "C" int kvp_canonical_copy_cpu(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n,
                                      uint8_t* staging, const KvpCanonGeometry* gp, int gather, int max_simd) {
  const KvpCanonGeometry g = *gp;
  return copy_objects(ptr_table, block_ids, n, Objects{staging, nullptr, kvp_canon_obj_bytes(&g)}, g, gather,
                      max_simd);
}

extern "C" int kvp_canonical_copy_cpu_at(const uint64_t* ptr_table, const int64_t* block_ids, const uint64_t* obj_addrs,
                                         int64_t n, const KvpCanonGeometry* gp, int gather, int max_simd) {
  const KvpCanonGeometry g = *gp;
  return copy_objects(ptr_table, block_ids, n, Objects{nullptr, obj_addrs, kvp_canon_obj_bytes(&g)}, g, gather,
                      max_simd);
}

extern "C" int kvp_canonical_emulate_cuda(const uint64_t* ptr_table, const int64_t* block_ids, int64_t n,
                                          uint8_t* staging, const KvpCanonGeometry* gp, int gather, int64_t ptr_align,
                                          int64_t* vec_out) {
  const KvpCanonGeometry g = *gp;
  for (int64_t i = 0; i < n; ++i) {
    if (block_ids[i] < 0 || block_ids[i] >= g.num_cache_blocks) return KVP_ERR_BLOCK_ID;
  }
  const int64_t vec = kvp_canon_pick_vec(&g, (uint64_t)(uintptr_t)staging, ptr_align);
  if (vec_out != nullptr) *vec_out = vec;
  const int64_t units = n * g.num_layers * g.num_kv * g.n_heads;
  const int64_t words = kvp_canon_tile_bytes(&g) / vec;
  for (int64_t u = 0; u < units; ++u) {  // what each CTA of the kernel does, in order
    uint8_t *cache, *obj;
    const int s = kvp_canon_unit(&g, ptr_table, block_ids, staging, u, &cache, &obj);
    for (int64_t w = 0; w < words; ++w) {
      int64_t co, oo;
      kvp_canon_word(&g, s, w, vec, &co, &oo);
      if ((((uintptr_t)(cache + co)) | ((uintptr_t)(obj + oo))) % (uintptr_t)vec != 0) return KVP_ERR_MISALIGNED;
      if (gather) memcpy(obj + oo, cache + co, (size_t)vec); else memcpy(cache + co, obj + oo, (size_t)vec);
    }
  }
  return KVP_OK;
}

// Torch custom ops (namespace `kvpack`) over the block-copy kernels.
//
//   kvpack::gather_blocks(Tensor[] tensors, Tensor ptr_table, Tensor block_ids,
//                         Tensor(a!) out, int[] geometry, int ptr_align, int stream) -> ()
//   kvpack::scatter_blocks(Tensor(a!)[] tensors, Tensor ptr_table, Tensor block_ids,
//                          Tensor src, int[] geometry, int ptr_align, int stream) -> ()
//   kvpack::emulate_cuda_copy(...)  test aid: the CUDA kernel's indexing on the CPU
//   kvpack::canonical_copy(Tensor(a!)[] tensors, Tensor ptr_table, Tensor block_ids,
//                          Tensor(b!) staging, int[] geometry, int ptr_align, int stream,
//                          bool gather) -> ()    canonical objects (canonical_copy.h)
//   kvpack::emulate_cuda_canonical_copy(...) -> int  test aid: canonical_copy.cu's
//                          indexing on the CPU; returns the word size it used
//   kvpack::canonical_copy_simd(..., int max_simd, bool gather) -> int  test aid: the
//                          CPU copy at SIMD level <= max_simd; returns the level used
//   kvpack::canonical_copy_at(Tensor(a!)[] tensors, Tensor ptr_table, Tensor block_ids,
//                          Tensor obj_addrs, int[] geometry, int max_simd, bool gather,
//                          int threads=1) -> int
//                          the CPU copy with object i at host address obj_addrs[i] (int64,
//                          one per block id; memory the caller keeps valid, objects apart),
//                          on `threads` native threads; returns the SIMD level used
//   kvpack::cpu_simd() -> int   the widest SIMD level (KVP_SIMD_*) the CPU copy uses
//
// `tensors` are the cache tensors that own the memory (listed so that the
// dispatcher knows their device and that scatter mutates them); the addresses
// actually used are ptr_table's (int64, num_layers * num_segments entries, on the
// cache's device). `geometry` is KvpGeometry packed as KVP_GEOMETRY_FIELDS int64s
// in declaration order. `stream` is a cudaStream_t as an integer (0: legacy default),
// ignored on CPU. The meta/fake kernels are registered from Python (kvpack.ops).
//
// Only ATen/torch CPU headers here: the CUDA side is reached through the plain C
// launcher of block_copy.cu, compiled in only with -DKVPACK_WITH_CUDA.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <system_error>
#include <thread>
#include <vector>

#include "block_copy_cpu.h"
#include "block_copy_geometry.h"
#include "canonical_copy.h"
#ifdef KVPACK_WITH_CUDA
#include "block_copy.h"
#include "canonical_copy_cuda.h"
#endif

namespace {

KvpGeometry unpack_geometry(c10::IntArrayRef v) {
  TORCH_CHECK(v.size() == KVP_GEOMETRY_FIELDS, "kvpack: geometry must have ", KVP_GEOMETRY_FIELDS,
              " fields, got ", v.size());
  KvpGeometry g;
  g.num_layers = v[0];
  g.num_segments = v[1];
  g.block_stride = v[2];
  g.outer_count = v[3];
  g.outer_stride = v[4];
  g.inner_count = v[5];
  g.inner_stride = v[6];
  g.row_bytes = v[7];
  g.token_dim = v[8];
  g.first_token_offset = v[9];
  g.last_token_count = v[10];
  g.num_cache_blocks = v[11];
  return g;
}

void check_common(const at::Tensor& ptr_table, const at::Tensor& block_ids, const at::Tensor& staging,
                  const KvpGeometry& g, const char* staging_name) {
  TORCH_CHECK(ptr_table.scalar_type() == at::kLong && ptr_table.is_contiguous() &&
                  ptr_table.numel() == g.num_layers * g.num_segments,
              "kvpack: ptr_table must be a contiguous int64 tensor of num_layers*num_segments=",
              g.num_layers * g.num_segments, " entries, got ", ptr_table.sizes(), " ",
              ptr_table.scalar_type());
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous() && block_ids.dim() == 1,
              "kvpack: block_ids must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(staging.scalar_type() == at::kByte && staging.is_contiguous(), "kvpack: ", staging_name,
              " must be a contiguous uint8 tensor, got ", staging.scalar_type());
  const int64_t need = block_ids.numel() * kvp_slot_bytes(g);
  TORCH_CHECK(staging.numel() >= need, "kvpack: ", staging_name, " holds ", staging.numel(),
              " bytes, need ", need, " (", block_ids.numel(), " blocks x ", kvp_slot_bytes(g), ")");
}

void copy_cpu(const at::Tensor& ptr_table, const at::Tensor& block_ids, const at::Tensor& staging,
              const KvpGeometry& g, int gather) {
  TORCH_CHECK(ptr_table.is_cpu() && block_ids.is_cpu() && staging.is_cpu(),
              "kvpack: CPU block copy needs ptr_table, block_ids and staging on the CPU");
  const int rc = kvp_block_copy_cpu(reinterpret_cast<const uint64_t*>(ptr_table.data_ptr<int64_t>()),
                                    block_ids.data_ptr<int64_t>(), block_ids.numel(),
                                    static_cast<uint8_t*>(staging.data_ptr()), &g, gather,
                                    /*num_threads=*/1);  // serial: see block_copy_cpu.cpp
  TORCH_CHECK(rc != KVP_ERR_BLOCK_ID, "kvpack: a block id is outside [0, ", g.num_cache_blocks, ")");
  TORCH_CHECK(rc == KVP_OK, "kvpack: invalid block-copy geometry (code ", rc, ")");
}

void gather_cpu(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
                const at::Tensor& out, c10::IntArrayRef geometry, int64_t ptr_align, int64_t stream) {
  (void)tensors; (void)ptr_align; (void)stream;
  const KvpGeometry g = unpack_geometry(geometry);
  check_common(ptr_table, block_ids, out, g, "out");
  copy_cpu(ptr_table, block_ids, out, g, 1);
}

void scatter_cpu(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
                 const at::Tensor& src, c10::IntArrayRef geometry, int64_t ptr_align, int64_t stream) {
  (void)tensors; (void)ptr_align; (void)stream;
  const KvpGeometry g = unpack_geometry(geometry);
  check_common(ptr_table, block_ids, src, g, "src");
  copy_cpu(ptr_table, block_ids, src, g, 0);
}

KvpCanonGeometry unpack_canon(c10::IntArrayRef v) {
  TORCH_CHECK(v.size() == KVP_CANON_FIELDS, "kvpack: canonical geometry must have ", KVP_CANON_FIELDS,
              " fields, got ", v.size());
  KvpCanonGeometry g;
  g.num_layers = v[0];
  g.num_kv = v[1];
  g.block_stride = v[2];
  g.head_stride = v[3];
  g.tokens = v[4];
  g.head_dim = v[5];
  g.elem_bytes = v[6];
  for (int k = 0; k < 2; ++k) {
    const int64_t o = 7 + 6 * k;
    g.tg[k] = v[o];
    g.t_inner[k] = v[o + 1];
    g.t_outer[k] = v[o + 2];
    g.dg[k] = v[o + 3];
    g.d_inner[k] = v[o + 4];
    g.d_outer[k] = v[o + 5];
  }
  g.obj_heads = v[19];
  g.obj_h0 = v[20];
  g.cache_h0 = v[21];
  g.n_heads = v[22];
  g.num_cache_blocks = v[23];
  return g;
}

void check_canon(const at::Tensor& ptr_table, const at::Tensor& block_ids, const at::Tensor& staging,
                 const KvpCanonGeometry& g) {
  TORCH_CHECK(ptr_table.scalar_type() == at::kLong && ptr_table.is_contiguous() &&
                  ptr_table.numel() == g.num_layers * g.num_kv,
              "kvpack: ptr_table must hold num_layers*num_kv int64 addresses");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous() && block_ids.dim() == 1,
              "kvpack: block_ids must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(staging.scalar_type() == at::kByte && staging.is_contiguous(), "kvpack: staging must be contiguous uint8");
  const int64_t need = block_ids.numel() * kvp_canon_obj_bytes(&g);
  TORCH_CHECK(staging.numel() >= need, "kvpack: staging holds ", staging.numel(), " bytes, need ", need);
}

// The CPU canonical copy at SIMD level <= max_simd; returns the level it used.
int64_t canonical_copy_simd(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
                            const at::Tensor& staging, c10::IntArrayRef geometry, int64_t max_simd, bool gather) {
  (void)tensors;
  const KvpCanonGeometry g = unpack_canon(geometry);
  TORCH_CHECK(ptr_table.is_cpu() && block_ids.is_cpu() && staging.is_cpu(),
              "kvpack: canonical copy needs ptr_table, block_ids and staging on the CPU");
  check_canon(ptr_table, block_ids, staging, g);
  const int rc = kvp_canonical_copy_cpu(reinterpret_cast<const uint64_t*>(ptr_table.data_ptr<int64_t>()),
                                        block_ids.data_ptr<int64_t>(), block_ids.numel(),
                                        static_cast<uint8_t*>(staging.data_ptr()), &g, gather ? 1 : 0,
                                        static_cast<int>(max_simd));
  TORCH_CHECK(rc != KVP_ERR_BLOCK_ID, "kvpack: a block id is outside [0, ", g.num_cache_blocks, ")");
  TORCH_CHECK(rc == KVP_OK, "kvpack: invalid canonical-copy geometry (code ", rc, ")");
  const int64_t cpu = kvp_cpu_simd();
  return max_simd < cpu ? max_simd : cpu;
}

// The CPU canonical copy over objects at the host addresses `obj_addrs` (one per block id),
// cut into `threads` pieces of about equal count (the caller's thread takes the first, one
// native thread each the others, joined before returning: the GIL is given up once for
// the whole call, never taken by a helper). Pieces touch disjoint blocks and objects.
int64_t canonical_copy_at(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
                          const at::Tensor& obj_addrs, c10::IntArrayRef geometry, int64_t max_simd, bool gather,
                          int64_t threads) {
  (void)tensors;
  const KvpCanonGeometry g = unpack_canon(geometry);
  TORCH_CHECK(ptr_table.is_cpu() && block_ids.is_cpu() && obj_addrs.is_cpu(),
              "kvpack: canonical copy needs ptr_table, block_ids and obj_addrs on the CPU");
  TORCH_CHECK(ptr_table.scalar_type() == at::kLong && ptr_table.is_contiguous() &&
                  ptr_table.numel() == g.num_layers * g.num_kv,
              "kvpack: ptr_table must hold num_layers*num_kv int64 addresses");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous() && block_ids.dim() == 1,
              "kvpack: block_ids must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(obj_addrs.scalar_type() == at::kLong && obj_addrs.is_contiguous() &&
                  obj_addrs.numel() == block_ids.numel(),
              "kvpack: obj_addrs must be a contiguous int64 tensor of one address per block id, got ",
              obj_addrs.numel(), " for ", block_ids.numel());
  TORCH_CHECK(threads >= 1 && threads <= 64, "kvpack: canonical_copy_at takes 1..64 threads, got ", threads);
  const uint64_t* table = reinterpret_cast<const uint64_t*>(ptr_table.data_ptr<int64_t>());
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  const uint64_t* addrs = reinterpret_cast<const uint64_t*>(obj_addrs.data_ptr<int64_t>());
  const int64_t n = block_ids.numel();
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  const int64_t share = (n + pieces - 1) / std::max<int64_t>(1, pieces);
  std::vector<int> codes(static_cast<size_t>(pieces), KVP_OK);
  auto piece = [&](int64_t k) {
    const int64_t lo = k * share, hi = std::min(n, lo + share);
    if (lo < hi) {
      codes[static_cast<size_t>(k)] = kvp_canonical_copy_cpu_at(table, ids + lo, addrs + lo, hi - lo, &g, gather ? 1 : 0,
                                                                static_cast<int>(max_simd));
    }
  };
  std::vector<std::thread> helpers;
  int64_t started = 1;
  try {
    for (; started < pieces; ++started) helpers.emplace_back(piece, started);
  } catch (const std::system_error&) {
    // no thread to be had (the process's limit): the caller copies the pieces left
  }
  for (int64_t k = started; k < pieces; ++k) piece(k);
  piece(0);
  for (auto& t : helpers) t.join();
  int rc = KVP_OK;
  for (int code : codes) {
    if (code != KVP_OK) {
      rc = code;
      break;
    }
  }
  TORCH_CHECK(rc != KVP_ERR_BLOCK_ID, "kvpack: a block id is outside [0, ", g.num_cache_blocks, ")");
  TORCH_CHECK(rc == KVP_OK, "kvpack: invalid canonical-copy geometry (code ", rc, ")");
  const int64_t cpu = kvp_cpu_simd();
  return max_simd < cpu ? max_simd : cpu;
}

void canonical_copy_cpu(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
                        const at::Tensor& staging, c10::IntArrayRef geometry, int64_t ptr_align, int64_t stream,
                        bool gather) {
  (void)ptr_align; (void)stream;
  canonical_copy_simd(tensors, ptr_table, block_ids, staging, geometry, KVP_SIMD_AVX512, gather);
}

int64_t cpu_simd() { return kvp_cpu_simd(); }

int64_t emulate_cuda_canonical_copy(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
                                    const at::Tensor& staging, c10::IntArrayRef geometry, int64_t ptr_align, bool gather) {
  (void)tensors;
  const KvpCanonGeometry g = unpack_canon(geometry);
  TORCH_CHECK(ptr_table.is_cpu() && block_ids.is_cpu() && staging.is_cpu(),
              "kvpack: the CUDA-kernel emulation runs on CPU tensors only");
  check_canon(ptr_table, block_ids, staging, g);
  int64_t vec = 0;
  const int rc = kvp_canonical_emulate_cuda(reinterpret_cast<const uint64_t*>(ptr_table.data_ptr<int64_t>()),
                                            block_ids.data_ptr<int64_t>(), block_ids.numel(),
                                            static_cast<uint8_t*>(staging.data_ptr()), &g, gather ? 1 : 0, ptr_align, &vec);
  TORCH_CHECK(rc != KVP_ERR_MISALIGNED, "kvpack: emulated CUDA canonical copy formed a misaligned word address");
  TORCH_CHECK(rc == KVP_OK, "kvpack: emulated CUDA canonical copy failed (code ", rc, ")");
  return vec;
}

void emulate_cuda_copy(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
                       const at::Tensor& staging, c10::IntArrayRef geometry, int64_t ptr_align, bool gather) {
  (void)tensors;
  const KvpGeometry g = unpack_geometry(geometry);
  check_common(ptr_table, block_ids, staging, g, "staging");
  TORCH_CHECK(ptr_table.is_cpu() && block_ids.is_cpu() && staging.is_cpu(),
              "kvpack: the CUDA-kernel emulation runs on CPU tensors only");
  const int rc = kvp_block_copy_emulate_cuda(
      reinterpret_cast<const uint64_t*>(ptr_table.data_ptr<int64_t>()), block_ids.data_ptr<int64_t>(),
      block_ids.numel(), static_cast<uint8_t*>(staging.data_ptr()), &g, gather ? 1 : 0, ptr_align);
  TORCH_CHECK(rc != KVP_ERR_MISALIGNED, "kvpack: emulated CUDA copy formed a misaligned word address");
  TORCH_CHECK(rc == KVP_OK, "kvpack: emulated CUDA copy failed (code ", rc, ")");
}

#ifdef KVPACK_WITH_CUDA
void copy_cuda(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
               const at::Tensor& staging, const KvpGeometry& g, int64_t ptr_align, int64_t stream,
               int gather) {
  TORCH_CHECK(!tensors.empty() && tensors[0].is_cuda(), "kvpack: CUDA block copy needs the cache on CUDA");
  TORCH_CHECK(ptr_table.is_cuda() && block_ids.is_cuda(),
              "kvpack: CUDA block copy needs ptr_table and block_ids on the cache's device");
  TORCH_CHECK(staging.is_cuda() || staging.is_pinned(),
              "kvpack: CUDA block copy needs a device or pinned host staging buffer");
  const cudaError_t err = kvp_block_copy_cuda(
      reinterpret_cast<const uint64_t*>(ptr_table.data_ptr<int64_t>()), block_ids.data_ptr<int64_t>(),
      block_ids.numel(), static_cast<uint8_t*>(staging.data_ptr()), &g, ptr_align, gather,
      reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream)));
  TORCH_CHECK(err == cudaSuccess, "kvpack: CUDA block copy launch failed: ", cudaGetErrorString(err));
}

void gather_cuda(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
                 const at::Tensor& out, c10::IntArrayRef geometry, int64_t ptr_align, int64_t stream) {
  const KvpGeometry g = unpack_geometry(geometry);
  check_common(ptr_table, block_ids, out, g, "out");
  copy_cuda(tensors, ptr_table, block_ids, out, g, ptr_align, stream, 1);
}

void scatter_cuda(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
                  const at::Tensor& src, c10::IntArrayRef geometry, int64_t ptr_align, int64_t stream) {
  const KvpGeometry g = unpack_geometry(geometry);
  check_common(ptr_table, block_ids, src, g, "src");
  copy_cuda(tensors, ptr_table, block_ids, src, g, ptr_align, stream, 0);
}

void canonical_copy_cuda(at::TensorList tensors, const at::Tensor& ptr_table, const at::Tensor& block_ids,
                         const at::Tensor& staging, c10::IntArrayRef geometry, int64_t ptr_align, int64_t stream,
                         bool gather) {
  const KvpCanonGeometry g = unpack_canon(geometry);
  check_canon(ptr_table, block_ids, staging, g);
  TORCH_CHECK(!tensors.empty() && tensors[0].is_cuda(), "kvpack: CUDA canonical copy needs the cache on CUDA");
  TORCH_CHECK(ptr_table.is_cuda() && block_ids.is_cuda(),
              "kvpack: CUDA canonical copy needs ptr_table and block_ids on the cache's device");
  TORCH_CHECK(staging.is_cuda() || staging.is_pinned(),
              "kvpack: CUDA canonical copy needs a device or pinned host staging buffer");
  const cudaError_t err = kvp_canonical_copy_cuda(
      reinterpret_cast<const uint64_t*>(ptr_table.data_ptr<int64_t>()), block_ids.data_ptr<int64_t>(),
      block_ids.numel(), static_cast<uint8_t*>(staging.data_ptr()), &g, ptr_align, gather ? 1 : 0,
      reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream)));
  TORCH_CHECK(err == cudaSuccess, "kvpack: CUDA canonical copy launch failed: ", cudaGetErrorString(err));
}
#endif

bool has_cuda() {
#ifdef KVPACK_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(kvpack, m) {
  m.def(
      "gather_blocks(Tensor[] tensors, Tensor ptr_table, Tensor block_ids, Tensor(a!) out, "
      "int[] geometry, int ptr_align, int stream) -> ()");
  m.def(
      "scatter_blocks(Tensor(a!)[] tensors, Tensor ptr_table, Tensor block_ids, Tensor src, "
      "int[] geometry, int ptr_align, int stream) -> ()");
  m.def("has_cuda() -> bool", &has_cuda);
  // Canonical objects (canonical_copy.h): gather=true cache -> staging, false the reverse.
  m.def(
      "canonical_copy(Tensor(a!)[] tensors, Tensor ptr_table, Tensor block_ids, Tensor(b!) staging, "
      "int[] geometry, int ptr_align, int stream, bool gather) -> ()");
  m.def("cpu_simd() -> int", &cpu_simd);
  // CPU: the canonical copy with each object at its own host address (a tier's slots).
  m.def(
      "canonical_copy_at(Tensor(a!)[] tensors, Tensor ptr_table, Tensor block_ids, Tensor obj_addrs, "
      "int[] geometry, int max_simd, bool gather, int threads=1) -> int");
  // Test aid (CPU): the canonical copy capped at a SIMD level (every level, on one CPU).
  m.def(
      "canonical_copy_simd(Tensor(a!)[] tensors, Tensor ptr_table, Tensor block_ids, Tensor(b!) staging, "
      "int[] geometry, int max_simd, bool gather) -> int");
  // Test aid (CPU): canonical_copy.cu's word-by-word indexing, run on the CPU.
  m.def(
      "emulate_cuda_canonical_copy(Tensor(a!)[] tensors, Tensor ptr_table, Tensor block_ids, Tensor(b!) staging, "
      "int[] geometry, int ptr_align, bool gather) -> int");
  // Test aid (CPU): block_copy.cu's word-by-word indexing, run on the CPU.
  m.def(
      "emulate_cuda_copy(Tensor(a!)[] tensors, Tensor ptr_table, Tensor block_ids, Tensor(b!) staging, "
      "int[] geometry, int ptr_align, bool gather) -> ()");
}

TORCH_LIBRARY_IMPL(kvpack, CPU, m) {
  m.impl("gather_blocks", &gather_cpu);
  m.impl("scatter_blocks", &scatter_cpu);
  m.impl("emulate_cuda_copy", &emulate_cuda_copy);
  m.impl("canonical_copy", &canonical_copy_cpu);
  m.impl("canonical_copy_simd", &canonical_copy_simd);
  m.impl("canonical_copy_at", &canonical_copy_at);
  m.impl("emulate_cuda_canonical_copy", &emulate_cuda_canonical_copy);
}

#ifdef KVPACK_WITH_CUDA
TORCH_LIBRARY_IMPL(kvpack, CUDA, m) {
  m.impl("gather_blocks", &gather_cuda);
  m.impl("scatter_blocks", &scatter_cuda);
  m.impl("canonical_copy", &canonical_copy_cuda);
}
#endif

// See region_copy_cpu.h.
#include "region_copy_cpu.h"

#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVP_HAVE_STREAM 1
#endif

namespace {

#ifdef KVP_HAVE_STREAM
// dst <- src with 16-byte non-temporal stores: memcpy up to dst's 16-byte
// boundary, then 64 bytes a step (unaligned loads, aligned streaming stores),
// then memcpy of the rest.
void stream_copy(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  int64_t head = (int64_t)((16 - ((uintptr_t)dst & 15)) & 15);
  if (head > bytes) head = bytes;
  memcpy(dst, src, (size_t)head);
  dst += head;
  src += head;
  bytes -= head;
  const int64_t steps = bytes / 64;
  for (int64_t i = 0; i < steps; ++i) {
    const __m128i a = _mm_loadu_si128((const __m128i*)(src));
    const __m128i b = _mm_loadu_si128((const __m128i*)(src + 16));
    const __m128i c = _mm_loadu_si128((const __m128i*)(src + 32));
    const __m128i d = _mm_loadu_si128((const __m128i*)(src + 48));
    _mm_stream_si128((__m128i*)(dst), a);
    _mm_stream_si128((__m128i*)(dst + 16), b);
    _mm_stream_si128((__m128i*)(dst + 32), c);
    _mm_stream_si128((__m128i*)(dst + 48), d);
    src += 64;
    dst += 64;
  }
  memcpy(dst, src, (size_t)(bytes - steps * 64));
}
#endif

}  // namespace

extern "C" void kvp_copy_regions(const KvpRegion* regions, int64_t n, int streaming) {
#ifdef KVP_HAVE_STREAM
  int streamed = 0;
#endif
  for (int64_t i = 0; i < n; ++i) {
    const KvpRegion& r = regions[i];
    if (r.bytes <= 0) continue;
#ifdef KVP_HAVE_STREAM
    if (streaming && r.bytes >= KVP_STREAM_MIN_BYTES) {
      stream_copy(r.dst, r.src, r.bytes);
      streamed = 1;
      continue;
    }
#endif
    memcpy(r.dst, r.src, (size_t)r.bytes);
  }
#ifdef KVP_HAVE_STREAM
  if (streamed) _mm_sfence();  // streaming stores are weakly ordered: visible before we return
#else
  (void)streaming;
#endif
}

// SSE2 building blocks of the CPU canonical copy (canonical_copy_cpu.cpp): unit
// transposes, token-pair interleaves and streamed (non-temporal) copies. Every x86-64
// CPU has SSE2; elsewhere KVP_HAVE_SSE2 is not defined and the copy stays scalar.
#pragma once

#include <stdint.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#define KVP_HAVE_SSE2 1

namespace kvp_sse2 {

// 4x4 block of 4-byte units: src rows `sr` bytes apart -> dst rows `dr` apart, transposed.
inline void transpose4_u32(const uint8_t* src, int64_t sr, uint8_t* dst, int64_t dr) {
  __m128 r0 = _mm_loadu_ps(reinterpret_cast<const float*>(src));
  __m128 r1 = _mm_loadu_ps(reinterpret_cast<const float*>(src + sr));
  __m128 r2 = _mm_loadu_ps(reinterpret_cast<const float*>(src + 2 * sr));
  __m128 r3 = _mm_loadu_ps(reinterpret_cast<const float*>(src + 3 * sr));
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  _mm_storeu_ps(reinterpret_cast<float*>(dst), r0);
  _mm_storeu_ps(reinterpret_cast<float*>(dst + dr), r1);
  _mm_storeu_ps(reinterpret_cast<float*>(dst + 2 * dr), r2);
  _mm_storeu_ps(reinterpret_cast<float*>(dst + 3 * dr), r3);
}

// 8x8 block of 2-byte units, the same way.
inline void transpose8_u16(const uint8_t* src, int64_t sr, uint8_t* dst, int64_t dr) {
  __m128i a[8], b[8], c[8];
  for (int k = 0; k < 8; ++k) a[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * sr));
  for (int k = 0; k < 4; ++k) {
    b[2 * k] = _mm_unpacklo_epi16(a[2 * k], a[2 * k + 1]);
    b[2 * k + 1] = _mm_unpackhi_epi16(a[2 * k], a[2 * k + 1]);
  }
  c[0] = _mm_unpacklo_epi32(b[0], b[2]);
  c[1] = _mm_unpackhi_epi32(b[0], b[2]);
  c[2] = _mm_unpacklo_epi32(b[1], b[3]);
  c[3] = _mm_unpackhi_epi32(b[1], b[3]);
  c[4] = _mm_unpacklo_epi32(b[4], b[6]);
  c[5] = _mm_unpackhi_epi32(b[4], b[6]);
  c[6] = _mm_unpacklo_epi32(b[5], b[7]);
  c[7] = _mm_unpackhi_epi32(b[5], b[7]);
  for (int k = 0; k < 4; ++k) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * k) * dr), _mm_unpacklo_epi64(c[k], c[k + 4]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * k + 1) * dr), _mm_unpackhi_epi64(c[k], c[k + 4]));
  }
}

// Token pairs of 2-byte elements: the cache holds, per dim group, [pairs][dims][2]
// (two tokens' values of one dim adjacent); the object holds rows of dims. `dims`
// must be a multiple of 8. Each 8 dims of the two rows <-> 32 cache bytes.
template <bool kStream = false>
inline void pairs_u16(uint8_t* c, uint8_t* o0, uint8_t* o1, int64_t dims, bool gather) {
  for (int64_t k = 0; k < dims; k += 8) {
    uint8_t* cc = c + k * 4;
    if (gather) {
      __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cc));
      __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cc + 16));
      x = _mm_shuffle_epi32(_mm_shufflehi_epi16(_mm_shufflelo_epi16(x, 0xD8), 0xD8), 0xD8);
      y = _mm_shuffle_epi32(_mm_shufflehi_epi16(_mm_shufflelo_epi16(y, 0xD8), 0xD8), 0xD8);
      if (kStream) {  // object rows are written in address order: whole lines, no read first
        _mm_stream_si128(reinterpret_cast<__m128i*>(o0 + k * 2), _mm_unpacklo_epi64(x, y));
        _mm_stream_si128(reinterpret_cast<__m128i*>(o1 + k * 2), _mm_unpackhi_epi64(x, y));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o0 + k * 2), _mm_unpacklo_epi64(x, y));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o1 + k * 2), _mm_unpackhi_epi64(x, y));
      }
    } else {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o0 + k * 2));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o1 + k * 2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(cc), _mm_unpacklo_epi16(a, b));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(cc + 16), _mm_unpackhi_epi16(a, b));
    }
  }
}

// `n` bytes (a multiple of 16; both 16-byte aligned) from L1 to memory, bypassing the caches.
inline void stream_out(uint8_t* dst, const uint8_t* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_load_si128(reinterpret_cast<const __m128i*>(src + i)));
  }
}

// `n` bytes (a multiple of 16; `dst` 16-byte aligned) memory to memory, whole lines at a time.
inline void stream_copy(uint8_t* dst, const uint8_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  for (; i < n; i += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
}

// Asks for the `n` bytes at `p` in address order (into L1), ahead of a copy that reads
// them out of order.
inline void prefetch_span(const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

}  // namespace kvp_sse2

#endif  // __SSE2__

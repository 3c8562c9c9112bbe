// AVX-512 building blocks of the CPU canonical copy (canonical_copy_cpu.cpp), built
// with a target attribute so the extension compiles for any x86-64 and runs them only
// where kvp_avx512::cpu_has() says the CPU (and OS) support AVX-512 BW.
//
// Each block moves whole 64-byte rows: a 32x32 transpose of 2-byte units or a 16x16
// one of 4-byte units reads 32 (16) rows of 64 bytes and writes 32 (16) rows of 64
// bytes, so a transposing copy fills whole destination lines, with 160 (64) shuffles
// per 2 KiB (1 KiB) against SSE2's 384 (128): fewer shuffles for in-cache calls, where the
// shuffles, not memory, are the limit (benchmarks/RESULTS.md, "In-cache calls").
#pragma once

#include <stdint.h>

#if defined(__x86_64__) && defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVP_HAVE_AVX512 1
#define KVP_AVX512_FN __attribute__((target("avx512f,avx512bw")))

namespace kvp_avx512 {

// True when this CPU runs AVX-512 F and BW (CPUID and the OS's saved register state).
inline bool cpu_has() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
}

// 4x4 transpose of 128-bit lanes: lane i of o[k] = lane k of the i-th input.
KVP_AVX512_FN inline void lanes4x4(__m512i a, __m512i b, __m512i c, __m512i d, __m512i* o) {
  const __m512i t0 = _mm512_shuffle_i64x2(a, b, 0x44), t1 = _mm512_shuffle_i64x2(a, b, 0xEE);
  const __m512i t2 = _mm512_shuffle_i64x2(c, d, 0x44), t3 = _mm512_shuffle_i64x2(c, d, 0xEE);
  o[0] = _mm512_shuffle_i64x2(t0, t2, 0x88);
  o[1] = _mm512_shuffle_i64x2(t0, t2, 0xDD);
  o[2] = _mm512_shuffle_i64x2(t1, t3, 0x88);
  o[3] = _mm512_shuffle_i64x2(t1, t3, 0xDD);
}

// 32x32 block of 2-byte units: 32 src rows of 64 bytes, `sr` apart -> 32 dst rows `dr` apart.
// Rows 8g..8g+7 are transposed per 128-bit lane (lane i: units 8i..8i+7), then the
// lanes of the four groups: dst row 8i + j = lane i of group results j.
KVP_AVX512_FN inline void transpose32_u16(const uint8_t* src, int64_t sr, uint8_t* dst, int64_t dr) {
  __m512i r[32];
  for (int g = 0; g < 4; ++g) {
    __m512i a[8], b[8], c[8];
    for (int k = 0; k < 8; ++k) a[k] = _mm512_loadu_si512(src + (8 * g + k) * sr);
    for (int k = 0; k < 4; ++k) {
      b[2 * k] = _mm512_unpacklo_epi16(a[2 * k], a[2 * k + 1]);
      b[2 * k + 1] = _mm512_unpackhi_epi16(a[2 * k], a[2 * k + 1]);
    }
    for (int k = 0; k < 2; ++k) {
      c[4 * k] = _mm512_unpacklo_epi32(b[4 * k], b[4 * k + 2]);
      c[4 * k + 1] = _mm512_unpackhi_epi32(b[4 * k], b[4 * k + 2]);
      c[4 * k + 2] = _mm512_unpacklo_epi32(b[4 * k + 1], b[4 * k + 3]);
      c[4 * k + 3] = _mm512_unpackhi_epi32(b[4 * k + 1], b[4 * k + 3]);
    }
    for (int k = 0; k < 4; ++k) {
      r[8 * g + 2 * k] = _mm512_unpacklo_epi64(c[k], c[k + 4]);
      r[8 * g + 2 * k + 1] = _mm512_unpackhi_epi64(c[k], c[k + 4]);
    }
  }
  for (int j = 0; j < 8; ++j) {
    __m512i o[4];
    lanes4x4(r[j], r[8 + j], r[16 + j], r[24 + j], o);
    for (int i = 0; i < 4; ++i) _mm512_storeu_si512(dst + (8 * i + j) * dr, o[i]);
  }
}

// 16x16 block of 4-byte units, the same way (groups of 4 rows).
KVP_AVX512_FN inline void transpose16_u32(const uint8_t* src, int64_t sr, uint8_t* dst, int64_t dr) {
  __m512i r[16];
  for (int g = 0; g < 4; ++g) {
    __m512i a[4];
    for (int k = 0; k < 4; ++k) a[k] = _mm512_loadu_si512(src + (4 * g + k) * sr);
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpacklo_epi32(a[2], a[3]);
    const __m512i t2 = _mm512_unpackhi_epi32(a[0], a[1]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    r[4 * g] = _mm512_unpacklo_epi64(t0, t1);
    r[4 * g + 1] = _mm512_unpackhi_epi64(t0, t1);
    r[4 * g + 2] = _mm512_unpacklo_epi64(t2, t3);
    r[4 * g + 3] = _mm512_unpackhi_epi64(t2, t3);
  }
  for (int j = 0; j < 4; ++j) {
    __m512i o[4];
    lanes4x4(r[j], r[4 + j], r[8 + j], r[12 + j], o);
    for (int i = 0; i < 4; ++i) _mm512_storeu_si512(dst + (4 * i + j) * dr, o[i]);
  }
}

// Token pairs of 2-byte elements (see kvp_sse2::pairs_u16), 32 dims at once: `a` and `b`
// are the cache's 64 bytes for dims d..d+15 and d+16..d+31 of one token pair, `o0` and
// `o1` the two tokens' object rows at dim d (64 bytes each).
KVP_AVX512_FN inline void pairs32_u16(uint8_t* a, uint8_t* b, uint8_t* o0, uint8_t* o1, bool gather) {
  if (gather) {  // o0 = even units of a:b, o1 = odd units
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26,
                                          24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    const __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
    _mm512_storeu_si512(o0, _mm512_permutex2var_epi16(x, even, y));
    _mm512_storeu_si512(o1, _mm512_permutex2var_epi16(x, odd, y));
  } else {  // a = o0[0:16] interleaved with o1[0:16], b = the same of [16:32]
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                        5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const __m512i x = _mm512_loadu_si512(o0), y = _mm512_loadu_si512(o1);
    _mm512_storeu_si512(a, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_storeu_si512(b, _mm512_permutex2var_epi16(x, hi, y));
  }
}

}  // namespace kvp_avx512

#endif

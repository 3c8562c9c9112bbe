// Copies of independent byte regions for kvpack's host tiers (torch-free C).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One copy: `bytes` bytes from `src` to `dst` (the two must not overlap).
typedef struct {
  uint8_t* dst;
  const uint8_t* src;
  int64_t bytes;
} KvpRegion;

// Regions at least this long are written with streaming (non-temporal) stores
// when `streaming` is set; shorter ones always go through memcpy.
#define KVP_STREAM_MIN_BYTES (16 * 1024)

// Copies every region in order. streaming != 0: long regions are written with
// non-temporal stores (x86-64; elsewhere memcpy), which skip the read-for-
// ownership of the destination and leave it out of the cache: right for data
// written now and read much later (a tier's stored object), wrong for data read
// again at once. Thread safe; no global state; never fails.
void kvp_copy_regions(const KvpRegion* regions, int64_t n, int streaming);

#ifdef __cplusplus
}  // extern "C"
#endif

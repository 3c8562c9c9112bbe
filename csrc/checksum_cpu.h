// Payload checksums of a batch of objects: xxh3_64 (seed 0) of each object's parts
// in order, the digest Python's `xxhash.xxh3_64` gives for the same bytes (torch-free C).
#pragma once

#include <stdint.h>
#include <sys/uio.h>

#ifdef __cplusplus
extern "C" {
#endif

// out[i] = xxh3_64 of parts[first[i] .. first[i] + count[i]) concatenated, for i in [0, n).
// Thread safe; no global state; never throws.
void kvp_xxh3_many(const struct iovec* parts, const int64_t* first, const int64_t* count, int64_t n, uint64_t* out);

#ifdef __cplusplus
}  // extern "C"
#endif

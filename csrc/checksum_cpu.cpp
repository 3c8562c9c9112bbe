// See checksum_cpu.h. xxhash.h is xxHash 0.8 (BSD 2-Clause, Yann Collet), inlined here only.
#include "checksum_cpu.h"

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"

void kvp_xxh3_many(const struct iovec* parts, const int64_t* first, const int64_t* count, int64_t n, uint64_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const struct iovec* p = parts + first[i];
    if (count[i] == 1) {
      out[i] = XXH3_64bits(p->iov_base, p->iov_len);
      continue;
    }
    XXH3_state_t state;  // XXH_STATIC_LINKING_ONLY: on the stack, no allocation
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    for (int64_t j = 0; j < count[i]; ++j) XXH3_64bits_update(&state, p[j].iov_base, p[j].iov_len);
    out[i] = XXH3_64bits_digest(&state);
  }
}

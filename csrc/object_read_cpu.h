// Batch reads of disk-tier object files beneath a store root (torch-free C).
//
// One object: open its file beneath the root with openat2 (no symlink followed,
// never leaving the root; O_NONBLOCK so a FIFO opens at once), refuse anything
// but a regular file, and when the file's size is exactly the bytes of its
// destination parts (header page and payload: every full chunk), read it whole
// into them (preadv from offset 0, partial reads continued) and, when asked,
// hash the parts from `digest_from` on (the payload) right after, while they are
// still in the CPU's cache. Nothing is checked here but sizes: the caller checks
// the header and compares the digest with the header's checksum, and reads any
// other object (a different size, an error) its own way. Rules of
// kvpack.tiers.disk.fs and kvpack.tiers.disk.files.
#pragma once

#include <stdint.h>
#include <sys/uio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const char* path;  // relative path of validated names, NUL-terminated
  const struct iovec* parts;
  int nparts;
  int digest_from;  // in: >= 0 hashes parts[digest_from..nparts) after a whole read; -1 no hash
  int err;       // out: 0 a regular file was opened; else the errno (EINVAL: not a regular file)
  int64_t size;  // out: the file's size in bytes, -1 when not opened
  int64_t got;   // out: bytes read into parts when `size` equals their total, else -1 (nothing read)
  uint64_t digest;  // out: xxh3_64 (seed 0) of parts[digest_from..nparts) when they were read whole, else 0
} KvpObjectRead;

// Reads objs[0..n) in order; each object's outcome goes to its err/size/got. An
// openat2 the kernel does not have (ENOSYS) or refuses (EPERM, seccomp) is that
// object's err, and every later object of the batch gets the same err without a
// try (the caller reads them another way). Thread safe; no global state; never throws.
void kvp_read_objects(int root_fd, KvpObjectRead* objs, int64_t n);

#ifdef __cplusplus
}  // extern "C"
#endif

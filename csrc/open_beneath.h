// Opening a path beneath a store root without following any symlink (torch-free C++).
//
// openat2(root_fd, path) with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
// RESOLVE_NO_MAGICLINKS and O_NOFOLLOW | O_CLOEXEC added to the flags: never
// follows a symlink, never leaves the root (kvpack.tiers.disk.fs's rule). Shared
// by the batch object writes and reads; header-only, no global state.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437  // the same number on every Linux architecture (unified syscall table)
#endif

namespace kvp {

struct OpenHow {  // the kernel's struct open_how (linux/openat2.h), spelled here for old headers
  uint64_t flags;
  uint64_t mode;
  uint64_t resolve;
};

constexpr uint64_t kResolveNoMagiclinks = 0x02;
constexpr uint64_t kResolveNoSymlinks = 0x04;
constexpr uint64_t kResolveBeneath = 0x08;

// An fd of `path` beneath `root_fd` opened with `flags` (no O_CREAT: the mode is 0), or
// -errno: ENOSYS/EPERM where the kernel lacks or refuses openat2, ELOOP/EXDEV for a
// symlink or an escape on the way.
inline int open_beneath(int root_fd, const char* path, int flags) {
  OpenHow how{static_cast<uint64_t>(flags | O_NOFOLLOW | O_CLOEXEC), 0,
              kResolveBeneath | kResolveNoSymlinks | kResolveNoMagiclinks};
  long fd;
  do {
    fd = syscall(SYS_openat2, root_fd, path, &how, sizeof(how));
  } while (fd < 0 && errno == EINTR);
  return fd < 0 ? -errno : static_cast<int>(fd);
}

}  // namespace kvp

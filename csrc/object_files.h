// What the batch object-file writes and reads share (torch-free C++, header-only, no
// global state):
//
// - open_beneath: openat2(root_fd, path) with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//   RESOLVE_NO_MAGICLINKS and O_NOFOLLOW | O_CLOEXEC added to the flags: never
//   follows a symlink, never leaves the root (kvpack.tiers.disk.fs's rule);
// - IovCursor: the parts of a vector transfer not moved yet, continued after a
//   partial writev/preadv.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

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

// The parts of parts[0..n) not transferred yet: data()/count() for the next call (at most
// IOV_MAX parts, empty ones skipped), advance(moved) after it moved `moved` bytes.
class IovCursor {
 public:
  IovCursor(const struct iovec* parts, int n) : left_(parts, parts + n) { skip_empty(); }

  bool done() const { return at_ == left_.size(); }
  const struct iovec* data() const { return left_.data() + at_; }
  int count() const { return static_cast<int>(std::min<size_t>(left_.size() - at_, IOV_MAX)); }

  void advance(size_t moved) {
    while (at_ < left_.size() && moved >= left_[at_].iov_len) {
      moved -= left_[at_].iov_len;
      ++at_;
    }
    if (at_ < left_.size()) {
      left_[at_].iov_base = static_cast<char*>(left_[at_].iov_base) + moved;
      left_[at_].iov_len -= moved;
    }
    skip_empty();
  }

 private:
  void skip_empty() {
    while (at_ < left_.size() && left_[at_].iov_len == 0) ++at_;
  }

  std::vector<struct iovec> left_;
  size_t at_ = 0;
};

}  // namespace kvp

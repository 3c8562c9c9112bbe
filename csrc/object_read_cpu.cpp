// See object_read_cpu.h.
#include "object_read_cpu.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checksum_cpu.h"
#include "object_files.h"

namespace {

// Reads parts[0..n) from fd at offset 0 until they are full or the file ends: the bytes
// read, or -errno.
int64_t read_parts(int fd, const struct iovec* parts, int n) {
  kvp::IovCursor left(parts, n);
  int64_t total = 0;
  while (!left.done()) {
    const ssize_t got = preadv(fd, left.data(), left.count(), total);
    if (got < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (got == 0) break;  // the file ended (shrunk since fstat): the caller sees got < size
    total += got;
    left.advance(static_cast<size_t>(got));
  }
  return total;
}

// One object (see the header); true when openat2 itself is missing or refused (ENOSYS, EPERM).
bool read_one(int root_fd, KvpObjectRead& obj) {
  obj.err = 0;
  obj.size = -1;
  obj.got = -1;
  obj.digest = 0;
  const int fd = kvp::open_beneath(root_fd, obj.path, O_RDONLY | O_NONBLOCK);
  if (fd < 0) {
    obj.err = -fd;
    return obj.err == ENOSYS || obj.err == EPERM;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    obj.err = errno;
  } else if (!S_ISREG(st.st_mode)) {
    obj.err = EINVAL;
  } else {
    obj.size = static_cast<int64_t>(st.st_size);
    int64_t want = 0;
    for (int j = 0; j < obj.nparts; ++j) want += static_cast<int64_t>(obj.parts[j].iov_len);
    if (obj.size == want) {
      const int64_t got = read_parts(fd, obj.parts, obj.nparts);
      if (got < 0) {
        obj.err = static_cast<int>(-got);
      } else {
        obj.got = got;
        if (got == want && obj.digest_from >= 0 && obj.digest_from <= obj.nparts) {
          const int64_t first = 0;
          const int64_t count = obj.nparts - obj.digest_from;
          kvp_xxh3_many(obj.parts + obj.digest_from, &first, &count, 1, &obj.digest);
        }
      }
    }
  }
  close(fd);
  return false;
}

}  // namespace

void kvp_read_objects(int root_fd, KvpObjectRead* objs, int64_t n) {
  int missing = 0;  // ENOSYS/EPERM from openat2: the rest of the batch is the caller's
  for (int64_t i = 0; i < n; ++i) {
    if (missing != 0) {
      objs[i].err = missing;
      objs[i].size = -1;
      objs[i].got = -1;
      objs[i].digest = 0;
      continue;
    }
    if (read_one(root_fd, objs[i])) missing = objs[i].err;
  }
}

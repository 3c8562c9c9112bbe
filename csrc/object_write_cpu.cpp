// See object_write_cpu.h.
#include "object_write_cpu.h"

#include "object_files.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>  // FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_TOPDIR_FL
#include <stdio.h>     // renameat
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

namespace {

using kvp::open_beneath;

// A directory fd of `leaf` beneath `root_fd`, or -errno; a leaf that is a symlink itself is
// -ELOOP (O_DIRECTORY | O_NOFOLLOW on it is ENOTDIR, like a file's: fs.open_dir's rule).
int open_leaf(int root_fd, const char* leaf) {
  const int fd = open_beneath(root_fd, leaf, O_RDONLY | O_DIRECTORY);
  if (fd != -ENOTDIR) return fd;
  const int path_fd = open_beneath(root_fd, leaf, O_PATH);
  if (path_fd < 0) return fd;
  struct stat st;
  const bool link = fstat(path_fd, &st) == 0 && S_ISLNK(st.st_mode);
  close(path_fd);
  return link ? -ELOOP : fd;
}

// Best effort: FS_TOPDIR_FL on the folder `dfd` (ext4 spreads its subfolders over block groups;
// other file systems refuse it). kvpack.tiers.disk.fs.spread_subfolders' rule.
void spread_subfolders(int dfd) {
  int flags = 0;
  if (ioctl(dfd, FS_IOC_GETFLAGS, &flags) != 0 || (flags & FS_TOPDIR_FL) != 0) return;
  flags |= FS_TOPDIR_FL;
  (void)ioctl(dfd, FS_IOC_SETFLAGS, &flags);
}

// The folders of `leaf` made beneath the root, each 0700, one component at a time through
// open_leaf (no symlink followed: -ELOOP), every folder made here but the last spread:
// kvpack.tiers.disk.fs.make_dirs' rule. 0 or -errno.
int make_leaf(int root_fd, const char* leaf) {
  const std::string path(leaf);
  int dfd = root_fd;
  int rc = 0;
  for (size_t start = 0;;) {
    const size_t slash = path.find('/', start);
    const bool last = slash == std::string::npos;
    const std::string part = path.substr(start, last ? std::string::npos : slash - start);
    const bool created = mkdirat(dfd, part.c_str(), 0700) == 0;
    if (!created && errno != EEXIST) {
      rc = -errno;
      break;
    }
    const int nfd = open_leaf(dfd, part.c_str());
    if (nfd < 0) {
      rc = nfd;
      break;
    }
    if (created && !last) spread_subfolders(nfd);
    if (dfd != root_fd) close(dfd);
    dfd = nfd;
    if (last) break;
    start = slash + 1;
  }
  if (dfd != root_fd) close(dfd);
  return rc;
}

// Every byte of parts[0..n) to fd; 0 or an errno.
int write_parts(int fd, const struct iovec* parts, int n) {
  kvp::IovCursor left(parts, n);
  while (!left.done()) {
    const ssize_t got = writev(fd, left.data(), left.count());
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return EIO;
    left.advance(static_cast<size_t>(got));
  }
  return 0;
}

// The temporary's content, flushed if asked, closed: 0 or the first errno.
int fill_temp(int fd, const KvpObjectWrite& obj, int do_fsync) {
  int err = write_parts(fd, obj.parts, obj.nparts);
  if (err == 0 && do_fsync && fsync(fd) != 0) err = errno;
  if (close(fd) != 0 && err == 0 && errno != EINTR) err = errno;
  return err;
}

// One object (see the header); true when openat2 itself is missing or refused (ENOSYS, EPERM).
bool write_one(int root_fd, int temp_dir_fd, KvpObjectWrite& obj, int do_fsync, int make_leaves) {
  obj.err = 0;
  obj.temp_removed = 0;
  int dfd = open_leaf(root_fd, obj.leaf);
  if (dfd == -ENOENT && make_leaves) {
    const int made = make_leaf(root_fd, obj.leaf);
    dfd = made < 0 ? made : open_leaf(root_fd, obj.leaf);
  }
  if (dfd < 0) {
    obj.err = -dfd;
    return obj.err == ENOSYS || obj.err == EPERM;
  }
  const int tdir = temp_dir_fd < 0 ? dfd : temp_dir_fd;
  int fd;
  do {
    fd = openat(tdir, obj.temp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    obj.err = errno;
  } else {
    int err = fill_temp(fd, obj, do_fsync);
    if (err == 0 && renameat(tdir, obj.temp, dfd, obj.final_name) != 0) err = errno;
    if (err != 0) {
      obj.err = err;
      obj.temp_removed = unlinkat(tdir, obj.temp, 0) == 0 ? 1 : 0;
    }
  }
  close(dfd);
  return false;
}

}  // namespace

void kvp_write_objects(int root_fd, int temp_dir_fd, KvpObjectWrite* objs, int64_t n, int do_fsync, int make_leaves) {
  int missing = 0;  // ENOSYS/EPERM from openat2: the rest of the batch is the caller's
  for (int64_t i = 0; i < n; ++i) {
    if (missing != 0) {
      objs[i].err = missing;
      objs[i].temp_removed = 0;
      continue;
    }
    if (write_one(root_fd, temp_dir_fd, objs[i], do_fsync, make_leaves)) missing = objs[i].err;
  }
}

void kvp_remove_objects(int root_fd, KvpObjectRemove* objs, int64_t n, KvpFolderRemove* folders, int64_t nfolders) {
  int missing = 0;  // ENOSYS/EPERM from openat2: the rest is the caller's
  int dfd = -1;
  const char* open_leaf_name = nullptr;
  for (int64_t i = 0; i < n; ++i) {
    KvpObjectRemove& obj = objs[i];
    if (missing != 0) {
      obj.err = missing;
      continue;
    }
    if (dfd < 0 || open_leaf_name == nullptr || strcmp(open_leaf_name, obj.leaf) != 0) {
      if (dfd >= 0) close(dfd);
      dfd = open_leaf(root_fd, obj.leaf);
      open_leaf_name = obj.leaf;
      if (dfd < 0) {
        obj.err = -dfd;
        if (obj.err == ENOSYS || obj.err == EPERM) missing = obj.err;
        dfd = -1;
        open_leaf_name = nullptr;
        continue;
      }
    }
    obj.err = unlinkat(dfd, obj.name, 0) == 0 ? 0 : errno;
  }
  if (dfd >= 0) close(dfd);
  bool skip_chain = false;
  for (int64_t i = 0; i < nfolders; ++i) {
    KvpFolderRemove& folder = folders[i];
    folder.removed = 0;
    if (folder.chain_start) skip_chain = missing != 0;
    if (skip_chain) continue;
    int pfd = root_fd;
    if (folder.parent[0] != '\0') {
      pfd = open_leaf(root_fd, folder.parent);
      if (pfd < 0) {
        skip_chain = true;
        continue;
      }
    }
    folder.removed = unlinkat(pfd, folder.name, AT_REMOVEDIR) == 0 ? 1 : 0;
    if (pfd != root_fd) close(pfd);
    if (!folder.removed) skip_chain = true;
  }
}

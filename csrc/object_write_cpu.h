// Batch writes and removals of disk-tier object files beneath a store root (torch-free C).
//
// One object: open its leaf folder beneath the root with openat2
// (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS: never follow a
// symlink, never leave the root), create its temporary file (O_CREAT | O_EXCL |
// O_NOFOLLOW, 0600) in the leaf or in `temp_dir_fd`, write every part (writev,
// partial writes continued), optionally fsync, close, then renameat to the final
// name in the leaf. On a failure after the temporary was created it is unlinked
// (created O_EXCL by this call: provably ours). With make_leaves, a leaf that is not
// there is made first, folder by folder (0700, mkdirat then openat2 as above, so no
// symlink on the way is followed; ext4's FS_TOPDIR_FL on each folder made but the
// last). Rules of kvpack.tiers.disk.fs.
#pragma once

#include <stdint.h>
#include <sys/uio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const char* leaf;        // relative path of validated names, NUL-terminated
  const char* temp;        // the temporary file's name (one component)
  const char* final_name;  // the object's file name in the leaf (one component)
  const struct iovec* parts;
  int nparts;
  int err;           // out: 0 written, else the errno of the first failing step
  int temp_removed;  // out: 1 when the temporary was created and then unlinked
} KvpObjectWrite;

// Writes objs[0..n) in order; each object's outcome goes to its err/temp_removed.
// temp_dir_fd < 0: temporaries in the object's leaf. An openat2 the kernel does
// not have (ENOSYS) or refuses (EPERM, seccomp) is that object's err, and every
// later object of the batch gets the same err without a try (the caller writes
// them another way). Thread safe; no global state; never throws.
void kvp_write_objects(int root_fd, int temp_dir_fd, KvpObjectWrite* objs, int64_t n, int do_fsync, int make_leaves);

typedef struct {
  const char* leaf;  // relative path of validated names, NUL-terminated
  const char* name;  // the object's file name in the leaf (one component)
  int err;           // out: 0 removed, else the errno of the first failing step
} KvpObjectRemove;

typedef struct {
  const char* parent;  // relative path of the folder holding it ("" : the root itself)
  const char* name;    // the folder to remove when empty (one component)
  int chain_start;     // 1: first (innermost) folder of a chain
  int removed;         // out: 1 when removed
} KvpFolderRemove;

// Removes objs[0..n) in order, each leaf opened beneath the root (as for a write; a
// leaf shared by consecutive objects is opened once), then tries each folder with
// rmdir: a chain (innermost first) stops at its first folder that is not removed
// (not empty, gone, refused), so an outer folder is tried only once the inner one
// went. ENOSYS/EPERM from openat2 is that object's err, and every later object
// gets the same err untried (the caller removes them another way); no folder is
// tried then. Thread safe; no global state; never throws.
void kvp_remove_objects(int root_fd, KvpObjectRemove* objs, int64_t n, KvpFolderRemove* folders, int64_t nfolders);

#ifdef __cplusplus
}  // extern "C"
#endif

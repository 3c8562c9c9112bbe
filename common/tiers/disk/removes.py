"""Object-file removals of the disk tier, a batch at a time: native when the extension is loaded, else Python.

`remove_batch` unlinks each key's file, then removes the folders the batch emptied: per distinct
leaf of the batch's groups, its chain (the leaf, its fingerprint folder, its tenant folder), innermost
first and an outer folder only once the inner one went; ``rmdir`` never removes a folder with
anything in it. Every folder is opened beneath the root without following a symlink
(`kvpack.tiers.disk.fs`'s rules), so a leaf replaced by a symlink removes nothing through it.

- The native remover (`ObjectRemover`: ``remove_objects`` of the extension,
  `kvpack.ops.object_remover`) removes the whole batch with the GIL released once. From Python
  each file costs three system calls (open its folder, unlink, close) and each folder chain about
  six, every one giving the GIL up; in a process whose other threads run Python (an engine's
  scheduler) each re-take can wait up to the 5 ms switch interval, so a put that evicts 64
  one-object groups spent about 380 of them on removals.
- A key whose openat2 the kernel lacks or refuses (ENOSYS, EPERM: seccomp) is removed by the
  Python path (fs's walk), as are the rest of its batch and every folder chain.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ...identity.keys import GroupKey, StoreKey
from ...ops.natives import ObjectRemover
from . import fs
from .paths import file_name, leaf_of


def folder_chain(group: GroupKey) -> list[tuple[str, str]]:
    """(parent, folder) of `group`'s leaf, fingerprint and tenant folders, innermost first."""
    tenant, fp = group.tenant, group.fingerprint
    return [(f"{tenant}/{fp}", group.chunk[:2]), (tenant, fp), ("", tenant)]


def remove_batch(
    root_fd: int, keys: Sequence[StoreKey], groups: Sequence[GroupKey], native: ObjectRemover | None
) -> list[bool]:
    """Unlink every key's file, then the folders of `groups`' leaves that emptied (see the module
    docstring); per key, was its file removed? Never raises for a file-system failure."""
    order = sorted(range(len(keys)), key=lambda i: leaf_of(keys[i]))  # one folder open per leaf
    leaves = {leaf_of(g): g for g in groups}
    removed = [False] * len(keys)
    todo = order
    if native is not None and fs.openat2_in_use() and (keys or leaves):
        files = [(os.fsencode(leaf_of(keys[i])), os.fsencode(file_name(keys[i]))) for i in order]
        folders = [
            (os.fsencode(parent), os.fsencode(name), at == 0)
            for group in leaves.values()
            for at, (parent, name) in enumerate(folder_chain(group))
        ]
        errs, _ = native(root_fd, files, folders)
        todo = [i for i, err in zip(order, errs) if err in fs.OPENAT2_MISSING]
        for i, err in zip(order, errs):
            removed[i] = err == 0
        if not todo:
            return removed
    for i in todo:
        removed[i] = _unlink_python(root_fd, keys[i])
    for group in leaves.values():
        _remove_folders_python(root_fd, group)
    return removed


def _unlink_python(root_fd: int, key: StoreKey) -> bool:
    """One key's file removed from Python (each system call gives the GIL up and takes it back)."""
    try:
        dfd = fs.open_dir(root_fd, leaf_of(key))
    except OSError:
        return False
    try:
        os.unlink(file_name(key), dir_fd=dfd)
        return True
    except OSError:
        return False
    finally:
        os.close(dfd)


def _remove_folders_python(root_fd: int, group: GroupKey) -> None:
    """`folder_chain(group)` removed from Python while empty, innermost first, stopping at the first that stays."""
    for parent, name in folder_chain(group):
        try:
            pfd = fs.open_dir(root_fd, parent) if parent else root_fd
        except OSError:
            return
        try:
            os.rmdir(name, dir_fd=pfd)
        except OSError:
            return
        finally:
            if parent:
                os.close(pfd)

"""Where an object lives in the store folder, and the folders that go when they empty.

Layout: ``<root>/<tenant>/<fingerprint>/<chunk[:2]>/<chunk>.<member>.kvp``. Every component
comes from a validated `StoreKey` (no ``/``, no ``..``), so no key names a path outside the root.
"""

from __future__ import annotations

import os

from ...keys import StoreKey
from . import fs
from .files import SUFFIX


def leaf_of(key: StoreKey) -> str:
    """The folder of `key`'s file, relative to the root."""
    return f"{key.tenant}/{key.fingerprint}/{key.chunk[:2]}"


def file_name(key: StoreKey) -> str:
    """The name of `key`'s file in its folder."""
    return f"{key.chunk}.{key.member}{SUFFIX}"


def rel_file(key: StoreKey) -> str:
    """`key`'s file, relative to the root (``leaf_of(key) + "/" + file_name(key)``)."""
    return f"{key.tenant}/{key.fingerprint}/{key.chunk[:2]}/{key.chunk}.{key.member}{SUFFIX}"


def remove_empty_folders(root_fd: int, key: StoreKey) -> None:
    """``rmdir`` the key's leaf, fingerprint and tenant folders, innermost first, while empty.

    `rmdir` never removes a folder with anything in it, so nothing but empty folders can go."""
    chain = ((f"{key.tenant}/{key.fingerprint}", key.chunk[:2]), (key.tenant, key.fingerprint))
    for parent, child in chain:
        try:
            pfd = fs.open_dir(root_fd, parent)
        except OSError:
            return
        try:
            os.rmdir(child, dir_fd=pfd)
        except OSError:
            return
        finally:
            os.close(pfd)
    try:
        os.rmdir(key.tenant, dir_fd=root_fd)
    except OSError:
        pass

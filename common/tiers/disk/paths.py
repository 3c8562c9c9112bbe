"""Where an object lives in the store folder (the folders that go when they empty: `removes`).

Layout: ``<root>/<tenant>/<fingerprint>/<chunk[:2]>/<chunk>.<member>.kvp``. Every component
comes from a validated `StoreKey` (no ``/``, no ``..``), so no key names a path outside the root.
"""

from __future__ import annotations

from ...identity.keys import GroupKey, StoreKey
from .files import SUFFIX


def leaf_of(key: StoreKey | GroupKey) -> str:
    """The folder of `key`'s file (every member of a group shares it), relative to the root."""
    return f"{key.tenant}/{key.fingerprint}/{key.chunk[:2]}"


def file_name(key: StoreKey) -> str:
    """The name of `key`'s file in its folder."""
    return f"{key.chunk}.{key.member}{SUFFIX}"


def rel_file(key: StoreKey) -> str:
    """`key`'s file, relative to the root (``leaf_of(key) + "/" + file_name(key)``)."""
    return f"{key.tenant}/{key.fingerprint}/{key.chunk[:2]}/{key.chunk}.{key.member}{SUFFIX}"

"""How the disk index names a group and an object: row ids and packed names, and the `Victim`
a removal hands back (`kvpack.tiers.disk.catalog` holds the tables)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ...identity.keys import GroupKey


def pack_name(text: str) -> str | bytes:
    """A lowercase hex name as its bytes (half the index space), anything else (``-tail`` chunks) as text."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return text
    return raw if raw.hex() == text else text


def unpack_name(value: str | bytes) -> str:
    """The name `pack_name` packed."""
    return value.hex() if isinstance(value, bytes) else value


def group_id(group: GroupKey) -> bytes:
    """16-byte id of a group (the primary key of its row)."""
    return hashlib.blake2b(f"{group.tenant}/{group.fingerprint}/{group.chunk}".encode(), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class Victim:
    """A group removed from the index: its files (one per member) are to be unlinked."""

    group: GroupKey
    members: tuple[str, ...]
    nbytes: int

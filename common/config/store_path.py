"""The static rules of a configured store path (no file-system access): what the config checks
at parse time and the disk folder's opening (`kvpack.tiers.disk.fs`) applies again."""

from __future__ import annotations

import os

MAX_PATH_BYTES = 4095
MAX_NAME_BYTES = 255


def check_store_path_text(path: str) -> None:
    """Static checks of a configured store path (no file-system access); ValueError."""
    if "\x00" in path:
        raise ValueError("must not contain a NUL byte")
    raw = os.fsencode(path)
    if len(raw) > MAX_PATH_BYTES:
        raise ValueError(f"is {len(raw)} bytes long; the limit is {MAX_PATH_BYTES}")
    long = next((p for p in raw.split(b"/") if len(p) > MAX_NAME_BYTES), None)
    if long is not None:
        raise ValueError(f"has a component of {len(long)} bytes; the limit is {MAX_NAME_BYTES}")

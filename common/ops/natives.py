"""The signatures of the extension's batch functions, as the tiers call them.

Each is one native call for a whole batch that gives the GIL up once; `kvpack.ops._build`
hands them out once the extension is loaded (``None`` before), and the tiers that call them
(`kvpack.tiers.disk`, `kvpack.tiers.parallel`) fall back to Python without them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Buffer = bytes | memoryview

Checksummer = Callable[[Sequence[Sequence[Any]]], list[int]]
"""Native ``checksums(payloads)``: xxh3_64 of each payload's parts (buffers: memoryviews, arrays,
bytes) in order, one int per payload."""

ObjectReader = Callable[[int, Sequence[tuple[bytes, Sequence[memoryview]]], int], list[tuple[int, int, int, int]]]
"""Native ``read_objects(root_fd, [(path, parts)], digest_from)``: one (errno, size, bytes read or -1,
xxh3_64 of ``parts[digest_from:]`` of a whole read, else 0) per object; ``digest_from`` -1 hashes nothing."""

NativeJob = tuple[bytes, bytes, bytes, Sequence[Buffer]]
"""(leaf, temporary name, final name, buffers): a `WriteJob` as the native writer takes it."""
WriteResult = tuple[int, int]
"""(errno, temporaries removed) of one object: errno 0 when written; a removed temporary is
this write's own (``own_temp`` in `DiskCounters.removed`)."""
ObjectWriter = Callable[[int, int, Sequence[NativeJob], bool, bool], list[WriteResult]]
"""Native ``write_objects(root_fd, temp_dir_fd, jobs, fsync, make_leaves)``; `temp_dir_fd` < 0: temporaries
in the leaf; `make_leaves`: a leaf folder that is not there is made first (`fs.make_dirs`' rule)."""

NativeFile = tuple[bytes, bytes]
"""(leaf, file name) of one object file, as the native remover takes it."""
NativeFolder = tuple[bytes, bytes, bool]
"""(parent folder, folder name, first of its chain); parent ``b""`` is the root itself."""
ObjectRemover = Callable[[int, Sequence[NativeFile], Sequence[NativeFolder]], tuple[list[int], list[int]]]
"""Native ``remove_objects(root_fd, files, folders)``: one errno per file (0: removed), one 0/1 per folder."""

CopyPair = tuple[np.ndarray, np.ndarray]
"""(destination, source): 1-D uint8 arrays of equal length."""
RegionCopier = Callable[[Sequence[CopyPair], bool], None]
"""Native ``copy_regions(pairs, streaming)`` (`kvpack.ops.region_copier`): copies every
pair with the GIL released; `streaming` writes long regions with non-temporal stores."""


_extension: Any = None
"""The loaded extension module (`kvpack.ops._build.load_extension`: once per process), else None."""


def loaded(module: Any) -> None:
    """Hand out `module`'s batch functions from now on (called once, by the extension's loader)."""
    global _extension
    _extension = module


def _function(name: str) -> Any:
    """The loaded extension's function `name`, or None before it is loaded. Never waits."""
    module = _extension
    return None if module is None else getattr(module, name)


def region_copier() -> RegionCopier | None:
    """The native region copy if the extension is loaded now, else None. Never waits."""
    return _function("copy_regions")


def object_writer() -> ObjectWriter | None:
    """The native batch object write (`kvpack.tiers.disk.writes`) if the extension is loaded now, else None.

    Never waits."""
    return _function("write_objects")


def checksummer() -> Checksummer | None:
    """The native batch checksum (`kvpack.identity.objects.payload_checksums`: xxh3_64 of each payload's parts,
    the GIL released once for the batch) if the extension is loaded now, else None. Never waits."""
    return _function("checksums")


def object_reader() -> ObjectReader | None:
    """The native batch object read (`kvpack.tiers.disk.reads`) if the extension is loaded now, else None.

    Never waits."""
    return _function("read_objects")


def object_remover() -> ObjectRemover | None:
    """The native batch object removal (`kvpack.tiers.disk.removes`) if the extension is loaded now, else None.

    Never waits."""
    return _function("remove_objects")

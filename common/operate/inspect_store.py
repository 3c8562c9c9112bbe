"""Read-only summary of a disk store: what it holds per tenant, layout and member.

Used by `kvpack inspect DIR`. It never modifies the folder (unlike opening a
`DiskTier`, which sweeps stale temporaries and writes its index) and reads the
object files, not the shared index (``.kvpack-store.index``, whose presence it
reports), so it shows what a rebuilt index would hold. It never trusts a file: every
header is decoded and self-checked; files that fail are counted as unreadable,
and so are symlinks, FIFOs and anything else that is not a regular file inside
the store (opened non-blocking: nothing planted there can hang the command).
"""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..identity.objects import HEADER_PREFIX_BYTES, ObjectRejected, decode_header, header_length
from ..tiers.disk import SUFFIX
from ..tiers.disk.catalog import INDEX_NAME


@dataclass
class TenantSummary:
    tenant: str
    fingerprints: set[str] = field(default_factory=set)
    groups: set[tuple[str, str]] = field(default_factory=set)
    objects: int = 0
    payload_bytes: int = 0
    tails: int = 0
    members: dict[str, int] = field(default_factory=lambda: defaultdict(int))


@dataclass
class StoreSummary:
    root: Path
    tenants: dict[str, TenantSummary] = field(default_factory=dict)
    unreadable: list[Path] = field(default_factory=list)
    indexed: bool = False
    """The folder has the disk tier's shared index file (a store of an older kvpack has not)."""

    def to_dict(self) -> dict[str, object]:
        return {
            "root": str(self.root),
            "unreadable": len(self.unreadable),
            "index": self.indexed,
            "tenants": {
                t.tenant: {
                    "layouts": len(t.fingerprints),
                    "groups": len(t.groups),
                    "objects": t.objects,
                    "payload_bytes": t.payload_bytes,
                    "tails": t.tails,
                    "members": dict(t.members),
                }
                for t in self.tenants.values()
            },
        }


def _read_header_prefix(path: Path, inside: Path) -> bytes:
    """The header bytes of the regular file `path`, which must lie inside `inside`
    (no symlinked folder or file followed out of the store); OSError for anything else.
    ``O_NONBLOCK`` so that a FIFO planted at an object path never blocks the command."""
    if not path.resolve().is_relative_to(inside):
        raise OSError(f"{path} resolves outside the store")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            prefix = f.read(HEADER_PREFIX_BYTES)
            return prefix + f.read(header_length(prefix) - len(prefix))
    finally:
        if fd >= 0:
            os.close(fd)


def summarize(root: Path) -> StoreSummary:
    summary = StoreSummary(root, indexed=(root / INDEX_NAME).is_file())
    inside = root.resolve()
    for path in sorted(root.glob(f"*/*/*/*{SUFFIX}")):
        try:
            header = decode_header(_read_header_prefix(path, inside))
        except (OSError, ObjectRejected):
            summary.unreadable.append(path)
            continue
        tenant_dir, fp_dir = path.parent.parent.parent.name, path.parent.parent.name
        if header.tenant != tenant_dir:
            summary.unreadable.append(path)  # a file placed under another tenant's folder
            continue
        t = summary.tenants.setdefault(header.tenant, TenantSummary(header.tenant))
        t.fingerprints.add(fp_dir)
        t.groups.add((fp_dir, header.chunk))
        t.objects += 1
        t.payload_bytes += header.payload_len
        t.tails += header.chunk.endswith("-tail")
        t.members[header.member] += 1
    return summary


def format_summary(summary: StoreSummary) -> str:
    index = "shared index present" if summary.indexed else "no index yet (built when the disk tier opens it)"
    lines = [f"kvpack store at {summary.root} ({index})"]
    if not summary.tenants:
        lines.append("  (empty)")
    for t in sorted(summary.tenants.values(), key=lambda t: t.tenant):
        members = ", ".join(f"{m}={n}" for m, n in sorted(t.members.items()))
        lines.append(
            f"  tenant {t.tenant}: {len(t.groups)} groups, {t.objects} objects ({members}), "
            f"{t.payload_bytes / 2**20:.1f} MiB, {t.tails} tails, {len(t.fingerprints)} layouts"
        )
    if summary.unreadable:
        lines.append(
            f"  {len(summary.unreadable)} unreadable files (would be refused on load), e.g. {summary.unreadable[0]}"
        )
    return "\n".join(lines)

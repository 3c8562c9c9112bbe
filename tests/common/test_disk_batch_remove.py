"""The disk tier removes a batch's object files natively, the GIL released once.

Every test runs with both removers (`kvpack.tiers.disk.removes`): the extension's
``remove_objects`` (`kvpack.ops.object_remover`) and the Python fallback a process
without a compiler uses. An evicting put, a removal and a dead writer's reclaim must
leave the same files and folders with either: the victims' files gone and counted,
each emptied folder (leaf, fingerprint, tenant) gone, a folder that still holds
something kept, nothing removed through a symlinked folder. The native one makes no
Python-level ``unlink`` or ``rmdir``.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from helpers import make_item

from fixtures.os_calls import count_os_calls
from kvpack.ops import load_extension, object_remover
from kvpack.ops.natives import NativeFile, NativeFolder, ObjectRemover
from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.disk import DiskTier

REMOVERS = ("native", "python")
PAGE = 1024


def _remover(kind: str) -> Callable[[], ObjectRemover | None] | None:
    if kind == "python":
        return None
    status = load_extension()
    if not status.available:
        pytest.skip(f"extension unavailable: {status.reason}")
    assert object_remover() is not None
    return object_remover


def _chunk(leaf: int, i: int) -> str:
    """A chunk id in leaf folder ``leaf`` (its first two hex digits), distinct per `i`."""
    return f"{leaf:02x}{i:062x}"


def _item(tenant: str, leaf: int, i: int, member: str = "kv") -> PutItem:
    return make_item(tenant, _chunk(leaf, i), member=member, nbytes=PAGE, seed=leaf * 1000 + i)[0]


def _tree(root: Path) -> tuple[set[str], set[str]]:
    """(files, folders) under `root`, relative, the store's own marker and index left out."""
    files, folders = set(), set()
    for p in root.rglob("*"):
        rel = str(p.relative_to(root))
        if rel.startswith(".kvpack"):
            continue
        (folders if p.is_dir() and not p.is_symlink() else files).add(rel)
    return files, folders


@pytest.fixture
def counted_removals(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Python-level ``os.unlink`` and ``os.rmdir`` calls of the test (counted, then made)."""
    return count_os_calls(monkeypatch, ("unlink", "rmdir"))


def _evicting_put(root: Path, kind: str) -> tuple[DiskTier, list[PutItem], list[PutItem]]:
    """A tier full of `old` (a group with two members in leaf 0x10, one group alone in leaf 0x20, two
    groups sharing leaf 0x30, one group of another tenant) then a put of as many bytes that evicts them all
    but the other tenant's, which shares its fingerprint folder with nobody."""
    old = [
        _item("t", 0x10, 1),
        _item("t", 0x10, 1, member="draft"),
        _item("t", 0x20, 2),
        _item("t", 0x30, 3),
        _item("t", 0x30, 4),
    ]
    probe = DiskTier(root / "probe", 1 << 30)
    probe.put_from(old[:1])
    charge = probe.usage().used_bytes
    probe.close()
    tier = DiskTier(root / "store", 6 * charge, object_remover=_remover(kind))
    assert tier.put_from(old) == [TierStatus.OK] * len(old)
    keep = [_item("u", 0x40, 5)]
    assert tier.put_from(keep) == [TierStatus.OK]
    new = [_item("t", 0x50, 6 + i) for i in range(5)]
    assert tier.put_from(new) == [TierStatus.OK] * len(new)
    return tier, old, new


@pytest.mark.parametrize("kind", REMOVERS)
def test_an_evicting_put_removes_the_victims_files_and_their_emptied_folders(tmp_path: Path, kind: str) -> None:
    tier, old, new = _evicting_put(tmp_path, kind)
    try:
        files, folders = _tree(tier.root)
        assert files == {str(tier.path_of(it.key).relative_to(tier.root)) for it in new + [_item("u", 0x40, 5)]}
        fp = old[0].key.fingerprint
        # the evicted leaves went; the fingerprint and tenant folders of "t" stay (its new leaf is in them)
        assert folders == {"t", f"t/{fp}", f"t/{fp}/50", "u", f"u/{fp}", f"u/{fp}/40"}
        assert tier.counters.removed.get("evicted") == len(old)
    finally:
        tier.close()


@pytest.mark.parametrize("kind", REMOVERS)
def test_removing_every_group_of_a_tenant_removes_its_folders(tmp_path: Path, kind: str) -> None:
    tier = DiskTier(tmp_path / "store", 1 << 30, object_remover=_remover(kind))
    try:
        items = [_item("t", 0x10, 1), _item("t", 0x10, 2), _item("t", 0x20, 3), _item("u", 0x10, 4)]
        assert tier.put_from(items) == [TierStatus.OK] * len(items)
        assert tier.remove_groups([it.key.group for it in items[:2]]) == 2
        fp = items[0].key.fingerprint
        assert _tree(tier.root)[1] == {"t", f"t/{fp}", f"t/{fp}/20", "u", f"u/{fp}", f"u/{fp}/10"}
        assert tier.remove_groups([items[2].key.group]) == 1
        assert _tree(tier.root) == (
            {str(tier.path_of(items[3].key).relative_to(tier.root))},
            {"u", f"u/{fp}", f"u/{fp}/10"},
        )
    finally:
        tier.close()


@pytest.mark.parametrize("kind", REMOVERS)
def test_nothing_is_removed_through_a_symlinked_leaf(tmp_path: Path, kind: str) -> None:
    """A leaf replaced by a symlink after its objects were stored: their removal removes nothing
    where the link points, and the link itself stays (it is not kvpack's to remove)."""
    tier = DiskTier(tmp_path / "store", 1 << 30, object_remover=_remover(kind))
    outside = tmp_path / "outside"
    try:
        item = _item("t", 0x10, 1)
        assert tier.put_from([item]) == [TierStatus.OK]
        leaf = tier.path_of(item.key).parent
        shutil.move(leaf, outside)  # the object file now lies outside, behind a symlink at the leaf's place
        leaf.symlink_to(outside, target_is_directory=True)
        assert tier.remove_groups([item.key.group]) == 1
        assert (outside / tier.path_of(item.key).name).is_file()
        assert leaf.is_symlink()
        assert tier.counters.removed.get("removed") is None
    finally:
        tier.close()


def test_the_native_remover_makes_no_python_file_calls(tmp_path: Path, counted_removals: dict[str, int]) -> None:
    tier, old, _ = _evicting_put(tmp_path / "native", "native")
    tier.close()
    assert counted_removals == {"unlink": 0, "rmdir": 0}
    tier, old, _ = _evicting_put(tmp_path / "python", "python")  # the check sees the Python remover's calls
    tier.close()
    assert counted_removals["unlink"] == len(old) and counted_removals["rmdir"] >= 3


def test_keys_whose_openat2_is_refused_are_removed_from_python(
    tmp_path: Path, counted_removals: dict[str, int]
) -> None:
    provider = _remover("native")
    native = provider() if provider is not None else None
    assert native is not None

    def refusing(
        root_fd: int, files: Sequence[NativeFile], folders: Sequence[NativeFolder]
    ) -> tuple[list[int], list[int]]:
        """The native remover as under a seccomp filter refusing openat2 from the second file on."""
        errs, _ = native(root_fd, files[:1], [])
        return [*errs, *[errno.EPERM] * (len(files) - 1)], [0] * len(folders)

    tier = DiskTier(tmp_path / "store", 1 << 30, object_remover=lambda: refusing)
    try:
        items = [_item("t", 0x10, 1), _item("t", 0x20, 2), _item("t", 0x30, 3)]
        assert tier.put_from(items) == [TierStatus.OK] * len(items)
        assert tier.remove_groups([it.key.group for it in items]) == 3
        assert counted_removals["unlink"] == 2  # all but the first removed again from Python
        assert _tree(tier.root) == (set(), set())  # and every emptied folder
        assert tier.counters.removed.get("removed") == 3
    finally:
        tier.close()

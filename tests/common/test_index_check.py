"""``kvpack config`` checks the disk index's files as start-up opens them, changing nothing.

Each folder below is a marked store whose index files start-up (`DiskTier`, through
`catalog.open_catalog`) refuses; `check_index_files` (run by `check_tiers`, so by
``kvpack config``) refuses it with the same one line and leaves every file as it was.
A store start-up adopts (a closed one, an index of an older schema) passes the check.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpack import ConfigError, KVPackConfig
from kvpack.cli import main
from kvpack.config.schema import DiskTierConfig, MemoryTierConfig
from kvpack.tiers.checks import check_tiers
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.disk import fs as disk_fs
from kvpack.tiers.index.catalog import INDEX_NAME
from kvpack.tiers.index.check import check_index_files

WAIT_S = 0.2
"""The lock wait of both sides in the held-lock case (start-up's default is 10 s)."""


def _snapshot(root: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every entry under `root`: mode, size, mtime (ns) and, for a regular file, its bytes' digest."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else ""
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def _marked(root: Path) -> Path:
    real, fd = disk_fs.open_store_root(str(root))
    os.close(fd)
    return Path(real)


def _garbage(root: Path) -> None:
    (root / INDEX_NAME).write_bytes(b"these are not the bytes of a database" * 100)


def _truncated(root: Path) -> None:
    """A real index cut after its header: SQLite says the image is malformed."""
    DiskTier(root, 1 << 20).close()
    data = (root / INDEX_NAME).read_bytes()
    (root / INDEX_NAME).write_bytes(data[:100] + b"\xff" * (len(data) - 100))


def _foreign_meta(root: Path) -> None:
    db = sqlite3.connect(root / INDEX_NAME)
    db.execute("CREATE TABLE meta(x INTEGER)")
    db.commit()
    db.close()


def _index_symlink(root: Path) -> None:
    (root.parent / "elsewhere.db").write_bytes(b"")
    (root / INDEX_NAME).symlink_to(root.parent / "elsewhere.db")


def _index_folder(root: Path) -> None:
    (root / INDEX_NAME).mkdir()


def _lock_fifo(root: Path) -> None:
    os.mkfifo(root / (INDEX_NAME + ".lock"))


REFUSED: dict[str, tuple[Callable[[Path], None], str]] = {
    "not-sqlite": (_garbage, "file is not a database"),
    "corrupt": (_truncated, "malformed"),
    "foreign-meta-table": (_foreign_meta, "no such column"),
    "index-a-symlink": (_index_symlink, "is not a regular file"),
    "index-a-folder": (_index_folder, "is not a regular file"),
    "lock-a-fifo": (_lock_fifo, "is not a regular file"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_check_refuses_what_start_up_refuses_and_changes_nothing(tmp_path: Path, case: str) -> None:
    prepare, words = REFUSED[case]
    root = _marked(tmp_path / "store")
    prepare(root)
    before = _snapshot(tmp_path)
    with pytest.raises(ConfigError) as checked:
        check_index_files(str(root))
    assert _snapshot(tmp_path) == before
    text = str(checked.value)
    assert checked.value.field == "disk.path" and words in text and "\n" not in text, text
    with pytest.raises(ConfigError) as started:
        DiskTier(root, 1 << 20)
    assert str(started.value) == text


def test_an_index_lock_held_past_the_wait_is_refused_alike(tmp_path: Path) -> None:
    root = _marked(tmp_path / "store")
    DiskTier(root, 1 << 20).close()
    holder = os.open(root / (INDEX_NAME + ".lock"), os.O_RDWR)  # another open file: flock conflicts
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        before = _snapshot(tmp_path)
        with pytest.raises(ConfigError) as checked:
            check_index_files(str(root), busy_timeout_s=WAIT_S)
        assert _snapshot(tmp_path) == before
        with pytest.raises(ConfigError) as started:
            DiskTier(root, 1 << 20, busy_timeout_s=WAIT_S)
        assert str(started.value) == str(checked.value)
        assert "held by another process" in str(checked.value)
    finally:
        os.close(holder)
    check_index_files(str(root), busy_timeout_s=WAIT_S)  # free again: accepted


def _closed_store(root: Path) -> None:
    DiskTier(root, 1 << 20).close()


def _older_schema(root: Path) -> None:
    DiskTier(root, 1 << 20).close()
    db = sqlite3.connect(root / INDEX_NAME)
    db.execute("UPDATE meta SET v='1' WHERE k='schema'")
    db.commit()
    db.close()


def _empty_index(root: Path) -> None:
    (root / INDEX_NAME).write_bytes(b"")


@pytest.mark.parametrize("prepare", [_closed_store, _older_schema, _empty_index], ids=["closed", "older", "empty"])
def test_the_check_accepts_what_start_up_adopts_and_changes_nothing(
    tmp_path: Path, prepare: Callable[[Path], None]
) -> None:
    root = _marked(tmp_path / "store")
    prepare(root)
    before = _snapshot(tmp_path)
    check_tiers(KVPackConfig(memory=MemoryTierConfig(enabled=False), disk=DiskTierConfig(path=str(root))))
    assert _snapshot(tmp_path) == before
    DiskTier(root, 1 << 20).close()


def test_the_check_reads_an_index_in_use(tmp_path: Path) -> None:
    root = _marked(tmp_path / "store")
    tier = DiskTier(root, 1 << 20)  # open: its -wal and -shm are there
    try:
        check_index_files(str(root))
    finally:
        tier.close()


def test_kvpack_config_names_a_bad_index_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _marked(tmp_path / "store")
    _garbage(root)
    file = tmp_path / "c.json"
    file.write_text(json.dumps({"disk": {"path": str(root)}}))
    before = _snapshot(tmp_path)
    assert main(["config", str(file)]) == 2
    err = capsys.readouterr()
    assert err.out == "" and len(err.err.splitlines()) == 1 and "Traceback" not in err.err
    assert "c.json" in err.err and "disk.path" in err.err and "file is not a database" in err.err
    assert _snapshot(tmp_path) == before

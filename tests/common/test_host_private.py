"""A host store (and a disk store in a shared folder) belongs to its user: another local user,
played for real by a forked child that drops to another uid (the tests run as root), tries to
take it over the ways a hostile local user would, and every try gets one clear line, or the
per-process tier with one warning (``memory.mode: auto``), never the other user's folder:

- the store's folder made first by the other user, mode 0777 or 0700;
- a symlink at the store's name to a folder of the other user's;
- an owner lock another user holds (in its own folder at the name, or planted in ours);
- this user's own folder or arena left open to others (group/other mode bits);
- ``kvpack host`` lists, and ``kvpack host drop`` drops, only this user's stores;
- a disk store in ``/tmp`` made first by another user.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fixtures.builders import chunk_id, make_item
from kvpack import ConfigError, KVPackConfig, MemoryMode
from kvpack.tiers.base import TierStatus
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.host import HostTier, drop, host_root, host_stores, resolve_memory
from kvpack.tiers.host.owners import OWNERS, live_users
from kvpack.tiers.host.pages import ARENA

OTHER = 65534
"""The hostile local user's uid (and gid): ``nobody``."""
CAPACITY = 256 << 10

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="playing another local user needs root")


@pytest.fixture
def name() -> Iterator[str]:
    n = f"private-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    for path in (host_root(n), f"/dev/shm/hostile-{n}"):
        if os.path.islink(path):
            os.unlink(path)
        shutil.rmtree(path, ignore_errors=True)


def as_other(act: Callable[[], None]) -> None:
    """Run `act` in a forked child as uid/gid `OTHER` (no supplementary groups); AssertionError if it fails."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            os.umask(0)
            act()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's step failed"


def host_config(name: str, mode: str) -> KVPackConfig:
    return KVPackConfig.from_dict(
        {"memory": {"mode": mode, "host_name": name, "capacity": CAPACITY}, "disk": {"enabled": False}}
    )


def refused(name: str, what: str) -> str:
    """The one line `memory.mode: host` fails with; nothing of the store is opened, and that line names `what`."""
    with pytest.raises(ConfigError) as info:
        resolve_memory(host_config(name, "host"))
    with pytest.raises(ConfigError) as opened:  # the store's own open (a squat after the check) says the same
        HostTier(name, CAPACITY)
    for exc in (info.value, opened.value):
        text = str(exc)
        assert "\n" not in text and "memory.mode" in text and host_root(name) in text and what in text, text
    return str(info.value)


def falls_back(name: str, caplog: pytest.LogCaptureFixture, processes: int = 2) -> None:
    """``memory.mode: auto`` takes the per-process tier with one warning naming the folder."""
    with caplog.at_level(logging.WARNING, logger="kvpack"):
        caplog.clear()
        got = resolve_memory(host_config(name, "auto"), engine_processes=processes)
    assert got.memory.mode is MemoryMode.PROCESS
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and host_root(name) in warned[0], warned


@pytest.mark.parametrize("mode", [0o777, 0o700])
def test_a_folder_another_user_made_at_the_stores_name_is_refused(
    name: str, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    root = host_root(name)
    as_other(lambda: (os.mkdir(root), os.chmod(root, mode)))
    refused(name, f"owned by uid {OTHER}")
    falls_back(name, caplog)
    assert os.listdir(root) == []  # nothing of ours went in


def test_a_symlink_at_the_stores_name_is_never_followed(name: str, caplog: pytest.LogCaptureFixture) -> None:
    theirs, root = f"/dev/shm/hostile-{name}", host_root(name)  # this user's name (the child's uid differs)

    def plant() -> None:
        os.mkdir(theirs, 0o777)
        os.symlink(theirs, root)

    as_other(plant)
    refused(name, "symlink")
    falls_back(name, caplog)
    assert os.listdir(theirs) == []


def test_another_users_lock_neither_pulls_auto_into_host_mode_nor_blocks_drop(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two places another user's held owner lock could be: in its own folder at the store's name
    (the victim never uses it; `kvpack host` says so in one line), and planted (by root) in this
    user's own store (it counts for nothing: auto stays per-process, drop drops)."""
    root = host_root(name)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the other user's process, holding its lock until the pipe closes
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            os.mkdir(root, 0o700)
            os.mkdir(f"{root}/{OWNERS}", 0o700)
            fd = os.open(f"{root}/{OWNERS}/1-abc", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(w, b"x")
            os.pause()
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x"
        assert live_users(root) == 0
        with caplog.at_level(logging.WARNING, logger="kvpack"):
            assert resolve_memory(host_config(name, "auto")).memory.mode is MemoryMode.PROCESS
        assert name not in [s.name for s in host_stores()]
        from kvpack.tiers.host.stores import not_stores

        said = [ln for ln in not_stores() if root in ln]
        assert len(said) == 1 and f"owned by uid {OTHER}" in said[0]
        problem = drop(name)
        assert problem is not None and "\n" not in problem and f"owned by uid {OTHER}" in problem
        cli = subprocess.run(
            [str(Path(sys.executable).with_name("kvpack")), "host", "drop", name],
            capture_output=True,
            text=True,
            check=False,
        )
        assert cli.returncode == 2 and "Traceback" not in cli.stderr and len(cli.stderr.splitlines()) == 1
        assert root in cli.stderr
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)
    shutil.rmtree(root)
    # this user's own store, with a lock of another uid planted in it (only root could): not a user
    tier = HostTier(name, CAPACITY)
    tier.close()
    planted = f"{root}/{OWNERS}/2-def"
    fd = os.open(planted, os.O_RDWR | os.O_CREAT, 0o600)
    os.fchown(fd, OTHER, OTHER)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert live_users(root) == 0
        assert resolve_memory(host_config(name, "auto")).memory.mode is MemoryMode.PROCESS
        assert drop(name) is None and not os.path.exists(root)
    finally:
        os.close(fd)


def test_this_users_own_store_open_to_others_is_refused(name: str, caplog: pytest.LogCaptureFixture) -> None:
    root = host_root(name)
    tier = HostTier(name, CAPACITY)
    tier.close()
    os.chmod(root, 0o755)
    refused(name, "mode 0755")
    falls_back(name, caplog)
    os.chmod(root, 0o700)
    os.chown(f"{root}/{ARENA}", OTHER, OTHER)  # an arena file not this user's: replaced, never mapped
    theirs = os.stat(f"{root}/{ARENA}").st_ino
    HostTier(name, CAPACITY).close()
    now = os.stat(f"{root}/{ARENA}")
    assert now.st_uid == 0 and now.st_ino != theirs
    os.chmod(f"{root}/.kvpack-store.index", 0o644)  # the index readable by others: refused, never opened
    with pytest.raises(ConfigError) as info:
        HostTier(name, CAPACITY)
    assert "\n" not in str(info.value) and ".kvpack-store.index" in str(info.value) and "0644" in str(info.value)
    os.chmod(f"{root}/.kvpack-store.index", 0o600)
    tier = HostTier(name, CAPACITY)  # whole again: this user's alone
    item = make_item("t", chunk_id(1), nbytes=1000, seed=1)[0]
    assert tier.put_from([item]) == [TierStatus.OK]
    tier.close()
    for entry in os.scandir(root):  # every file kvpack made there is this user's alone
        st = entry.stat(follow_symlinks=False)
        assert st.st_uid == 0 and not st.st_mode & 0o077, (entry.name, oct(st.st_mode))


def test_a_disk_store_in_tmp_that_another_user_made_first_is_refused(tmp_path: Path) -> None:
    path = f"/tmp/kvpack-private-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    as_other(lambda: (os.mkdir(path), os.chmod(path, 0o777)))
    try:
        with pytest.raises(ConfigError) as info:
            DiskTier(path, 1 << 20)
        text = str(info.value)
        assert "\n" not in text and "disk.path" in text and path in text and f"uid {OTHER}" in text
        assert os.listdir(path) == []
    finally:
        shutil.rmtree(path, ignore_errors=True)
    tier = DiskTier(path, 1 << 20)  # made by this user: 0700, its index files 0600
    try:
        assert os.stat(path).st_mode & 0o777 == 0o700
        assert all(not e.stat().st_mode & 0o077 for e in os.scandir(path) if e.is_file())
    finally:
        tier.close()
        shutil.rmtree(path, ignore_errors=True)

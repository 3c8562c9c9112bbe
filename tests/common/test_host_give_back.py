"""Host memory follows the user's intent (`kvpack.tiers.host.stores.give_back`).

Real processes, each a `KVStore` on one host store (disk off), ended one by one through stdin:

- a store ``memory.mode: auto`` chose (an engine of two processes) is still there while one of
  its users lives, and gone, its memory back, once the last one closed;
- a store the operator asked for (``memory.mode: host``) stays after its last process, was
  warned about once at start-up with its size, and ``kvpack usage`` lists it;
- the give-back is race-free: while a process is half-way into opening the store (it holds the
  folder's shared lock, its owner file not yet in place) the store is not dropped; a store
  dropped under an opener is opened again, new.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures.warm_start import KVPACK_MODULES, ScriptProcess, warm_starts
from kvpack.cli import main
from kvpack.tiers.host import HostTier, give_back, host_root, host_stores

CHILD = """
import sys
from kvpack import KVPackConfig, KVStore, resolve_memory
cfg = KVPackConfig.from_dict({"memory": {"mode": sys.argv[1], "host_name": sys.argv[2], "capacity": "16MiB"},
                              "disk": {"enabled": False}})
store = KVStore.from_config(resolve_memory(cfg, engine_processes=2))
print(type(store.tiers[0]).__name__, flush=True)
sys.stdin.readline()
store.close()
"""


@pytest.fixture
def name() -> Iterator[str]:
    n = f"test-giveback-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    shutil.rmtree(host_root(n), ignore_errors=True)


@dataclass
class _User:
    """A child process using the store; its stderr goes to `log`."""

    proc: ScriptProcess
    log: Path


def _start(mode: str, name: str, folder: Path) -> _User:
    """A child that opens store `name` in `mode`, forked from a process that imported torch
    (its stderr in `folder`)."""
    log = folder / f"{mode}-{uuid.uuid4().hex[:8]}.stderr"
    proc = warm_starts().start_script(
        sys.executable, ["-c", CHILD, mode, name], dict(os.environ), subprocess.PIPE, log,
        stdin=subprocess.PIPE, modules=KVPACK_MODULES,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "HostTier", (line, log.read_text())
    return _User(proc, log)


def _end(user: _User) -> str:
    """Let the child end (a line on its stdin); its stderr."""
    assert user.proc.stdin is not None and user.proc.stdout is not None
    user.proc.stdin.write("\n")
    user.proc.stdin.close()
    rc = user.proc.wait(timeout=60)
    user.proc.stdout.close()
    err = user.log.read_text()
    assert rc == 0, err[-2000:]
    return err


def _users(name: str) -> int | None:
    return next((s.users for s in host_stores() if s.name == name), None)


def test_an_auto_store_is_given_back_by_its_last_user(name: str, tmp_path: Path) -> None:
    first, second = _start("auto", name, tmp_path), _start("auto", name, tmp_path)
    assert _users(name) == 2
    _end(second)
    assert _users(name) == 1, "given back while a user lived"
    err = _end(first)
    assert _users(name) is None, f"the auto store outlived its last user\n{err[-1000:]}"
    assert not os.path.exists(host_root(name))


def test_a_host_store_stays_and_is_warned_about(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _end(_start("host", name, tmp_path))
    assert err.count(f"host store {name} holds 16 MiB of shared memory until dropped") == 1, err[-2000:]
    assert _users(name) == 0
    assert main(["usage", "--disk", "/nonexistent-kvpack-usage"]) == 0
    out = capsys.readouterr().out
    assert f"host store {name}: 16.1 MiB of shared memory held until dropped, 0 live user(s)" in out, (
        out
    )  # arena + index


def test_no_give_back_while_a_process_is_opening_it(name: str) -> None:
    tier = HostTier(name, 16 << 20, give_back_unused=True)
    tier.close()
    assert not os.path.exists(host_root(name)), "the last user's close did not give it back"
    tier = HostTier(name, 16 << 20, give_back_unused=True)
    fd = os.open(host_root(name), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # as an opener holds it until its owner file is in place
        tier.close()  # the last user, but one is half-way in: it gives up at its bound, the store stays
        assert os.path.isdir(host_root(name))
        assert not give_back(name, wait_s=0.05)
    finally:
        os.close(fd)
    assert give_back(name)
    assert not os.path.exists(host_root(name))
    again = HostTier(name, 16 << 20)  # a store dropped under an opener: the path is opened again, new
    try:
        assert again.usage().objects == 0
    finally:
        again.close()


def test_an_auto_user_never_gives_back_a_store_someone_asked_for(name: str, tmp_path: Path) -> None:
    asked = _start("host", name, tmp_path)
    joined = _start("auto", name, tmp_path)  # auto beside a live user: the host store
    _end(asked)
    _end(joined)  # the last user, an auto one
    assert _users(name) == 0, "a store memory.mode host asked for was given back"


def test_kvpack_clear_visiting_an_auto_store_leaves_it_auto(name: str, tmp_path: Path) -> None:
    HostTier(name, 16 << 20, give_back_unused=True, asked_for=False).close()  # made and given back
    user = _start("auto", name, tmp_path)
    try:
        assert main(["clear", "--tenant", "nobody", "--tier", "host", "--host", name]) == 0  # opens the store
    finally:
        _end(user)
    assert _users(name) is None, "a visit by kvpack clear made an auto store persist"

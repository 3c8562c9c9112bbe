"""``kvpack config FILE`` is the start-up check: bad files get one line, never a traceback.

Each bad file goes through the command (`kvpack.cli.main`), and the issue's
dozen through the installed ``kvpack`` script in a subprocess as well: exit
status 2, nothing on stdout, exactly one line on stderr naming the file, the
field where there is one, and the problem. The store folder rules are the same
function at start-up and in the command (`kvpack.tiers.checks.check_tiers`),
and the command creates nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpack import ConfigError, KVPackConfig
from kvpack.cli import main
from kvpack.config.schema import DiskTierConfig, MemoryTierConfig
from kvpack.store import KVStore
from kvpack.tiers.checks import check_tiers
from kvpack.tiers.disk import fs as disk_fs

HUGE_INT = "9" * 5000
DEEP = 100_000


@dataclass(frozen=True)
class BadFile:
    """A config file (written by `make` into a fresh folder) and the words its one error line must hold."""

    name: str
    make: Callable[[Path], Path]
    expect: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    via_script: bool = False
    """Also through the installed script (each run imports torch: a dozen, not all)."""


def _write(name: str, content: bytes | str) -> Callable[[Path], Path]:
    def make(root: Path) -> Path:
        file = root / name
        file.write_bytes(content if isinstance(content, bytes) else content.encode())
        return file

    return make


def _with_store(name: str, prepare: Callable[[Path], None]) -> Callable[[Path], Path]:
    """A JSON config whose disk.path is `root/store`, prepared by `prepare`."""

    def make(root: Path) -> Path:
        store = root / "store"
        prepare(store)
        file = root / name
        file.write_text(json.dumps({"disk": {"path": str(store)}}))
        return file

    return make


def _with_mooncake_file(content: bytes, *, via_env: bool) -> Callable[[Path], Path]:
    def make(root: Path) -> Path:
        (root / "mooncake.json").write_bytes(content)
        mooncake: dict[str, object] = {"enabled": True}
        if not via_env:
            mooncake["config_file"] = str(root / "mooncake.json")
        file = root / "c.json"
        file.write_text(json.dumps({"memory": {"enabled": False}, "disk": {"enabled": False}, "mooncake": mooncake}))
        return file

    return make


def _fifo(root: Path) -> Path:
    """A FIFO no one writes to: reading it would wait forever."""
    os.mkfifo(root / "c.json")
    return root / "c.json"


def _store_file(store: Path) -> None:
    store.write_text("not a folder")


def _unmarked_store(store: Path) -> None:
    store.mkdir()
    (store / "photos").mkdir()


def _other_format_store(store: Path) -> None:
    store.mkdir()
    (store / disk_fs.MARKER).write_text("kvpack store\nformat 99\n")


BAD_FILES = [
    BadFile("json-not-utf8", _write("c.json", b'{"tenant": "\xff"}'), ("not UTF-8", "offset 12"), via_script=True),
    BadFile(
        "toml-not-utf8",
        _write("c.toml", b'tenant = "ok"\nmodel_id = "\xfe"\n'),
        ("not UTF-8", "line 2"),
        via_script=True,
    ),
    BadFile(
        "json-huge-int",
        _write("c.json", '{"io_threads": ' + HUGE_INT + "}"),
        ("more than 4300 digits",),
        via_script=True,
    ),
    BadFile(
        "toml-huge-int",
        _write("c.toml", "io_threads = " + HUGE_INT + "\n"),
        ("more than 4300 digits",),
        via_script=True,
    ),
    BadFile("json-deep", _write("c.json", "[" * DEEP + "]" * DEEP), ("nested too deeply",), via_script=True),
    BadFile(
        "toml-deep",
        _write("c.toml", "tenant = " + "[" * DEEP + "]" * DEEP + "\n"),
        ("nested too deeply",),
        via_script=True,
    ),
    BadFile("json-not-an-object", _write("c.json", "[1, 2]"), ("must hold a JSON object",)),
    BadFile(
        "key-with-line-breaks",
        _write("c.json", json.dumps({"ten\nant\u2028": "a"})),
        ("ten\\nant\\u2028", "unknown key"),
    ),
    BadFile(
        "megabyte-value",
        _write("c.json", json.dumps({"io_threads": "x" * (1 << 20)})),
        ("io_threads", "expected an integer"),
        via_script=True,
    ),
    BadFile("wrong-type-nested", _write("c.toml", "[memory]\ncapacity = [1, 2]\n"), ("memory.capacity",)),
    BadFile(
        "disk-path-root",
        _write("c.json", '{"disk": {"path": "/"}}'),
        ("disk.path", "top-level system folder"),
        via_script=True,
    ),
    BadFile("disk-path-proc", _write("c.json", '{"disk": {"path": "/proc/self"}}'), ("disk.path", "under /proc")),
    BadFile("disk-path-a-file", _with_store("c.json", _store_file), ("disk.path", "not a folder"), via_script=True),
    BadFile(
        "disk-path-unmarked",
        _with_store("c.json", _unmarked_store),
        ("disk.path", "not empty", "photos"),
        via_script=True,
    ),
    BadFile("disk-path-other-format", _with_store("c.json", _other_format_store), ("disk.path", "another format")),
    BadFile(
        "mooncake-file-not-utf8",
        _with_mooncake_file(b'{"master_server_address": "\xff"}', via_env=False),
        ("mooncake.config_file", "mooncake.json", "not UTF-8"),
        via_script=True,
    ),
    BadFile(
        "mooncake-env-file-not-utf8",
        _with_mooncake_file(b'{"master_server_address": "\xff"}', via_env=True),
        ("MOONCAKE_CONFIG_PATH", "mooncake.json", "not UTF-8"),
        env=(("MOONCAKE_CONFIG_PATH", "mooncake.json"),),
        via_script=True,
    ),
    BadFile(
        "mooncake-file-huge-int",
        _with_mooncake_file(b'{"global_segment_size": ' + HUGE_INT.encode() + b"}", via_env=False),
        ("mooncake.config_file", "more than 4300 digits"),
    ),
    BadFile("missing-file", lambda root: root / "nope.json", ("nope.json", "cannot be read")),
    BadFile("a-fifo", _fifo, ("not a regular file",)),
    BadFile(
        "key-file-a-device",
        _write("c.json", '{"integrity_key_file": "/dev/zero"}'),
        ("integrity_key_file", "/dev/zero", "not a regular file"),
    ),
    BadFile("a-folder", lambda root: root, ("not a regular file",)),
]


@dataclass(frozen=True)
class Outcome:
    file: Path
    returncode: int
    stdout: str
    stderr: str


def _kvpack_command() -> list[str]:
    script = shutil.which("kvpack", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "kvpack.cli"]


SIDE_BY_SIDE = 3
"""Script runs at once (the machine's cores are shared)."""


def _env(bad: BadFile, root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
    env["XDG_CACHE_HOME"] = str(root / "cache")
    env.update({k: str(root / v) for k, v in bad.env})
    return env


@pytest.fixture(scope="module")
def script_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """The marked bad files through the installed script, `SIDE_BY_SIDE` processes at a time."""
    todo = [b for b in BAD_FILES if b.via_script]
    out: dict[str, Outcome] = {}
    while todo:
        batch, todo = todo[:SIDE_BY_SIDE], todo[SIDE_BY_SIDE:]
        running = []
        for bad in batch:
            root = tmp_path_factory.mktemp(bad.name)
            file = bad.make(root)
            cmd = [*_kvpack_command(), "config", str(file)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(bad, root), cwd=root)
            running.append((bad.name, file, proc))
        for name, file, proc in running:
            stdout, stderr = proc.communicate(timeout=300)
            out[name] = Outcome(file, proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"))
    return out


def test_a_dozen_go_through_the_script() -> None:
    assert sum(b.via_script for b in BAD_FILES) >= 12


@pytest.mark.parametrize("bad", [b for b in BAD_FILES if b.via_script], ids=lambda b: b.name)
def test_the_script_answers_a_bad_file_with_one_line(bad: BadFile, script_outcomes: dict[str, Outcome]) -> None:
    check_one_line(bad, script_outcomes[bad.name])


@pytest.mark.parametrize("bad", BAD_FILES, ids=lambda b: b.name)
def test_the_command_answers_a_bad_file_with_one_line(
    bad: BadFile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    file = bad.make(tmp_path)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    for key, value in _env(bad, tmp_path).items():
        monkeypatch.setenv(key, value)
    code = main(["config", str(file)])
    captured = capsys.readouterr()
    check_one_line(bad, Outcome(file, code, captured.out, captured.err))


def check_one_line(bad: BadFile, got: Outcome) -> None:
    assert "Traceback" not in got.stderr, got.stderr[-2000:]
    assert got.returncode == 2, got.stderr[-2000:]
    assert got.stdout == ""
    lines = got.stderr.splitlines()
    assert len(lines) == 1, got.stderr[:2000]
    line = lines[0]
    assert line.startswith("kvpack config: ") and len(line) < 1000, line
    assert got.file.name in line, line
    for word in bad.expect:
        assert word in line, (word, line)


def test_a_good_file_prints_the_config_and_creates_no_folder(tmp_path: Path) -> None:
    store = tmp_path / "new" / "store"
    file = tmp_path / "c.toml"
    file.write_text(f'[disk]\npath = "{store}"\ncapacity = "1GiB"\n')
    proc = subprocess.run([*_kvpack_command(), "config", str(file)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["disk"]["path"] == str(store)
    assert not (tmp_path / "new").exists()


# -- one rule, one place: the command's check and start-up refuse the same folders -------------------------


@pytest.mark.parametrize(
    "prepare",
    [_store_file, _unmarked_store, _other_format_store],
    ids=["a-file", "unmarked", "other-format"],
)
def test_start_up_and_the_check_refuse_a_folder_alike(tmp_path: Path, prepare: Callable[[Path], None]) -> None:
    store = tmp_path / "store"
    prepare(store)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    cfg = KVPackConfig(memory=MemoryTierConfig(enabled=False), disk=DiskTierConfig(path=str(store)))
    with pytest.raises(ConfigError) as checked:
        check_tiers(cfg)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    with pytest.raises(ConfigError) as opened:
        disk_fs.open_store_root(str(store))
    assert str(checked.value) == str(opened.value)
    with pytest.raises(ConfigError) as started:
        KVStore.from_config(cfg, write_back=False)
    assert str(started.value) == str(checked.value)


def test_the_check_accepts_what_start_up_accepts(tmp_path: Path) -> None:
    store = tmp_path / "a" / "b"
    cfg = KVPackConfig(memory=MemoryTierConfig(enabled=False), disk=DiskTierConfig(path=str(store)))
    check_tiers(cfg)
    assert not (tmp_path / "a").exists()
    real, fd = disk_fs.open_store_root(str(store))
    os.close(fd)
    assert (store / disk_fs.MARKER).is_file()
    check_tiers(cfg)  # a marked folder of this format


def test_a_folder_under_a_file_is_refused_before_start_up(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="disk.path.*is not a folder"):
        check_tiers(KVPackConfig(disk=DiskTierConfig(path=str(tmp_path / "f" / "store"))))
    with pytest.raises(ConfigError, match="disk.path"):
        disk_fs.open_store_root(str(tmp_path / "f" / "store"))

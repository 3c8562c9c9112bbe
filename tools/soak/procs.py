"""Processes the soak starts, and how it stops them: by PID, always.

- `Proc`: one child process with its log file; `stop()` sends SIGTERM to
  the PID (and SIGCONT first, in case a fault left it stopped), then SIGKILL
  after a bound. `pause()` / `resume()` are SIGSTOP / SIGCONT (a slow tier).
- `tree_rss()`: resident memory of a process and all its descendants.
- `MooncakeProcs`: a ``mooncake_master`` and a ``mooncake_client`` segment
  holder on 127.0.0.1 with free ports; kill, restart, pause.
- `Tmpfs`: a small tmpfs mounted for the disk tier (a real ENOSPC), when
  this process may mount; unmounted by path at the end.

Nothing here is found or killed by name.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvpack.tools.local_mooncake import mooncake_binaries
from kvpack.tools.ports import free_port
from kvpack.tools.procfs import stat_fields

HOST = "127.0.0.1"


def port_open(port: int, timeout: float = 0.2) -> bool:
    try:
        socket.create_connection((HOST, port), timeout).close()
        return True
    except OSError:
        return False


@dataclass
class Proc:
    """A child process started by the soak, with its log file."""

    name: str
    cmd: list[str]
    log: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with open(self.log, "ab") as f:
            f.write(f"\n=== soak: starting {self.name}: {' '.join(self.cmd)}\n".encode())
            f.flush()
            self.popen = subprocess.Popen(
                self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def _signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            try:
                os.kill(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.alive():
            assert self.popen is not None
            self._signal(signal.SIGCONT)
            self.popen.kill()
            self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; then SIGKILL any descendants left in its session."""
        if self.popen is None:
            return
        kids = descendants(self.popen.pid) if self.alive() else []
        if self.alive():
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        for pid in kids:  # children it started (vLLM's engine core), by PID
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def descendants(pid: int) -> list[int]:
    """PIDs of every descendant of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(f"/proc/{entry}/stat")
        if not fields or not fields[1].isdigit():
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants."""
    return sum(rss_bytes(p) for p in [pid, *descendants(pid)])


# -- Mooncake ---------------------------------------------------------------------------


def mooncake_env() -> dict[str, str]:
    env = dict(os.environ)
    env["MC_TCP_BIND_ADDRESS"] = HOST
    env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    return env


@dataclass
class MooncakeProcs:
    """A master and one segment holder on 127.0.0.1 (see the module docstring)."""

    workdir: Path
    segment_size: str = "512MB"
    rpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    holder_port: int = field(default_factory=free_port)
    master: Proc | None = None
    holder: Proc | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    def start(self) -> MooncakeProcs:
        bins = mooncake_binaries()
        if bins is None:
            raise RuntimeError("Mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)")
        self._bins = bins
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.start_master()
        self.start_holder()
        return self

    def start_master(self, timeout: float = 15.0) -> None:
        cmd = [
            self._bins[0],
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr",
        ]
        self.master = Proc("mooncake_master", cmd, self.workdir / "master.log", mooncake_env()).start()
        deadline = time.monotonic() + timeout
        while not port_open(self.rpc_port):
            if not self.master.alive():
                raise RuntimeError(f"mooncake_master exited; see {self.master.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master not ready after {timeout}s; see {self.master.log}")
            time.sleep(0.05)

    def start_holder(self, timeout: float = 30.0) -> None:
        cmd = [
            self._bins[1],
            f"--global_segment_size={self.segment_size}",
            f"--master_server_address={self.address}",
            "--metadata_server=P2PHANDSHAKE",
            f"--host={HOST}",
            f"--port={self.holder_port}",
        ]
        self.holder = Proc("mooncake_client", cmd, self.workdir / "holder.log", mooncake_env()).start()
        self.wait_capacity(timeout)

    def restart_master(self) -> None:
        if self.master is not None:
            self.master.kill()
        self.start_master()
        if self.holder is not None and self.holder.alive():
            self.wait_capacity(30.0, must=False)  # the holder re-mounts its segment by itself

    def restart_holder(self) -> None:
        if self.holder is not None:
            self.holder.kill()
        self.start_holder()

    def capacity(self) -> float:
        text = urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=2).read().decode()
        for line in text.splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return float(line.split()[1])
        return 0.0

    def wait_capacity(self, timeout: float, must: bool = True) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.holder is not None and not self.holder.alive():
                raise RuntimeError(f"mooncake_client exited; see {self.holder.log}")
            try:
                if self.capacity() > 0:
                    return True
            except OSError:
                pass
            time.sleep(0.1)
        if must:
            raise RuntimeError(f"no Mooncake segment mounted after {timeout}s; see {self.workdir}")
        return False

    def stop(self) -> None:
        for p in (self.holder, self.master):
            if p is not None:
                p.stop(timeout=5.0)


# -- tmpfs for a real "disk full" --------------------------------------------------------


@dataclass
class Tmpfs:
    """A tmpfs of `size` mounted at `path` if this process may mount, else a plain folder."""

    path: Path
    size: str = "64m"
    mounted: bool = False

    def mount(self) -> bool:
        self.path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            return False
        r = subprocess.run(
            # mode 0700: a tmpfs root is otherwise 1777, a folder others may write into, where kvpack
            # takes only a store folder it made itself (0700)
            ["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0700", "tmpfs", str(self.path)],
            capture_output=True,
            timeout=10,
        )
        self.mounted = r.returncode == 0
        return self.mounted

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=10)
            self.mounted = False

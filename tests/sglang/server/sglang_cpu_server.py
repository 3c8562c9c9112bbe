"""Start, query and stop a real CPU SGLang server for ``test_sglang_server.py`` (tests only).

The server runs the SGLang venv's own Python with this folder's ``cpu_site/`` on
PYTHONPATH (a test-only ``sitecustomize``: a stub ``sgl_kernel``, stand-ins for
missing imports, two patches to SGLang internals; see that folder). It listens on
127.0.0.1 on a free port, in its own process group, and is stopped by its PID
(SIGTERM, then SIGKILL to that group) whatever happens in the test. Every wait is
bounded; a server that dies or never gets healthy raises `ServerError` carrying
the tail of its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvpack.inspect_store import summarize

CPU_SITE = Path(__file__).resolve().parent / "cpu_site"
LOG_TAIL_CHARS = 6000


class ServerError(RuntimeError):
    """The server failed to start, died, or answered badly; the message ends with its log tail."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env() -> dict[str, str]:
    """The server's environment: CPU engine, offline, ``cpu_site`` first on PYTHONPATH."""
    env = dict(os.environ)
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=os.pathsep.join([str(CPU_SITE), *filter(None, [env.get("PYTHONPATH")])]),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def server_argv(model: Path, port: int, extra_config: dict[str, object], page_size: int) -> list[str]:
    """``sglang.launch_server`` on the CPU engine with HiCache L3 through the ``dynamic`` backend."""
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--attention-backend", "torch_native",
        "--max-total-tokens", "4096", "--page-size", str(page_size),
        "--skip-server-warmup",
        "--enable-hierarchical-cache", "--hicache-size", "1", "--hicache-io-backend", "direct",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(extra_config),
    ]  # fmt: skip


@dataclass
class CpuServer:
    """A running server process and where it logs."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no server log: {exc})"
        return text[-LOG_TAIL_CHARS:]

    def error(self, message: str) -> ServerError:
        return ServerError(f"{message}\n--- server log tail ({self.log_path}) ---\n{self.log_tail()}")

    def post(self, path: str, body: dict[str, object], timeout_s: float) -> tuple[int, str]:
        """POST JSON; returns (HTTP status, body text). A dead server or a timeout raises `ServerError`."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except OSError as exc:
            raise self.error(f"POST {path} failed: {exc!r} (server exit code {self.process.poll()})") from exc

    def generate(
        self, input_ids: list[int], sampling_params: dict[str, object], *, return_logprob: bool = False, timeout_s: float = 60
    ) -> dict[str, object]:
        """``/generate`` on token ids; the response JSON (``text``, ``output_ids``, ``meta_info``)."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        status, text = self.post("/generate", body, timeout_s)
        if status != 200:
            raise self.error(f"/generate answered {status}: {text[:500]}")
        return json.loads(text)

    def flush_cache(self, timeout_s: float = 30) -> None:
        """``/flush_cache`` (device tree and host pool), retried while the scheduler is not yet idle."""
        deadline = time.monotonic() + timeout_s
        while True:
            status, text = self.post("/flush_cache", {}, timeout_s=10)
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise self.error(f"/flush_cache kept answering {status}: {text[:300]}")
            time.sleep(0.5)

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until 200; fail early if the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.error(f"server exited with code {self.process.returncode} before it was healthy")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise self.error(f"server not healthy after {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the server's PID, wait, then SIGKILL its process group (its own session)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # scheduler/detokenizer children, if any are left
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(timeout=10)


@contextmanager
def running_cpu_server(
    model: Path, extra_config: dict[str, object], log_path: Path, *, page_size: int, start_timeout_s: float = 150
) -> Iterator[CpuServer]:
    """A healthy CPU SGLang server on a free 127.0.0.1 port, stopped on exit (also on failure)."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            server_argv(model, port, extra_config, page_size),
            cwd=log_path.parent,
            env=server_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = CpuServer(process, port, log_path)
    try:
        server.wait_healthy(start_timeout_s)
        yield server
    finally:
        server.stop()


def wait_for_stored_pages(store: Path, tenant: str, member: str, pages: int, timeout_s: float = 30) -> int:
    """Wait until kvpack's disk store holds at least `pages` objects of `member` for `tenant`.

    SGLang backs pages up to L3 asynchronously after a request finishes, and
    ``/flush_cache`` drops backups still in flight, so the test waits for them
    (read-only, through `kvpack inspect`'s summary). Returns the count seen last.
    """
    deadline = time.monotonic() + timeout_s
    seen = 0
    while True:
        if store.is_dir():
            tenant_summary = summarize(store).tenants.get(tenant)
            seen = tenant_summary.members.get(member, 0) if tenant_summary else 0
        if seen >= pages or time.monotonic() > deadline:
            return seen
        time.sleep(0.25)

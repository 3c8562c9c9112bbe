"""Start, query and stop a real CPU SGLang server for ``test_sglang_server.py`` (tests only).

The server runs the SGLang venv's own Python with this folder's ``cpu_site/`` on
PYTHONPATH (a test-only ``sitecustomize``: a stub ``sgl_kernel``, stand-ins for
missing imports, two patches to SGLang internals; see that folder), forked from a
process that has imported ``sglang.launch_server`` with the same environment
(`fixtures.warm_start`); so are its scheduler and detokenizer (`SET_BY_SGLANG_LAUNCH`). It listens on 127.0.0.1 on a free port, in its own process
group, and is stopped by its PID (SIGTERM, then SIGKILL to that group) whatever
happens in the test.

Every wait is bounded, and each bound follows the machine (`Limits`): start-up
gets `START_TIMEOUT_S` (a cold start compiles SGLang's imports and JIT-builds
kvpack's copy kernel: about 30-60 s on 2 cores), and the later steps get their
base limit times how much slower than `REFERENCE_START_S` the start-up was
(at most `MAX_SLOWDOWN`). A failure raises `ServerError` naming the step that
failed or ran out of time, how long it ran against its limit, the server's
last log line and any timeout the log reports, then the log tail.

SGLang's own warm-up request is skipped (``--skip-server-warmup``; it would be
one more request with its own read timeout on a cold start). What SGLang 0.5.23
still does after start-up is a ``/freeze_gc`` call with a fixed 10 s read
timeout; when it fails the log says ``post-warmup freeze_gc failed``, which is
only a warning. A server that exits before it is healthy with a timeout or a
taken port in its log (a cold or busy machine) is started once more, with its
first log kept; any other early exit fails at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fixtures.warm_start import SGLANG_MODULES, ScriptProcess, warm_starts
from kvpack.operate.inspect_store import summarize
from kvpack.tools.ports import free_port

CPU_SITE = Path(__file__).resolve().parent / "cpu_site"
LOG_TAIL_CHARS = 6000
START_TIMEOUT_S = 300.0  # launch until /health answers 200, cold start included
REFERENCE_START_S = 45.0  # a cold start on this project's 2-core CI machine kind (measured 40-60 s)
MAX_SLOWDOWN = 4.0
START_ATTEMPTS = 2
# an early exit with one of these in its log is a slow or busy machine, worth one more start
TRANSIENT_START_FAILURES = re.compile(r"[Tt]imed out|TimeoutError|[Aa]ddress already in use")
_LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ")


class ServerError(RuntimeError):
    """The server failed to start, died, or answered badly in one named step; the message ends with its log tail."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Limits:
    """Seconds each step of the test may take, at the speed of a machine that started the server in
    `REFERENCE_START_S`; `scaled` stretches them for a slower one."""

    generate_s: float = 60.0
    backup_s: float = 30.0  # SGLang's asynchronous L3 backup reaching kvpack's disk store
    flush_s: float = 30.0
    slowdown: float = 1.0

    def scaled(self, start_s: float) -> "Limits":
        slowdown = min(MAX_SLOWDOWN, max(1.0, start_s / REFERENCE_START_S))
        return Limits(self.generate_s * slowdown, self.backup_s * slowdown, self.flush_s * slowdown, slowdown)


SET_BY_SGLANG_LAUNCH = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "8",
    "CUTE_DSL_LOG_LEVEL": "30",
    "CUTE_DSL_LOG_TO_CONSOLE": "1",
    "DG_JIT_CACHE_DIR": os.path.join(os.path.expanduser("~/.cache/sglang"), "deep_gemm"),
    "DG_JIT_USE_NVRTC": "0",
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_NVLS_ENABLE": "0",
    "SGLANG_DISABLE_OUTLINES_DISK_CACHE": "0",
    "SGLANG_ENABLE_DETERMINISTIC_INFERENCE": "0",
    "SGLANG_ENABLE_TORCH_COMPILE": "0",
    "SGLANG_USE_CUDA_IPC_TRANSPORT": "0",
    "TLLM_LOG_LEVEL": "INFO",
    "TRTLLM_ENABLE_PDL": "1",
}
"""What SGLang 0.5.23's launch sets in the server's process for these tests' arguments before it
spawns its scheduler and detokenizer (``_set_envs_and_config``, ``handle_environment_variables``,
the imports of deep_gemm's and mxfp4's wrappers), each to the value it sets. The servers start with
them (SGLang sets each again, to the same value), so what a server spawns reads the environment
the server's own imports read, and is forked (`fixtures.warm_spawn`; ``SGLANG_RUN_ID``, new each
launch and read by no import, is let differ there). Where SGLang sets another value its spawns
start cold (``spawns.log`` in the run's folder says which variable); `test_sglang_server` checks
that they were forked."""


def server_env() -> dict[str, str]:
    """The server's environment: CPU engine, offline, ``cpu_site`` first on PYTHONPATH, and
    `SET_BY_SGLANG_LAUNCH`."""
    env = dict(os.environ)
    env.update(
        SET_BY_SGLANG_LAUNCH,
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=os.pathsep.join([str(CPU_SITE), *filter(None, [env.get("PYTHONPATH")])]),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def server_argv(
    model: Path,
    port: int,
    extra_config: dict[str, object],
    page_size: int,
    dtype: str | None = None,
    more: Sequence[str] = (),
) -> list[str]:
    """``sglang.launch_server`` on the CPU engine with HiCache L3 through the ``dynamic`` backend
    (`dtype`: SGLang's ``--dtype``; default its own choice, bf16 on the CPU). `more`: further
    server arguments, after these (a repeated option takes the last value: ``--max-total-tokens``).

    ``--sleep-on-idle`` (SGLang's own option): without it an idle CPU server's scheduler loop runs
    its self-checks back to back and keeps the machine's cores busy (benchmarks/RESULTS.md), taken
    from whatever runs beside the server: the vLLM engine of a cross-engine test, the other lane of
    `make test`. A request wakes the scheduler at once (it polls its sockets); SGLang's storage
    threads back up and prefetch on their own."""
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--attention-backend", "torch_native",
        "--max-total-tokens", "4096", "--page-size", str(page_size),
        "--skip-server-warmup", "--sleep-on-idle",
        "--enable-hierarchical-cache", "--hicache-size", "1", "--hicache-io-backend", "direct",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(extra_config),
    ] + ([] if dtype is None else ["--dtype", dtype]) + list(more)  # fmt: skip


@dataclass
class CpuServer:
    """A running server process and where it logs."""

    process: ScriptProcess
    port: int
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    limits: Limits = field(default_factory=Limits)
    start_s: float = 0.0  # seconds from launch to healthy

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no server log: {exc})"
        return text[-LOG_TAIL_CHARS:]

    def log_findings(self) -> str:
        """The last thing the server logged, and every timeout its log reports (one line each)."""
        lines = self.log_tail().splitlines()
        stamped = [line for line in lines if _LOG_LINE.match(line)]
        timeouts = [line for line in lines if TRANSIENT_START_FAILURES.search(line)]
        found = [f"last server log line: {(stamped or lines or ['(empty)'])[-1][:300]}"]
        found += [f"server log reports: {line[:300]}" for line in dict.fromkeys(timeouts)]
        return "\n".join(found)

    def error(
        self, step: str, message: str, *, began: float | None = None, limit_s: float | None = None
    ) -> ServerError:
        """A `ServerError` for `step`: what happened, how long the step ran against its limit, the log."""
        timing = ""
        if began is not None:
            timing = f" after {time.monotonic() - began:.0f} s" + (f" (limit {limit_s:.0f} s)" if limit_s else "")
        where = f"{self.log_findings()}\n--- server log tail ({self.log_path}) ---\n{self.log_tail()}"
        return ServerError(f"step '{step}': {message}{timing}\n{where}")

    def post(self, step: str, path: str, body: dict[str, object], timeout_s: float) -> tuple[int, str]:
        """POST JSON; returns (HTTP status, body text). A dead server or a timeout raises `ServerError`."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        began = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except TimeoutError as exc:
            raise self.error(step, f"POST {path} ran out of time", began=began, limit_s=timeout_s) from exc
        except OSError as exc:
            exit_code = self.process.poll()
            raise self.error(step, f"POST {path} failed: {exc!r} (server exit code {exit_code})", began=began) from exc

    def generate(
        self, step: str, input_ids: list[int], sampling_params: dict[str, object], *, return_logprob: bool = False
    ) -> dict[str, object]:
        """``/generate`` on token ids; the response JSON (``text``, ``output_ids``, ``meta_info``)."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        status, text = self.post(step, "/generate", body, self.limits.generate_s)
        if status != 200:
            raise self.error(step, f"/generate answered {status}: {text[:500]}")
        return json.loads(text)

    def metrics(self, step: str = "/metrics") -> str:
        """SGLang's Prometheus text (the server runs with ``--enable-metrics``)."""
        began = time.monotonic()
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=self.limits.flush_s) as response:
                return response.read().decode()
        except OSError as exc:
            raise self.error(step, f"GET /metrics failed: {exc!r}", began=began) from exc

    def flush_cache(self, step: str = "/flush_cache") -> None:
        """``/flush_cache`` (device tree and host pool), retried while the scheduler is not yet idle."""
        began = time.monotonic()
        deadline = began + self.limits.flush_s
        while True:
            status, text = self.post(step, "/flush_cache", {}, timeout_s=max(1.0, deadline - time.monotonic()))
            if status == 200:
                return
            if time.monotonic() > deadline:
                answer = f"/flush_cache kept answering {status}: {text[:300]}"
                raise self.error(step, answer, began=began, limit_s=self.limits.flush_s)
            time.sleep(0.5)

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until 200; fail early if the process exits. Sets `start_s` and `limits`."""
        step = "start-up (launch until /health answers 200)"
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.error(step, f"server exited with code {self.process.returncode} before it was healthy",
                                 began=self.started, limit_s=timeout_s)  # fmt: skip
                err.retryable = bool(TRANSIENT_START_FAILURES.search(self.log_tail()))
                raise err
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        self.start_s = time.monotonic() - self.started
                        self.limits = self.limits.scaled(self.start_s)
                        return
            except OSError:
                pass  # not listening yet, or /health's one-token check still running
            time.sleep(1)
        raise self.error(step, "server not healthy", began=self.started, limit_s=timeout_s)

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


def _launch(
    model: Path,
    extra_config: dict[str, object],
    log_path: Path,
    page_size: int,
    dtype: str | None = None,
    more: Sequence[str] = (),
) -> CpuServer:
    port = free_port()
    python, *argv = server_argv(model, port, extra_config, page_size, dtype, more)
    process = warm_starts().start_script(
        python,
        argv,
        server_env(),
        log_path,
        log_path,
        modules=SGLANG_MODULES,
        cwd=str(log_path.parent),
        new_session=True,
    )
    return CpuServer(process, port, log_path)


@contextmanager
def running_cpu_server(
    model: Path,
    extra_config: dict[str, object],
    log_path: Path,
    *,
    page_size: int,
    dtype: str | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
    attempts: int = START_ATTEMPTS,
    server_args: Sequence[str] = (),
) -> Iterator[CpuServer]:
    """A healthy CPU SGLang server on a free 127.0.0.1 port, stopped on exit (also on failure);
    `server_args` go after the standard ones (`server_argv`'s `more`).

    An attempt that exits early for a transient reason (`ServerError.retryable`)
    keeps its log as ``<log>.attempt<N>`` and is followed by one more start."""
    for attempt in range(1, attempts + 1):
        server = _launch(model, extra_config, log_path, page_size, dtype, server_args)
        try:
            server.wait_healthy(start_timeout_s)
        except ServerError as exc:
            server.stop()
            if not exc.retryable or attempt == attempts:
                if attempt > 1:
                    raise ServerError(f"start attempt {attempt} of {attempts}: {exc}") from exc
                raise
            kept = log_path.with_name(f"{log_path.name}.attempt{attempt}")
            log_path.replace(kept)
            print(f"SGLang server start attempt {attempt} exited early; trying again (its log: {kept})\n{exc}")
            continue
        except BaseException:
            server.stop()
            raise
        break
    try:
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

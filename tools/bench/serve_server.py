"""One vLLM OpenAI server under benchmark: started on 127.0.0.1, stopped by its PID, read.

`Server` starts ``vllm.entrypoints.openai.api_server`` in a session of its own
(so Ctrl-C and, after a bound, SIGKILL reach its whole process group, never
anything found by name); `Counters` reads the Prometheus counters the
serving benchmark (`serve_bench`) turns into reused-token counts.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpack.tools.bench.prom import parse_counters

HOST = "127.0.0.1"
BLOCK_SIZE = 128
"""vLLM's CPU default block size; the benchmark's prefixes are whole blocks of it."""
STOP_TIMEOUT_S = 60.0
"""Bound on a SIGINT shutdown (kvpack's own flush bound is 10 s) before SIGKILL."""


@dataclass
class Server:
    """One ``vllm.entrypoints.openai.api_server`` process, its own session and log."""

    model: str
    port: int
    log: Path
    prefix_caching: bool
    kvpack: dict[str, Any] | None
    kv_cache_bytes: int
    max_model_len: int
    shutdown_timeout_s: int | None = None
    """vLLM's ``--shutdown-timeout`` (None: vLLM's default, 0, which kills the engine at once on SIGINT)."""
    kv_role: str = "kv_both"
    """The connector's ``kv_role`` (``kv_producer`` / ``kv_consumer`` for prefill/decode)."""
    extra_args: tuple[str, ...] = ()
    """More server arguments, last (e.g. ``--tensor-parallel-size 2``)."""
    python: str = ""
    """The python that runs the server ("": this one; another venv's for a bench run from the SGLang venv)."""
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def command(self) -> list[str]:
        cmd = [
            self.python or sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(BLOCK_SIZE),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            "--enforce-eager",
            "--seed",
            "0",
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
        ]
        if self.shutdown_timeout_s is not None:
            cmd += ["--shutdown-timeout", str(self.shutdown_timeout_s)]
        if self.kvpack is not None:
            ktc = {"kv_connector": "KVPackConnector", "kv_role": self.kv_role, "kv_connector_extra_config": self.kvpack}
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
        return cmd + list(self.extra_args)

    def start(self, timeout_s: float) -> None:
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", VLLM_HOST_IP=HOST, TOKENIZERS_PARALLELISM="false")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the default multi-process mode, as users run it
        with open(self.log, "ab") as f:
            f.write(f"\n=== kvpack bench serve: {shlex.join(self.command())}\n".encode())
            f.flush()
            self.popen = subprocess.Popen(
                self.command(), stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise RuntimeError(
                        f"the vLLM server exited during start-up (rc {self.popen.returncode}):\n{self.log_tail()}"
                    )
                if http_call("GET", self.port, "/health", timeout=2)[0] == 200:
                    return
                time.sleep(1.0)
        except BaseException:  # Ctrl-C while it starts: it is in its own session, so stop it here
            self.stop()
            raise
        self.stop()
        raise RuntimeError(f"the vLLM server was not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGINT to the server's PID; SIGKILL its process group if it or a child is left after `timeout_s`."""
        if self.popen is None:
            return
        pgid = self.popen.pid  # start_new_session: the server leads its own group
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        try:
            self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        while time.monotonic() < deadline and _group_alive(pgid):  # the engine core may still be flushing
            time.sleep(0.5)
        if _group_alive(pgid):
            with open(self.log, "ab") as f:
                f.write(f"\n=== kvpack bench serve: SIGKILL to process group {pgid} after {timeout_s:.0f}s\n".encode())
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.popen.poll() is None:
            self.popen.wait(10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def http_call(
    method: str, port: int, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0
) -> tuple[int, str]:
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        conn.close()
        return resp.status, text
    except OSError:
        return 0, ""


def scrape(port: int) -> str | None:
    """The ``/metrics`` text of the server on `port` of this host (None: nothing answered in 2 s)."""
    status, text = http_call("GET", port, "/metrics", timeout=2.0)
    return text if status == 200 else None


@dataclass(frozen=True)
class Counters:
    local_cache_hit: float
    external: float
    computed: float
    preemptions: float

    @classmethod
    def read(cls, port: int) -> Counters:
        status, text = http_call("GET", port, "/metrics")
        if status != 200:
            raise RuntimeError(f"GET /metrics answered {status}")
        by_source = parse_counters(text, "vllm:prompt_tokens_by_source", "source")
        pre = parse_counters(text, "vllm:num_preemptions").get("", 0.0)
        return cls(
            by_source.get("local_cache_hit", 0.0),
            by_source.get("external_kv_transfer", 0.0),
            by_source.get("local_compute", 0.0),
            pre,
        )

    @classmethod
    def settled(cls, port: int, timeout_s: float = 10.0) -> Counters:
        """The counters once two reads a second apart agree (the server records them as outputs arrive)."""
        last = cls.read(port)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(1.0)
            now = cls.read(port)
            if now == last:
                return now
            last = now
        return last

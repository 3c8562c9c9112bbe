"""The vLLM OpenAI server under test: kvpack enabled, on 127.0.0.1, stopped by PID.

Started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script is broken in the CPU build) in vLLM's default multi-process
mode, the way users run it: the API server, and an engine-core process that
holds kvpack's scheduler side and worker side. Prefix caching is off so every
cached token a response reports comes from kvpack (with it on, vLLM's own
cache is scoped by ``cache_salt`` only, not by ``kvpack_tenant``).
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpack.tools.ports import free_port

from .procs import HOST, Proc


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_HOST_IP=HOST,
        MC_TCP_BIND_ADDRESS=HOST,
        TOKENIZERS_PARALLELISM="false",
    )
    env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the default (multi-process) mode
    return env


@dataclass
class VllmServer:
    model: str
    log: Path
    kvpack: dict[str, Any] | None
    """kvpack config (``kv_connector_extra_config``); None runs without kvpack."""
    max_model_len: int = 2048
    dtype: str = "float32"
    """Model dtype (``--dtype``). vLLM downcasts an fp32 checkpoint to bf16 on
    CPU unless told; see `kvpack.tools.soak` for why the soak compares in fp32."""
    port: int = field(default_factory=free_port)
    proc: Proc | None = None
    served_name: str = "soak-model"

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_name,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            self.dtype,
            "--enforce-eager",
            "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--seed",
            "0",
        ]
        if self.kvpack is not None:
            ktc = {"kv_connector": "KVPackConnector", "kv_role": "kv_both", "kv_connector_extra_config": self.kvpack}
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
        return cmd

    def start(self, timeout_s: float = 240.0) -> VllmServer:
        self.proc = Proc("vllm-server", self.command(), self.log, server_env()).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"the vLLM server exited during start-up; see {self.log}:\n{self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the vLLM server was not ready after {timeout_s}s; see {self.log}:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=20.0)

"""KVPackConnector start-up checks and vLLM's default multi-process mode.

- a bad kvpack config fails engine start-up naming the field;
- multi-process mode (scheduler and worker in different processes): a hit served
  by the worker's host-memory tier, which the scheduler only knows from reports;
- the OpenAI server started with ``--kv-transfer-config``: two lifetimes on one
  disk store, the second one hits and answers the same text.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_helpers import close_llm, kv_config, make_llm, object_files, prompt, run, same_output

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"bogus_key": 1}, "bogus_key"), ({"memory": {"capacity": -1}}, "memory.capacity")],
)
def test_bad_config_fails_at_startup_naming_the_field(tiny_llama: Path, extra: dict, field: str) -> None:
    with pytest.raises(Exception) as info:
        llm = make_llm(tiny_llama, kv_config(extra))
        close_llm(llm)
    text = str(info.value)
    chain = info.value.__cause__ or info.value.__context__
    assert field in text or (chain is not None and field in str(chain))


def test_multiprocess_hit_served_from_worker_memory(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk disabled: the only copy is in the worker process's memory tier. The repeat
    follows at once, as a user's would (no drain)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    ids = prompt(11, 301)
    llm = make_llm(tiny_llama, kv_config({"disk": {"enabled": False}}))
    try:
        first = run(llm, ids)
        assert first.cached == 0
        second = run(llm, ids)
        assert second.cached == len(ids) - 1
        assert same_output(first, second)
        other = run(llm, prompt(12, 301))  # negative control: an unstored prompt does not hit
        assert other.cached == 0
    finally:
        close_llm(llm)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _serve(model: Path, store: Path, log: Path) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    cfg = kv_config({"disk": {"path": str(store)}})
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--enforce-eager",
        "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0", "--dtype", "float32",
        "--kv-transfer-config", json.dumps(cfg),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port
        except OSError:
            time.sleep(1)
    proc.kill()
    raise AssertionError(f"server not ready in time; see {log}")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_openai_server_two_lifetimes_second_hits(tiny_llama: Path, tmp_path: Path) -> None:
    store, log = tmp_path / "kv", tmp_path / "server.log"
    ids = prompt(21, 301)
    body = {"model": str(tiny_llama), "prompt": ids, "max_tokens": 8, "temperature": 0}
    proc, port = _serve(tiny_llama, store, log)
    try:
        first = _post(port, body)
    finally:
        _stop(proc)  # Ctrl-C right after the answer: kvpack flushes before the server exits
    blocks, tail = object_files(store, ids)
    assert len(blocks) == 2 and tail is not None
    proc, port = _serve(tiny_llama, store, log)
    try:
        second = _post(port, body)
        cold = _post(port, {**body, "prompt": prompt(22, 301)})  # negative control
    finally:
        _stop(proc)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    details = second["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens") == len(ids) - 1
    assert ((cold["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) == 0

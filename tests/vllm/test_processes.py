"""KVPackConnector start-up checks and vLLM's default multi-process mode.

- a bad kvpack config fails engine start-up naming the field;
- multi-process mode (scheduler and worker in different processes): a hit served
  by the worker's host-memory tier, which the scheduler only knows from reports;
- the OpenAI server started with ``--kv-transfer-config``: two lifetimes on one
  disk store, the second one hits and answers the same text.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from vllm_helpers import (
    close_llm,
    kv_config,
    make_llm,
    object_files,
    post_completion,
    prompt,
    run,
    same_output,
    serve_openai,
    stop_server,
)

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


def _serve(model: Path, store: Path, log: Path) -> tuple[subprocess.Popen, int]:
    return serve_openai(model, kv_config({"disk": {"path": str(store)}}), log)


def test_openai_server_two_lifetimes_second_hits(tiny_llama: Path, tmp_path: Path) -> None:
    store, log = tmp_path / "kv", tmp_path / "server.log"
    ids = prompt(21, 301)
    body = {"model": str(tiny_llama), "prompt": ids, "max_tokens": 8, "temperature": 0}
    proc, port = _serve(tiny_llama, store, log)
    try:
        first = post_completion(port, body)
    finally:
        stop_server(proc)  # Ctrl-C right after the answer: kvpack flushes before the server exits
    blocks, tail = object_files(store, ids)
    assert len(blocks) == 2 and tail is not None
    proc, port = _serve(tiny_llama, store, log)
    try:
        second = post_completion(port, body)
        cold = post_completion(port, {**body, "prompt": prompt(22, 301)})  # negative control
    finally:
        stop_server(proc)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    details = second["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens") == len(ids) - 1
    assert ((cold["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) == 0

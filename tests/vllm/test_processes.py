"""KVPackConnector start-up checks and vLLM's default multi-process mode.

- a bad kvpack config fails engine start-up naming the field;
- multi-process mode (scheduler and worker in different processes): a hit served
  by the worker's host-memory tier, which the scheduler only knows from reports;
- the OpenAI server started with ``--kv-transfer-config``: under a burst of requests
  sharing a prefix, a request reuses the prefix another one computed while that one
  still decodes; two lifetimes on one disk store, the second one hits and answers the
  same text. The burst runs on the first lifetime (one server start for both tests;
  their prompts share no block).
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import (
    BLOCK,
    cached_tokens,
    close_llm,
    kv_config,
    make_llm,
    object_files,
    post_completion,
    prompt,
    run,
    same_output,
    serve_openai,
    start_openai,
    stop_server,
    wait_healthy,
)

from fixtures.warm_start import ScriptProcess

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
    llm = make_llm(tiny_llama, kv_config({"disk": {"enabled": False}}), disable_log_stats=False)
    try:
        first = run(llm, ids)
        assert first.cached == 0
        second = run(llm, ids)
        assert second.cached == len(ids) - 1
        assert same_output(first, second)
        other = run(llm, prompt(12, 301))  # negative control: an unstored prompt does not hit
        assert other.cached == 0
        # vLLM's split of the cached tokens by source: whole blocks and the tail, all in host
        # memory; a split that did not sum to them would be reported as external_unspecified
        assert counters(llm, "vllm:prompt_tokens_cached_by_source", "source") == {"host": len(ids) - 1}
        assert counters(llm, "vllm:kvpack_hit_tier_tokens", "tier") == {"memory": len(ids) - 1}
    finally:
        close_llm(llm)


def counters(llm: Any, name: str, label: str) -> dict[str, float]:
    """Counter `name`'s non-zero values by `label`, summed over the rest (`LLM.get_metrics`)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = float(getattr(m, "value", 0) or 0)
        if m.name == name and value:
            out[m.labels[label]] = out.get(m.labels[label], 0.0) + value
    return out


def _serve(model: Path, store: Path, log: Path) -> tuple[ScriptProcess, int]:
    return serve_openai(model, kv_config({"disk": {"path": str(store)}}), log)


@dataclass
class Lifetime:
    """An OpenAI server with kvpack on the disk store `store` (started; `wait` until it answers)."""

    proc: ScriptProcess
    port: int
    store: Path
    log: Path

    def wait(self) -> None:
        assert self.proc.poll() is None, "the first lifetime ended before this test"
        wait_healthy(self.proc, self.port, self.log)


@pytest.fixture(scope="module", autouse=True)
def first_lifetime(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lifetime]:
    """The first server lifetime of this module's server tests (the two-lifetimes test ends
    it with Ctrl-C; whatever is left running is stopped here). Started with the module: its
    start-up runs beside the in-process engines of the tests before the server tests."""
    root = tmp_path_factory.mktemp("server")
    store, log = root / "kv", root / "server.log"
    proc, port = start_openai(tiny_llama, kv_config({"disk": {"path": str(store)}}), log)
    try:
        yield Lifetime(proc, port, store, log)
    finally:
        if proc.poll() is None:
            stop_server(proc)


def test_a_prefix_is_a_hit_for_the_next_request_while_the_first_still_decodes(
    tiny_llama: Path, first_lifetime: Lifetime
) -> None:
    """The OpenAI server, as under a burst of requests sharing a prefix: B arrives while A is
    still generating, and reuses the prefix A computed (saved in the step that computed it).
    Before, saves started when a request finished, so B recomputed the whole prefix."""
    import json
    import urllib.request

    first_lifetime.wait()
    port = first_lifetime.port
    prefix = prompt(511, 3 * BLOCK + 40)
    a, b = prefix + prompt(512, 20), prefix + prompt(513, 30)
    body = {
        "model": str(tiny_llama),
        "prompt": a,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as stream:
        first = stream.readline()  # A's first token: its prompt is computed, A decodes on
        assert first.startswith(b"data:"), first
        second = post_completion(port, {"model": str(tiny_llama), "prompt": b, "max_tokens": 4, "temperature": 0})
        rest = stream.read()  # A was still generating while B ran
    assert b"[DONE]" in rest
    assert cached_tokens(second) >= 3 * BLOCK  # A's whole prefix blocks


def test_openai_server_two_lifetimes_second_hits(tiny_llama: Path, first_lifetime: Lifetime) -> None:
    store, log = first_lifetime.store, first_lifetime.log
    ids = prompt(21, 301)
    body = {"model": str(tiny_llama), "prompt": ids, "max_tokens": 8, "temperature": 0}
    first_lifetime.wait()
    proc, port = first_lifetime.proc, first_lifetime.port
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
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            scraped = resp.read().decode()  # the server's own /metrics, after both answers
    finally:
        stop_server(proc)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    details = second["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens") == len(ids) - 1
    assert ((cold["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) == 0
    # the hit by vLLM's source: this lifetime's memory tier (one process per engine: the
    # per-process tier) was empty, so all of it, whole blocks and tail, came from the disk
    by_source = samples(scraped, "vllm:prompt_tokens_cached_by_source_total", "source")
    assert by_source == {"disk": len(ids) - 1}, by_source  # not external_unspecified
    # kvpack's own counters on the same port, summed over tenants
    assert samples(scraped, "vllm:kvpack_hit_tier_tokens_total", "tier") == {"disk": len(ids) - 1}
    assert samples(scraped, "vllm:kvpack_loaded_bytes_total", "tier").get("disk", 0) > 0


def samples(text: str, name: str, label: str) -> dict[str, float]:
    """Prometheus text `text`: sample `name`'s non-zero values by `label`, summed over the rest."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels, value = line[len(name) + 1 :].rsplit("} ", 1)
        found = re.search(rf'(?:^|,){label}="([^"]*)"', labels)
        if found and float(value):
            out[found.group(1)] = out.get(found.group(1), 0.0) + float(value)
    return out

"""vLLM's own reset of external caches reaches kvpack (`KVPackConnector.reset_cache`, `kvpack.policy.clearing`).

- Offline, in vLLM's in-process and multi-process modes: a prompt is a kvpack hit; after
  ``LLM.reset_prefix_cache(reset_connector=True)`` the same prompt is recomputed (no cached token)
  with the greedy tokens and logprobs of the first, no-cache, run; another model's objects in the
  same disk folder survive. In the multi-process mode the reset runs in the engine-core process
  while the memory tier lives in the worker: the worker learns it from the next step's metadata.
- The OpenAI server (``VLLM_SERVER_DEV_MODE=1``): ``POST /reset_prefix_cache?reset_external=true``
  answers success and the same completion is recomputed, with the same tokens.
- ``reset.scope: off``: kvpack takes no part (vLLM's reset succeeds, as without a connector, so
  its weight-update cascade goes on) and the next run is still a hit.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from vllm_helpers import (
    cached_tokens,
    close_llm,
    kv_config,
    make_llm,
    post_completion,
    prompt,
    run,
    same_output,
    serve_openai,
    stop_server,
)

from kvpack import KVLayoutSpec, PutItem, StoreKey, TierStatus
from kvpack.identity.objects import ObjectHeader
from kvpack.tiers.disk import DiskTier

pytestmark = pytest.mark.vllm

BS = 32
IDS = prompt(541, 300)
OTHER_FP = KVLayoutSpec(engine="vllm:cpu", model="another-model", dtype="float32", chunk_tokens=BS).group_fingerprint


def _other_model(store: Path) -> list[StoreKey]:
    """Objects another model stored in the same folder (the disk tier, as that engine would)."""
    disk = DiskTier(store, 1 << 30)
    keys = [StoreKey("default", OTHER_FP, f"{i:064x}", "kv") for i in range(4)]
    data = np.ones(4096, np.uint8)
    items = [
        PutItem(k, ObjectHeader(OTHER_FP, k.tenant, k.chunk, k.member, BS, data.nbytes, None), memoryview(data))
        for k in keys
    ]
    assert disk.put_from(items) == [TierStatus.OK] * len(items)
    disk.close()
    return keys


def _still_there(store: Path, keys: list[StoreKey]) -> bool:
    disk = DiskTier(store, 1 << 30)
    try:
        return all(disk.contains(keys))
    finally:
        disk.close()


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "multi-process"])
def test_reset_prefix_cache_recomputes_and_spares_another_model(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, multiprocess: bool
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocess else "0")
    store = tmp_path / "kv"
    other = _other_model(store)
    llm = make_llm(tiny_llama, kv_config({"disk": {"path": str(store)}}), block_size=BS)
    try:
        first = run(llm, IDS)
        assert first.cached == 0
        hit = run(llm, IDS)
        assert hit.cached > 0, "no kvpack hit before the reset: the test proves nothing"
        llm.reset_prefix_cache(reset_connector=True)
        again = run(llm, IDS)
        assert again.cached == 0, f"{again.cached} tokens still came from kvpack after the reset"
        assert same_output(again, first), (again, first)
        assert run(llm, IDS).cached > 0, "what the recompute saved after the reset is a hit again"
    finally:
        close_llm(llm)
    assert _still_there(store, other), "the reset removed another model's objects"


def test_reset_off_keeps_the_cache(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    extra = {"disk": {"path": str(tmp_path / "kv")}, "reset": {"scope": "off"}}
    llm = make_llm(tiny_llama, kv_config(extra), block_size=BS)
    try:
        run(llm, IDS)
        assert llm.reset_prefix_cache(reset_connector=True) is True  # off: no part in resets, no failure
        assert run(llm, IDS).cached > 0
    finally:
        close_llm(llm)


def _post(port: int, path: str) -> dict[str, object]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_server_reset_external_recomputes(tiny_llama: Path, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    other = _other_model(store)
    kv = kv_config({"disk": {"path": str(store)}})
    proc, port = serve_openai(
        tiny_llama, kv, tmp_path / "server.log", "--block-size", str(BS), env={"VLLM_SERVER_DEV_MODE": "1"}
    )
    body = {"model": str(tiny_llama), "prompt": IDS, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    try:
        first = post_completion(port, body)
        assert cached_tokens(first) == 0
        assert cached_tokens(post_completion(port, body)) > 0, "no kvpack hit before the reset"
        assert _post(port, "/reset_prefix_cache?reset_external=true") == {"success": True}
        again = post_completion(port, body)
        assert cached_tokens(again) == 0, "the same prompt still came from kvpack after the reset"
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        lp_a = again["choices"][0]["logprobs"]["token_logprobs"]
        lp_f = first["choices"][0]["logprobs"]["token_logprobs"]
        assert all(abs(a - b) <= 1e-4 for a, b in zip(lp_a, lp_f))
    finally:
        stop_server(proc)
    assert _still_there(store, other), "the reset removed another model's objects"


def test_kvpack_clear_while_the_engine_loads_the_tenants_prefixes(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvpack clear --tenant`` runs while the engine loads that tenant's prefixes from disk (the
    memory tier off, so every hit is a disk load): each run is exact, no error; after a clear that
    finished, the tenant's prompts are recomputed."""
    import subprocess
    import sys

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    store = tmp_path / "kv"
    extra = {"disk": {"path": str(store)}, "memory": {"enabled": False}, "trusted_tenants": ["*"]}
    prompts = [prompt(600 + i, 260) for i in range(6)]
    llm = make_llm(tiny_llama, kv_config(extra), block_size=BS)
    # the engine's only store is this disk folder (memory off): other host stores of this user are not this test's
    clear_cmd = [
        sys.executable,
        "-m",
        "kvpack.cli",
        "clear",
        "--tenant",
        "leaver",
        "--disk",
        str(store),
        "--tier",
        "disk",
    ]
    try:
        first = [run(llm, ids, tenant="leaver") for ids in prompts]  # computed: the no-cache reference
        assert run(llm, prompts[0], tenant="leaver").cached > 0, "no hit to race with"
        clearing = subprocess.Popen(clear_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        during = [run(llm, ids, tenant="leaver") for ids in prompts * 2]
        out, err = clearing.communicate(timeout=120)
        assert clearing.returncode == 0, err[-2000:]
        assert "removed" in out, out
        for got, want in zip(during, first * 2):
            assert same_output(got, want), (got, want)
        done = subprocess.run(clear_cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        after = [run(llm, ids, tenant="leaver") for ids in prompts]
        assert [r.cached for r in after] == [0] * len(prompts), "a cleared tenant's prefix was still a hit"
        assert all(same_output(a, b) for a, b in zip(after, first))
    finally:
        close_llm(llm)

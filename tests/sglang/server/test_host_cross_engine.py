"""A CPU SGLang server loads from the host memory tier what a vLLM engine computed (issue 37).

Both run kvpack with ``memory.mode: host`` on one host store (the same
``memory.host_name``) and the disk tier off, so the host store in /dev/shm is the
only place the prompt's KV can come from. The tiny Llama in fp32 in both engines,
page size = block size = 32 (`test_cross_engine`: canonical objects, one group):

1. A vLLM engine (the vLLM venv's python, a process that simply ends) computes
   `PROMPT` and stores it into the host store.
2. A CPU SGLang server on a private, empty disk store answers `PROMPT`: its own
   no-cache answer (it runs while step 1 does).
3. A new CPU SGLang server on the host store answers `PROMPT`: every full page
   comes from the host store (``cached_tokens_details.storage``), and its greedy
   tokens equal step 2's.

Without the shared host tier (``memory.mode: process``) step 3 finds nothing: each
process's memory is its own. Needs the vLLM venv's python (``KVPACK_VLLM_PYTHON``).
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sglang_cpu_server import ServerError, running_cpu_server
from test_cross_engine import VLLM_PYTHON, vllm_run
from test_sglang_server import GREEDY, PROMPT, PROMPT_TOKENS, TENANT, kvpack_extra_config

from kvpack.tiers.host import drop

PAGE_SIZE = 32

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        not VLLM_PYTHON, reason="needs the vLLM venv's python in KVPACK_VLLM_PYTHON (scripts/test.sh sets it)"
    ),
]


def host_config(name: str) -> dict[str, object]:
    """kvpack's config on the host store `name` alone (disk off), as each engine's user writes it."""
    return {
        "tenant": TENANT,
        "disk": {"enabled": False},
        "memory": {"mode": "host", "host_name": name, "capacity": "256MiB"},
    }


@pytest.mark.slow
def test_sglang_loads_from_host_memory_what_vllm_computed(tiny_llama: Path, tmp_path: Path) -> None:
    name = f"cross-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    full_pages = PROMPT_TOKENS // PAGE_SIZE
    try:
        with ThreadPoolExecutor(1) as pool:  # vLLM writes while SGLang computes its own no-cache answer
            vllm_side = pool.submit(vllm_run, tiny_llama, None, tmp_path / "vllm_writes.log", host_config(name))
            try:
                with running_cpu_server(
                    tiny_llama,
                    kvpack_extra_config(tmp_path / "own"),
                    tmp_path / "sglang_own.log",
                    page_size=PAGE_SIZE,
                    dtype="float32",
                ) as server:
                    own = server.generate("no-cache /generate", PROMPT, GREEDY, return_logprob=True)
            except ServerError as exc:
                pytest.fail(str(exc), pytrace=False)
            written = vllm_side.result()
        assert written["cached"] == 0

        extra = {k: v for k, v in kvpack_extra_config(tmp_path / "unused").items() if k not in ("memory", "disk")}
        try:
            with running_cpu_server(
                tiny_llama,
                {**extra, **host_config(name)},
                tmp_path / "sglang_host.log",
                page_size=PAGE_SIZE,
                dtype="float32",
            ) as server:
                began = time.monotonic()
                served = server.generate(
                    "/generate over vLLM's pages in host memory", PROMPT, GREEDY, return_logprob=True
                )
                first_s = time.monotonic() - began
                server.flush_cache()
                began = time.monotonic()
                server.generate("the same again after /flush_cache", PROMPT, GREEDY)
                again_s = time.monotonic() - began
                tail = server.log_tail()
        except ServerError as exc:
            pytest.fail(str(exc), pytrace=False)
    finally:
        drop(name)
    details = served["meta_info"].get("cached_tokens_details") or {}
    storage = details.get("storage", 0)
    assert storage == full_pages * PAGE_SIZE, (
        f"SGLang loaded {storage} tokens from host memory: {served['meta_info']}\n{tail}"
    )
    assert served["output_ids"] == own["output_ids"]
    print(
        f"SGLang loaded {storage} of {PROMPT_TOKENS} tokens from the host store vLLM wrote; "
        f"first request {first_s * 1000:.0f} ms, its own repeat from the store {again_s * 1000:.0f} ms"
    )

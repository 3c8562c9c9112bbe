"""OPTIONAL server test (issue #5, test 6): a real CPU SGLang server serves a repeated prompt from kvpack.

This is the one SGLang test that runs a whole server instead of SGLang's classes.
It starts ``python -m sglang.launch_server`` (SGLang 0.5.23, CPU engine:
``SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native
--hicache-io-backend direct``) on the offline tiny Llama, with kvpack as the
HiCache L3 backend through ``--hicache-storage-backend dynamic``, then:

1. generates from a 600-token prompt (greedy, temperature 0);
2. waits until SGLang's asynchronous L3 backup has reached kvpack's disk store;
3. ``/flush_cache`` (device radix tree and host pool emptied);
4. sends the same prompt again and asserts that SGLang reports tokens served
   from the storage backend (``meta_info.cached_tokens_details.storage > 0``)
   and that the generated tokens and text equal the first answer (their
   logprobs within 1e-3; they are bit-identical here).

What it needs that kvpack itself never does (test-only, in ``cpu_site/``, on
PYTHONPATH of the server subprocess only; no installed file is edited):

- a stub ``sgl_kernel`` package (its CPU build is not on PyPI; the names SGLang
  imports raise if called, and none is called here);
- stand-ins for ``xgrammar``, ``jsonschema``, ``soundfile``, which the HTTP server
  imports but kvpack's SGLang venv does not install;
- the torchvision op-schema shim shared with the other SGLang tests;
- two patches to SGLang internals, applied at import time: no ``cudaHostRegister``
  of the HiCache host pool, and torch index copies bound as the ``direct`` IO
  backend's ``transfer_kv_direct`` / ``transfer_kv_all_layer_direct_lf_pf`` /
  ``transfer_kv_per_layer_direct_pf_lf`` (SGLang imports those from
  ``sgl_kernel.kvcacheio`` only on CUDA/ROCm).

If the server cannot start, the test fails with the server's log tail; it is
never skipped for that. About 30 s on 2 cores. Deselect with ``-m "not slow"``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_cpu_server import CpuServer, ServerError, running_cpu_server, wait_for_stored_pages

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(300)]

PAGE_SIZE = 16
PROMPT_TOKENS = 600  # above SGLang's default L3 prefetch threshold (256 tokens)
PROMPT = [(i * 7919) % 1900 + 50 for i in range(PROMPT_TOKENS)]  # ordinary word ids of the tiny vocab
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
TENANT = "default"
LOGPROB_TOLERANCE = 1e-3


def kvpack_extra_config(store: Path) -> dict[str, object]:
    """The ``--hicache-storage-backend-extra-config`` a user writes, with a private disk store."""
    return {
        "backend_name": "kvpack",
        "module_path": "kvpack.sglang_plugin",
        "class_name": "KVPackStorage",
        "interface_v1": 1,
        "tenant": TENANT,
        "memory": {"capacity": "256MiB"},
        "disk": {"path": str(store), "capacity": "1GiB"},
    }


def first_and_repeated_answer(server: CpuServer, store: Path) -> tuple[dict[str, object], dict[str, object]]:
    """The answer to `PROMPT`, then to `PROMPT` again after its pages reached kvpack and the cache was flushed."""
    first = server.generate(PROMPT, GREEDY, return_logprob=True)
    full_pages = PROMPT_TOKENS // PAGE_SIZE
    stored = wait_for_stored_pages(store, TENANT, "kv", full_pages)
    if stored < full_pages:
        raise server.error(f"kvpack holds {stored} of the prompt's {full_pages} pages 30 s after the first answer")
    server.flush_cache()
    return first, server.generate(PROMPT, GREEDY, return_logprob=True)


def max_logprob_drift(first: dict[str, object], second: dict[str, object]) -> float:
    """Largest difference between the two answers' output-token logprobs (``[logprob, token id, text]`` rows)."""
    a, b = (answer["meta_info"]["output_token_logprobs"] for answer in (first, second))
    assert len(a) == len(b) == GREEDY["max_new_tokens"], (len(a), len(b))
    return max(abs(x[0] - y[0]) for x, y in zip(a, b, strict=True))


def test_repeated_prompt_is_served_from_kvpack_after_flush(tiny_llama: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    log = tmp_path / "server.log"
    try:
        with running_cpu_server(tiny_llama, kvpack_extra_config(store), log, page_size=PAGE_SIZE) as server:
            first, second = first_and_repeated_answer(server, store)
            tail = server.log_tail()
    except ServerError as exc:
        pytest.fail(str(exc), pytrace=False)

    details = second["meta_info"].get("cached_tokens_details") or {}
    assert details.get("storage", 0) > 0, f"no tokens served from the storage backend: {second['meta_info']}\n{tail}"
    assert details.get("storage_backend") == "KVPackStorage", details
    assert second["output_ids"] == first["output_ids"], (first["output_ids"], second["output_ids"])
    assert second["text"] == first["text"]
    drift = max_logprob_drift(first, second)
    assert drift <= LOGPROB_TOLERANCE, f"output logprobs differ by up to {drift}"
    print(f"storage-served tokens: {details['storage']} of {PROMPT_TOKENS}; same greedy answer {first['text']!r}; logprob drift {drift}")

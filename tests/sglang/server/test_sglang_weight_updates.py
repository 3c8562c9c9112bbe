"""OPTIONAL server test: after ``/update_weights_from_disk`` a CPU SGLang server never loads KV the
old weights computed, and the start-up checkpoint's objects stay valid.

One server (the CPU set-up of ``test_sglang_server.py``) on checkpoint A (the tiny Llama), kvpack
as its HiCache L3:

1. a 600-token prompt P is stored and, after ``/flush_cache``, served from kvpack (the store works);
2. ``POST /update_weights_from_disk`` to checkpoint B (the same architecture, other weights), which
   flushes SGLang's own tree (not the L3 store);
3. SGLang's own no-cache answer of B: P under an ``extra_key`` (SGLang seeds its storage keys with
   it, so nothing of P is found anywhere);
4. P again: nothing loaded from kvpack, the same answer as (3). Before kvpack watched SGLang's
   weight updates, it loaded A's KV here and answered neither A's nor B's answer;
5. once B's pages of P are stored, P after ``/flush_cache`` is served from them: B's answer;
6. ``/update_weights_from_disk`` back to A, then P: served from A's objects of step 1, A's answer
   (a reload of the start-up checkpoint is the start-up weights; nothing of B is taken for A's);
7. ``POST /hicache/storage-backend/clear`` (SGLang's own control), ``/flush_cache``, then P: nothing
   served from kvpack (the reset rule removed this engine's current weights' objects), A's answer.

About 2 minutes on 2 cores. Deselect with ``-m "not slow"``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from sglang_cpu_server import CpuServer, ServerError, running_cpu_server, wait_for_stored_pages
from test_sglang_server import GREEDY, PAGE_SIZE, PROMPT, PROMPT_TOKENS, TENANT, kvpack_extra_config, max_logprob_drift

from kvpack.tools.tinymodel import build_tiny_llama

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1500)]

LOGPROB_TOLERANCE = 1e-3
FULL_PAGES = PROMPT_TOKENS // PAGE_SIZE


def storage_tokens(answer: dict[str, Any]) -> int:
    return int((answer["meta_info"].get("cached_tokens_details") or {}).get("storage", 0))


def generate(server: CpuServer, step: str, extra_key: str | None = None) -> dict[str, Any]:
    """`PROMPT`, greedy, with logprobs (under `extra_key`: SGLang's storage namespace)."""
    body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    if extra_key is not None:
        body["extra_key"] = extra_key
    status, text = server.post(step, "/generate", body, server.limits.generate_s)
    if status != 200:
        raise server.error(step, f"/generate answered {status}: {text[:500]}")
    return dict(json.loads(text))


def update_weights(server: CpuServer, model: Path, step: str) -> None:
    """``/update_weights_from_disk``; where SGLang updated the weights but found its scheduler not
    idle yet for the flush that follows, ``/flush_cache`` as its answer says."""
    status, text = server.post(step, "/update_weights_from_disk", {"model_path": str(model)}, server.limits.generate_s)
    if status == 200 and json.loads(text).get("success"):
        return
    if "Weights were updated, but the cache was not flushed" not in text:
        raise server.error(step, f"/update_weights_from_disk answered {status}: {text[:500]}")
    server.flush_cache(f"{step}: /flush_cache")


def wait_stored(server: CpuServer, store: Path, pages: int, step: str) -> None:
    began, limit_s = time.monotonic(), server.limits.backup_s
    stored = wait_for_stored_pages(store, TENANT, "kv", pages, timeout_s=limit_s)
    if stored < pages:
        raise server.error(step, f"kvpack holds {stored} of {pages} pages", began=began, limit_s=limit_s)


def same_answer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["output_ids"] == b["output_ids"] and max_logprob_drift(a, b) <= LOGPROB_TOLERANCE)


@pytest.mark.slow
def test_update_weights_from_disk_never_loads_the_old_weights_kv(tiny_llama: Path, tmp_path: Path) -> None:
    other = build_tiny_llama(tmp_path / "tiny-llama-b", seed=1)
    store = tmp_path / "store"
    try:
        with running_cpu_server(
            tiny_llama, kvpack_extra_config(store), tmp_path / "server.log", page_size=PAGE_SIZE
        ) as server:
            a_first = generate(server, "A: first /generate")
            wait_stored(server, store, FULL_PAGES, "L3 backup of A's pages")
            server.flush_cache()
            a_served = generate(server, "A: repeated /generate")

            update_weights(server, other, "update_weights_from_disk to B")
            b_reference = generate(server, "B: no-cache answer (own storage namespace)", extra_key="b-reference")
            b_after = generate(server, "B: the prompt stored under A")
            assert storage_tokens(b_after) == 0, f"KV of the old weights was loaded: {b_after['meta_info']}"
            assert same_answer(b_after, b_reference), (b_after["output_ids"], b_reference["output_ids"])
            wait_stored(server, store, 3 * FULL_PAGES, "L3 backup of B's pages")  # A's, the reference's, B's
            server.flush_cache()
            b_served = generate(server, "B: repeated /generate")

            update_weights(server, tiny_llama, "update_weights_from_disk back to A")
            a_again = generate(server, "A again")
            # SGLang's own clear of the L3 backend: kvpack's reset rule (this engine's current weights)
            status, text = server.post("storage clear", "/hicache/storage-backend/clear", {}, server.limits.generate_s)
            if status != 200:
                raise server.error("storage clear", f"/hicache/storage-backend/clear answered {status}: {text[:300]}")
            server.flush_cache()
            a_cleared = generate(server, "A after the storage clear")
            tail = server.log_tail()
    except ServerError as exc:
        pytest.fail(str(exc), pytrace=False)

    assert storage_tokens(a_served) > 0 and same_answer(a_first, a_served), f"the store does not work\n{tail}"
    assert a_first["output_ids"] != b_reference["output_ids"], "A and B answer alike: the test cannot tell"
    assert storage_tokens(b_reference) == 0, b_reference["meta_info"]
    assert storage_tokens(b_served) > 0 and same_answer(b_served, b_reference), b_served["meta_info"]
    assert storage_tokens(a_again) > 0 and same_answer(a_again, a_first), a_again["meta_info"]
    assert "this engine's weights changed in place" in tail, tail
    assert storage_tokens(a_cleared) == 0 and same_answer(a_cleared, a_first), a_cleared["meta_info"]
    assert "SGLang storage clear" in tail, tail

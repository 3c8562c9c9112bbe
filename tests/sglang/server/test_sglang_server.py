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
never skipped for that. Each step's time limit follows the machine, and a
failure names the step that ran out of time (see ``sglang_cpu_server``). About
50 s on 2 cores. Deselect with ``-m "not slow"``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import sglang_cpu_server
from sglang_cpu_server import CpuServer, ServerError, running_cpu_server, wait_for_stored_pages

from fixtures.warm_start import warm_starts

# above the sum of every step's longest limit, so a slow step fails with its own name, not pytest's timeout
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1500)]

PAGE_SIZE = 16
PROMPT_TOKENS = 600  # above SGLang's default L3 prefetch threshold (256 tokens)
PROMPT = [(i * 7919) % 1900 + 50 for i in range(PROMPT_TOKENS)]  # ordinary word ids of the tiny vocab
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
TENANT = "default"
LOGPROB_TOLERANCE = 1e-3


def kvpack_extra_config(store: Path, *, zero_copy: bool = True) -> dict[str, object]:
    """The ``--hicache-storage-backend-extra-config`` a user writes, with a private disk store
    (`zero_copy`: with ``"interface_v1": 1``, as kvpack's README says; without it SGLang uses
    its generic by-value path)."""
    return {
        "backend_name": "kvpack",
        "module_path": "kvpack.sglang_plugin",
        "class_name": "KVPackStorage",
        **({"interface_v1": 1} if zero_copy else {}),
        "tenant": TENANT,
        "memory": {"capacity": "256MiB"},
        "disk": {"path": str(store), "capacity": "1GiB"},
    }


def first_and_repeated_answer(
    server: CpuServer, store: Path, member: str = "kv"
) -> tuple[dict[str, object], dict[str, object]]:
    """The answer to `PROMPT`, then to `PROMPT` again after its pages reached kvpack (as `member`
    objects) and the cache was flushed."""
    first = server.generate("first /generate", PROMPT, GREEDY, return_logprob=True)
    full_pages = PROMPT_TOKENS // PAGE_SIZE
    began, limit_s = time.monotonic(), server.limits.backup_s
    stored = wait_for_stored_pages(store, TENANT, member, full_pages, timeout_s=limit_s)
    if stored < full_pages:
        step = "L3 backup of the first answer's pages to kvpack"
        raise server.error(step, f"kvpack holds {stored} of {full_pages} pages", began=began, limit_s=limit_s)
    server.flush_cache()
    return first, server.generate("repeated /generate after /flush_cache", PROMPT, GREEDY, return_logprob=True)


def max_logprob_drift(first: dict[str, object], second: dict[str, object]) -> float:
    """Largest difference between the two answers' output-token logprobs (``[logprob, token id, text]`` rows)."""
    a, b = (answer["meta_info"]["output_token_logprobs"] for answer in (first, second))
    assert len(a) == len(b) == GREEDY["max_new_tokens"], (len(a), len(b))
    return max(abs(x[0] - y[0]) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("interface", ["v1", "generic"])
def test_repeated_prompt_is_served_from_kvpack_after_flush(tiny_llama: Path, tmp_path: Path, interface: str) -> None:
    # generic: SGLang 0.5.23 asks `batch_exists` before a generic-path prefetch too; kvpack answered
    # it for the zero-copy objects, which that path never writes, so every hit was a miss.
    store = tmp_path / "store"
    log = tmp_path / "server.log"
    zero_copy = interface == "v1"
    extra = kvpack_extra_config(store, zero_copy=zero_copy)
    spawns = warm_starts().spawns_log
    before = len(spawns.read_text().splitlines()) if spawns.exists() else 0
    try:
        with running_cpu_server(tiny_llama, extra, log, page_size=PAGE_SIZE) as server:
            first, second = first_and_repeated_answer(server, store, "kv" if zero_copy else "kvflat")
            tail = server.log_tail()
    except ServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    # the server's scheduler and detokenizer were forked (cold where SGLang set a variable to a value
    # other than `SET_BY_SGLANG_LAUNCH`'s: the log line names it)
    spawned = [json.loads(line) for line in spawns.read_text().splitlines()[before:]]
    assert sum("spawn_main" in s["argv"][1] for s in spawned) >= 2 and all(s["cold"] is None for s in spawned), spawned

    details = second["meta_info"].get("cached_tokens_details") or {}
    assert details.get("storage", 0) > 0, f"no tokens served from the storage backend: {second['meta_info']}\n{tail}"
    assert details.get("storage_backend") == "KVPackStorage", details
    assert second["output_ids"] == first["output_ids"], (first["output_ids"], second["output_ids"])
    assert second["text"] == first["text"]
    drift = max_logprob_drift(first, second)
    assert drift <= LOGPROB_TOLERANCE, f"output logprobs differ by up to {drift}"
    print(
        f"storage-served tokens: {details['storage']} of {PROMPT_TOKENS}; same greedy answer {first['text']!r}; logprob drift {drift}"
    )
    print(f"server start-up {server.start_s:.0f} s, step limits x{server.limits.slowdown:.1f}")


def test_early_exit_with_a_timeout_is_retried_once_then_names_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 12: on a cold start the server exited with code 3 before it was healthy, and the failure
    # did not say which step ran out of time. A stand-in server that logs what SGLang logs, then exits 3.
    line = "[2026-12-01 10:00:00] ReadTimeout: Read timed out. (read timeout=10)"
    argv = [sys.executable, "-c", f"print({line!r}); raise SystemExit(3)"]
    monkeypatch.setattr(sglang_cpu_server, "server_argv", lambda *args: argv)
    log = tmp_path / "server.log"
    with pytest.raises(ServerError) as failed:
        with running_cpu_server(tmp_path, {}, log, page_size=PAGE_SIZE, start_timeout_s=60):
            pass
    message = str(failed.value)
    assert message.startswith("start attempt 2 of 2: step 'start-up (launch until /health answers 200)': "), message
    assert "exited with code 3 before it was healthy after" in message and "(limit 60 s)" in message
    assert f"server log reports: {line}" in message
    assert (tmp_path / "server.log.attempt1").read_text().strip() == line


def test_early_exit_without_a_timeout_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = [sys.executable, "-c", "print('ModuleNotFoundError: no module named x'); raise SystemExit(1)"]
    monkeypatch.setattr(sglang_cpu_server, "server_argv", lambda *args: argv)
    with pytest.raises(ServerError, match=r"^step 'start-up .*exited with code 1") as failed:
        with running_cpu_server(tmp_path, {}, tmp_path / "server.log", page_size=PAGE_SIZE, start_timeout_s=60):
            pass
    assert "last server log line: ModuleNotFoundError" in str(failed.value)
    assert not (tmp_path / "server.log.attempt1").exists()

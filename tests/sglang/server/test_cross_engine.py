"""vLLM and SGLang share one kvpack store, both ways (canonical objects, `kvpack.canonical`).

The same tiny Llama in fp32 in both engines (the KV dtype is part of the canonical group:
SGLang's CPU default, bf16, never shares entries with an fp32 vLLM), page size = block
size = 32, one disk store per direction:

1. An SGLang CPU server answers `PROMPT` from an empty store (its own no-cache
   answer); its pages reach kvpack.
2. A vLLM engine (the vLLM venv's python, a process that simply ends, forked from one that
   imported vLLM: `fixtures.warm_start`) reads that
   store: it reuses every full page SGLang stored (vLLM's ``num_cached_tokens``)
   and its greedy tokens equal vLLM's own no-cache run (logprobs within 1e-4).
3. A vLLM engine writes `PROMPT` into a second, empty store; a new SGLang server
   serves the prompt from it (``cached_tokens_details.storage``) with the same
   greedy tokens as step 1.

vLLM's no-cache run and its write of step 3 need nothing of SGLang's: they run (one after
the other, in a thread) while the first SGLang server starts and answers; vLLM's read of step
2 runs while the second SGLang server starts and answers.

Before canonical objects each engine's group fingerprint named the engine and its
layout (``vllm:cpu``, ``sglang:page_first``), so neither ever found the other's
entries. The vLLM half needs that venv's python (``KVPACK_VLLM_PYTHON``, which
scripts/test.sh exports); without it the test is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sglang_cpu_server import ServerError, running_cpu_server, wait_for_stored_pages
from test_sglang_server import GREEDY, PROMPT, PROMPT_TOKENS, TENANT, kvpack_extra_config

from fixtures.warm_start import warm_starts

PAGE_SIZE = 32
"""SGLang's page = vLLM's block (vLLM's CPU attention takes multiples of 32)."""
VLLM_PYTHON = os.environ.get("KVPACK_VLLM_PYTHON", "")
ENGINE_RUN = Path(__file__).resolve().parents[2] / "vllm" / "engine_run.py"
LOGPROB_TOL = 1e-4

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        not VLLM_PYTHON, reason="needs the vLLM venv's python in KVPACK_VLLM_PYTHON (scripts/test.sh sets it)"
    ),
]


def vllm_run(model: Path, store: Path | None, log: Path, config: dict[str, object] | None = None) -> dict[str, object]:
    """`PROMPT` through a vLLM engine in its own process (kvpack on `store`, or with `config`
    when given; neither: no connector)."""
    extra = (
        config if config is not None else None if store is None else {"tenant": TENANT, "disk": {"path": str(store)}}
    )
    spec = {
        "model": str(model),
        "extra": extra,
        "prompts": {"P": PROMPT},
        "max_tokens": 8,
        "engine": {"block_size": PAGE_SIZE},
    }
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH="")
    proc = warm_starts().run_script(VLLM_PYTHON, [str(ENGINE_RUN), json.dumps(spec)], env, log, timeout_s=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, (
        f"vLLM engine failed (rc={proc.returncode}); see {log}:\n{proc.stderr[-3000:]}"
    )
    return json.loads(line[len("RESULT ") :])["P"]


@pytest.mark.slow
def test_vllm_and_sglang_read_each_others_entries(tiny_llama: Path, tmp_path: Path) -> None:
    by_sglang, by_vllm = tmp_path / "by_sglang", tmp_path / "by_vllm"
    full_pages = PROMPT_TOKENS // PAGE_SIZE

    def vllm_alone() -> tuple[dict[str, object], dict[str, object]]:  # needs nothing SGLang does
        return (
            vllm_run(tiny_llama, None, tmp_path / "vllm_baseline.log"),
            vllm_run(tiny_llama, by_vllm, tmp_path / "vllm_writes.log"),
        )

    # vLLM's no-cache run and its store of its own run while the first SGLang server starts and answers
    with ThreadPoolExecutor(1) as pool:
        vllm_side = pool.submit(vllm_alone)
        try:
            with running_cpu_server(
                tiny_llama,
                kvpack_extra_config(by_sglang),
                tmp_path / "sglang1.log",
                page_size=PAGE_SIZE,
                dtype="float32",
            ) as server:
                own = server.generate("no-cache /generate", PROMPT, GREEDY, return_logprob=True)
                began = time.monotonic()
                stored = wait_for_stored_pages(by_sglang, TENANT, "kv", full_pages, timeout_s=server.limits.backup_s)
                if stored < full_pages:
                    raise server.error(
                        "L3 backup to kvpack", f"kvpack holds {stored} of {full_pages} pages", began=began
                    )
        except ServerError as exc:
            pytest.fail(str(exc), pytrace=False)
        baseline, written = vllm_side.result()

    # vLLM reads SGLang's store while the second SGLang server starts on vLLM's (neither needs the other)
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(vllm_run, tiny_llama, by_sglang, tmp_path / "vllm_reads_sglang.log")
        assert written["cached"] == 0
        try:
            with running_cpu_server(
                tiny_llama, kvpack_extra_config(by_vllm), tmp_path / "sglang2.log", page_size=PAGE_SIZE, dtype="float32"
            ) as server:
                served = server.generate("/generate over vLLM's pages", PROMPT, GREEDY, return_logprob=True)
                tail = server.log_tail()
        except ServerError as exc:
            pytest.fail(str(exc), pytrace=False)
        read = reading.result()
    assert read["cached"] == full_pages * PAGE_SIZE, read["cached"]  # every page SGLang stored
    assert read["tokens"] == baseline["tokens"]
    assert max(abs(a - b) for a, b in zip(read["logprobs"], baseline["logprobs"], strict=True)) <= LOGPROB_TOL

    details = served["meta_info"].get("cached_tokens_details") or {}
    assert details.get("storage", 0) > 0, f"SGLang served nothing from vLLM's pages: {served['meta_info']}\n{tail}"
    assert served["output_ids"] == own["output_ids"]
    print(
        f"vLLM reused {read['cached']} tokens of SGLang's pages; SGLang served {details['storage']} tokens from vLLM's"
    )

"""Two vLLM engines on one host share kvpack's host memory tier (``memory.mode: host``, disk off).

Each engine runs in a process of its own (`vllm_helpers.start_engine_process`, as a user's
script: it computes its prompts and ends). The first computes a prompt; the second
process's first request for it loads n - 1 tokens from the host store in /dev/shm (the
disk tier is off, so nothing else could hold them) and answers as a no-cache run does
(fp32: tokens equal, logprobs within LOGPROB_TOL). The second runs in vLLM's default
multi-process mode (scheduler and worker in the engine core, the API in another
process), whose scheduler looks the prefix up in the host store directly.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
from vllm_helpers import close_llm, engine_process, make_llm, prompt, run, same_output, start_engine_process

from kvpack.tiers.host import host_root

pytestmark = pytest.mark.vllm

P = prompt(73, 301)


def test_a_second_engine_loads_what_the_first_computed_from_host_memory(tiny_llama: Path, tmp_path: Path) -> None:
    name = f"vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    extra = {"disk": {"enabled": False}, "memory": {"mode": "host", "host_name": name, "capacity": "256MiB"}}
    try:
        writer = start_engine_process(tiny_llama, extra, {"P": P}, tmp_path / "writer.log")
        try:  # the no-cache run here while the writer runs in its own process
            baseline_llm = make_llm(tiny_llama)
            try:
                baseline = run(baseline_llm, P)
            finally:
                close_llm(baseline_llm)
        finally:
            written = writer.result()
        assert written["P"].cached == 0
        second = engine_process(tiny_llama, extra, {"P": P}, tmp_path / "reader.log", multiprocess=True)
        assert second["P"].cached == len(P) - 1
        assert same_output(second["P"], baseline)
        assert same_output(written["P"], baseline)
    finally:
        shutil.rmtree(host_root(name), ignore_errors=True)

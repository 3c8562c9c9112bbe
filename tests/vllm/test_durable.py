"""Stores a user can count on: saved as computed, on disk before the process exits.

Each engine runs in a process of its own that runs its prompts and simply
ends, as a user's script does: no drain, no flush, no hand-made shutdown
(`vllm_helpers.engine_process`). fp32, block 32, three prompts sharing a
517-token prefix (16 whole blocks and a 5-token partial one).

- A script that ends leaves every prompt it computed for the next process,
  in vLLM's in-process and default multi-process modes: a new process reuses
  n - 1 tokens of each prompt with the greedy tokens and logprobs of a
  no-cache run. Before blocks were saved as computed and stores flushed at
  exit, the disk held nothing after such a script.
- Within the first process, the second and third prompts already hit the
  prefix the first one computed (saved in the step that computed it).

The OpenAI server's case (a prefix is a hit while the request that computed it still
decodes) is in test_processes.py, on the server lifetime it shares.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_helpers import Run, close_llm, engine_process, make_llm, prompt, run, same_output, start_engine_process

pytestmark = pytest.mark.vllm

BS = 32
PREFIX = prompt(501, 517)
PROMPTS = {
    "A": PREFIX + prompt(502, 40),
    "B": PREFIX + prompt(503, 57),
    "C": PREFIX + prompt(504, 33),
}


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> dict[str, Run]:
    """The same prompts with no connector (no cache at all). In this process: without a
    connector kvpack stores and loads nothing, so a process of its own would only add vLLM's imports."""
    llm = make_llm(tiny_llama, block_size=BS)
    try:
        return {name: run(llm, ids) for name, ids in PROMPTS.items()}
    finally:
        close_llm(llm)


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "multi-process"])
def test_a_script_that_just_ends_leaves_its_kv_for_the_next_process(
    tiny_llama: Path, tmp_path: Path, request: pytest.FixtureRequest, multiprocess: bool
) -> None:
    extra = {"disk": {"path": str(tmp_path / "kv")}}
    started = start_engine_process(
        tiny_llama, extra, PROMPTS, tmp_path / "first.log", multiprocess=multiprocess, block_size=BS
    )
    try:
        baseline: dict[str, Run] = request.getfixturevalue("baseline")  # the first time: while that process runs
    finally:
        first = started.result()
    assert first["A"].cached == 0
    whole_prefix = len(PREFIX) // BS * BS
    assert first["B"].cached >= whole_prefix and first["C"].cached >= whole_prefix  # A's prefix, stored as computed
    for name in PROMPTS:
        assert same_output(first[name], baseline[name]), name
    second = engine_process(tiny_llama, extra, PROMPTS, tmp_path / "second.log", block_size=BS)
    for name, ids in PROMPTS.items():
        assert second[name].cached == len(ids) - 1, (name, second[name].cached)
        assert same_output(second[name], baseline[name]), name

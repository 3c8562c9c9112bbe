"""The cache is keyed by what the checkpoint is, not by its path (`kvpack.identity.model_identity`).

Real vLLM CPU engines, each in a process of its own (`engine_process`), fp32,
block 32, one disk store, one 301-token prompt:

- the tiny model at path A writes the store (nothing cached: this run is also
  the no-cache reference);
- the same checkpoint copied to path B reads it: n - 1 tokens reused, greedy
  tokens and logprobs equal A's no-cache run. Before, the path was the model's
  identity and B recomputed everything;
- the model rebuilt in place at A with another seed (same config, tensor names,
  shapes and dtypes; other weights, as `kvpack.tools.tinymodel` does) is a miss.
  Before, the same path was a hit and the engine loaded another model's KV.

Which layout scope each run used is read from the store itself (one folder per
group fingerprint under the tenant's): a load that times out and recomputes
also reports 0 cached tokens, so ``cached == 0`` alone would not prove a miss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_helpers import engine_process, prompt, same_output, stored_files

from fixtures.tiny_model import build_tiny_llama, copy_model

pytestmark = pytest.mark.vllm

BS = 32
P = prompt(1601, 301)


def scopes(store: Path) -> set[str]:
    """Group fingerprints with stored objects (``<store>/default/<fingerprint>/...``)."""
    return {p.relative_to(store / "default").parts[0] for p in stored_files(store)}


def test_a_copy_is_a_hit_and_a_rebuild_in_place_a_miss(tiny_llama: Path, tmp_path: Path) -> None:
    path_a = copy_model(tiny_llama, tmp_path / "a" / "tiny-llama")
    store = tmp_path / "kv"
    extra = {"disk": {"path": str(store)}, "io_timeout_ms": 30000}  # a slow load on a busy machine is no miss
    written = engine_process(path_a, extra, {"P": P}, tmp_path / "writer.log", block_size=BS)["P"]
    assert written.cached == 0
    first = scopes(store)
    assert len(first) == 1

    path_b = copy_model(path_a, tmp_path / "b" / "same-weights")
    read = engine_process(path_b, extra, {"P": P}, tmp_path / "copy.log", block_size=BS)["P"]
    assert read.cached == len(P) - 1, read.cached
    assert same_output(read, written)
    assert scopes(store) == first  # the copy wrote under the writer's scope

    build_tiny_llama(path_a, seed=1)  # other weights where the writer's model was
    rebuilt = engine_process(path_a, extra, {"P": P}, tmp_path / "rebuilt.log", block_size=BS)["P"]
    assert rebuilt.cached == 0, rebuilt.cached
    assert len(scopes(store)) == 2 and first < scopes(store)  # a scope of its own: a lookup miss, not a slow load

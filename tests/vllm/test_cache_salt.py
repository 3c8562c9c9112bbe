"""The tenant from ``cache_salt``: two salts never share entries, the same salt hits.

One in-process engine (prefix caching off, so every hit is kvpack's), memory
tier plus a disk directory. A salted request's tenant is the salt (a valid
name) and the salt seeds the key chain, so the same tokens under another salt,
or with no salt, are a miss; the first salt's request hits n - 1 tokens with
the uncached output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_helpers import close_llm, kv_config, make_llm, prompt, run, same_output

pytestmark = pytest.mark.vllm

P = prompt(31, 301)


def test_cache_salt_is_the_tenant(tiny_llama: Path, tmp_path: Path) -> None:
    from kvpack.tools.offline import drain

    store = tmp_path / "kv"
    llm = make_llm(tiny_llama, kv_config({"disk": {"path": str(store)}}))
    try:
        first = run(llm, P, cache_salt="salt-a")  # a miss: the no-cache output
        assert first.cached == 0
        assert drain(llm)  # a deterministic point: run 1's write-back to disk is done
        assert (store / "salt-a").is_dir() and not (store / "salt-b").exists()

        other = run(llm, P, cache_salt="salt-b")
        assert other.cached == 0  # another salt never sees salt-a's entries
        assert same_output(other, first)
        unsalted = run(llm, P)
        assert unsalted.cached == 0  # nor does a request without a salt
        assert same_output(unsalted, first)

        again = run(llm, P, cache_salt="salt-a")
        assert again.cached == len(P) - 1  # same salt: whole blocks + the stored tail
        assert same_output(again, first)
    finally:
        close_llm(llm)

"""A handoff whose tail is invalid still loads its whole chunks: the vLLM scheduler side.

A decode instance trusts a handoff's ``tail_chunk`` only as far as it can check it: it
must be one of the tail slots after the prompt's last whole chunk (`kvpack.policy.hits`).
Anything else (a path, a long string, a number, another prompt's tail) drops the tail
alone, counted as ``handoff_tails_dropped``; the whole chunks the prefill instance
stored still load, and every key the workers will build from the job is valid. The
real `SchedulerSide` over a real disk store, with vLLM's own `KVCacheBlocks`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpack.config.schema import KVPackConfig
from kvpack.identity.keys import chunk_hashes
from kvpack.identity.layout_spec import KVLayoutSpec
from kvpack.policy.groups import Coverage
from kvpack.policy.tails import tail_chunk

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm_helpers import fake_request  # noqa: E402

from kvpack.vllm_plugin.handoff import Handoff  # noqa: E402
from kvpack.vllm_plugin.scheduler import SchedulerSide  # noqa: E402
from kvpack.vllm_plugin.scopes import CacheGroup, Scope  # noqa: E402

BS = 16
IDS = list(range(300, 340))  # 2 whole chunks and an 8-token tail
HASHES = chunk_hashes(IDS, BS)


def _side(tmp_path: Path) -> SchedulerSide:
    cfg = KVPackConfig.from_dict({"disk": {"path": str(tmp_path / "kv")}})
    groups = (CacheGroup(0, Coverage.ALL, 0, ("model.layers.0.attn",), "FullAttentionSpec"),)
    spec = KVLayoutSpec(engine="vllm:cpu", model="dense", dtype="float32", chunk_tokens=BS)
    scope = Scope(spec=spec, members=("kv",), block_size=BS, draft="", groups=groups, world=1)
    return SchedulerSide(cfg, scope, can_load=True, can_save=False)


def _decode(side: SchedulerSide, tail: Any) -> tuple[int | None, list[Any]]:
    """A decode request carrying a handoff of the whole prompt with `tail` as its tail:
    what vLLM is told, and the blocks of the load job the workers get."""
    params = Handoff(side.scope.fingerprint, "default", len(IDS), None).to_params()
    params["kvpack"]["tail_chunk"] = tail
    req = fake_request(IDS, "decode")
    req.kv_transfer_params = params
    matched, is_async = side.get_num_new_matched_tokens(req, 0)
    assert is_async  # a handoff always loads asynchronously
    blocks = KVCacheBlocks(([KVCacheBlock(b) for b in (4, 5, 6)],))
    side.update_state_after_alloc(req, blocks, matched or 0)
    (job,) = side.build_connector_meta().loads
    for ref in job.blocks:  # what the worker builds for each: a bad chunk would fail the whole load
        side.session.key(job.tenant, ref.chunk, "kv").as_str()
    return matched, list(job.blocks)


@pytest.mark.parametrize(
    "tail",
    ["../../etc/passwd", "t" * 10_000, 12345, ["a"], "", tail_chunk(HASHES[0]), tail_chunk(None)],
    ids=["path", "long", "number", "list", "empty", "another-parent", "root"],
)
def test_an_invalid_tail_drops_the_tail_alone(tmp_path: Path, tail: Any) -> None:
    side = _side(tmp_path)
    try:
        matched, blocks = _decode(side, tail)
        assert matched == 2 * BS, "the whole chunks the prefill instance stored still load"
        assert [b.chunk for b in blocks] == HASHES[:2] and [b.block_ids for b in blocks] == [(4,), (5,)]
        assert side.session.metrics.value("handoff_tails_dropped") == 1
        assert side.session.metrics.value("handoff_refused") == 0
    finally:
        side.close()


@pytest.mark.parametrize("slot", [0, 3])
def test_a_tail_slot_of_the_prompt_loads(tmp_path: Path, slot: int) -> None:
    side = _side(tmp_path)
    try:
        matched, blocks = _decode(side, tail_chunk(HASHES[1], slot))
        assert matched == len(IDS) - 1  # vLLM computes the last token
        assert [b.chunk for b in blocks] == [*HASHES[:2], tail_chunk(HASHES[1], slot)]
        assert blocks[-1].token_ids == tuple(IDS[32:39]) and blocks[-1].token_count == 8
        assert side.session.metrics.value("handoff_tails_dropped") == 0
    finally:
        side.close()

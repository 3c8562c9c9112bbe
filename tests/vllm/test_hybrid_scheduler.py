"""Scheduler-side logic for Mamba hybrids (``mamba_cache_mode="align"``), without an engine.

vLLM's CPU build cannot run a Mamba hybrid offline here (no tiny model with a
CPU state backend), so this covers what the connector decides for one, with
the real `SchedulerSide` over a real disk store and vLLM-shaped inputs:

- `register_finished_partial_tail` hands over the Mamba state at a partial
  block; the finish save stores it as the tail's state member, next to the
  attention group's tail block, and vLLM is told to keep the blocks (whole
  chunks are saved by the steps that compute them, never at finish);
- a lookup needs the state member only at the boundary chunk, and a tail
  whose state covers more tokens than the prompt shares is not used;
- loads put state into the boundary block only; captures copy every chunk a
  step completes, with each group's block.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvpack.config.schema import KVPackConfig
from kvpack.identity.keys import StoreKey, chunk_hashes
from kvpack.identity.layout_spec import KVLayoutSpec
from kvpack.identity.objects import ObjectHeader
from kvpack.policy.groups import Coverage
from kvpack.store import KVStore
from kvpack.tiers.base import PutItem

pytest.importorskip("vllm")

from vllm_helpers import fake_request, scheduler_output  # noqa: E402

from kvpack.vllm_plugin.metadata import NO_BLOCK, BlockRef  # noqa: E402
from kvpack.vllm_plugin.scheduler import SchedulerSide  # noqa: E402
from kvpack.vllm_plugin.scopes import CacheGroup, Scope  # noqa: E402

BS = 16
STATE = "kv_g1"


def make_side(tmp_path: Path, can_save: bool = True) -> SchedulerSide:
    config = KVPackConfig.from_dict({"memory": {"enabled": False}, "disk": {"path": str(tmp_path / "kv")}})
    groups = (
        CacheGroup(0, Coverage.ALL, 0, ("model.layers.0.attn",), "FullAttentionSpec"),
        CacheGroup(1, Coverage.BOUNDARY, 1, ("model.layers.1.mixer",), "MambaSpec"),
    )
    spec = KVLayoutSpec(engine="vllm:cpu", model="hybrid|groups=full,mamba", dtype="float32", chunk_tokens=BS)
    scope = Scope(spec=spec, members=("kv", STATE), block_size=BS, draft="", groups=groups, world=1)
    return SchedulerSide(config, scope, can_load=True, can_save=can_save)


def put(side: SchedulerSide, chunk: str, member: str, token_ids: tuple[int, ...] | None = None) -> None:
    payload = np.zeros(64, dtype=np.uint8)
    header = ObjectHeader(
        fingerprint=side.scope.fingerprint,
        tenant="default",
        chunk=chunk,
        member=member,
        token_count=len(token_ids) if token_ids else BS,
        payload_len=payload.nbytes,
        checksum=None,
        token_ids=token_ids,
    )
    # the scheduler's store is a read-only view: objects come from a writer (as from a worker)
    writer = KVStore.from_config(side.config)
    try:
        assert (
            writer.store(
                [PutItem(StoreKey("default", side.scope.fingerprint, chunk, member), header, memoryview(payload))]
            )[0].name
            == "OK"
        )
    finally:
        writer.close()


IDS = list(range(100, 164))  # 4 chunks of 16


def test_partial_tail_state_is_saved_with_the_attention_tail(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    req = fake_request(IDS[:40], computed=40)
    assert side.register_finished_partial_tail(req, ([1, 2, 3], [0, 0, 77]), [(1, 77, 40)])
    delay, _ = side.request_finished(req, ([1, 2, 3], [0, 0, 77]))
    assert delay  # vLLM keeps the blocks until the workers report the save
    (job,) = side.build_connector_meta().saves
    assert not job.capture
    # whole chunks were saved by the steps that computed them (captures): only the state tail here
    (tail,) = job.blocks
    assert tail.block_ids == (3, 77) and tail.token_ids == tuple(IDS[32:40]) and tail.token_count == 8


def test_partial_tail_ends_where_the_state_ends(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    req = fake_request(IDS[:40], computed=40)
    assert side.register_finished_partial_tail(req, ([1, 2, 3], [0, 0, 77]), [(1, 77, 37)])
    side.request_finished(req, ([1, 2, 3], [0, 0, 77]))
    tail = side.build_connector_meta().saves[0].blocks[-1]
    assert tail.token_ids == tuple(IDS[32:37])  # not 40: the state covers 37 tokens


def test_no_tail_without_a_handed_over_state(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    req = fake_request(IDS[:40], computed=40)
    delay, _ = side.request_finished(req, ([1, 2, 3], [0, 0, 77]))
    # the running state's length is unknown: no tail; the chunks were captured as computed
    assert not delay and side.build_connector_meta().saves == []


def test_partial_tail_refused_when_not_kvpack_s_to_store(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    req = fake_request(IDS[:40], computed=40)
    assert not side.register_finished_partial_tail(req, ([1, 2, 3], [0, 0, 77]), [(0, 3, 40)])  # attention group
    assert not side.register_finished_partial_tail(req, ([1, 2, 3], [0, 0, 77]), [])
    producer_off = make_side(tmp_path / "b", can_save=False)
    assert not producer_off.register_finished_partial_tail(req, ([1, 2, 3], [0, 0, 77]), [(1, 77, 40)])


def test_promise_kept_when_nothing_else_is_saved(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    req = fake_request(IDS[:40], computed=0)  # nothing computed: nothing to store
    assert side.register_finished_partial_tail(req, ([], []), [(1, 77, 10)])
    delay, _ = side.request_finished(req, ([], []))
    assert delay
    (job,) = side.build_connector_meta().saves
    assert job.req_id == "r1" and job.blocks == ()  # the workers report it done: vLLM frees the blocks


def test_lookup_needs_state_only_at_the_boundary(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    hashes = chunk_hashes(IDS, BS)
    for h in hashes[:3]:
        put(side, h, "kv")
    put(side, hashes[1], STATE)  # state after 32 tokens only
    req = fake_request(IDS[:60])
    assert side.get_num_new_matched_tokens(req, 0) == (32, True)
    put(side, hashes[2], STATE)
    assert side.get_num_new_matched_tokens(fake_request(IDS[:60], req_id="r2"), 0) == (48, True)


def test_state_tail_is_used_only_whole(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    hashes = chunk_hashes(IDS, BS)
    for h in hashes[:3]:
        put(side, h, "kv")
        put(side, h, STATE)
    chunk, _ = side.session.place_tail("default", hashes[2], ("kv", STATE), IDS[48:56])
    put(side, chunk, "kv", tuple(IDS[48:56]))
    put(side, chunk, STATE, tuple(IDS[48:56]))
    whole = fake_request(IDS[:57], req_id="whole")  # contains the 8 tail tokens (+1 vLLM computes)
    assert side.get_num_new_matched_tokens(whole, 0) == (56, True)
    part = fake_request(IDS[:53] + [1, 2, 3, 4], req_id="part")  # shares 5 of the 8: the state would be wrong
    assert side.get_num_new_matched_tokens(part, 0) == (48, True)


def test_load_puts_state_in_the_boundary_block_only(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    hashes = chunk_hashes(IDS, BS)
    for h in hashes[:3]:
        put(side, h, "kv")
        put(side, h, STATE)
    req = fake_request(IDS[:60])
    assert side.get_num_new_matched_tokens(req, 0) == (48, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4], [0, 6, 7, 8]))
    side.update_state_after_alloc(req, blocks, 48)  # type: ignore[arg-type]
    (job,) = side.build_connector_meta().loads
    assert [r.block_ids for r in job.blocks] == [(1, NO_BLOCK), (2, NO_BLOCK), (3, 7)]


def test_captures_copy_each_chunk_in_the_step_that_completes_it(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    req = fake_request(IDS[:50])
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    new = SimpleNamespace(req_id="r1", block_ids=([1, 2, 3], [5, 6, 7]), num_computed_tokens=0)
    (job,) = side.build_connector_meta(scheduler_output([new], {}, {"r1": 40})).saves
    hashes = chunk_hashes(IDS[:64], BS)
    assert job.capture
    assert job.blocks == (BlockRef(hashes[0], (1, 5), BS), BlockRef(hashes[1], (2, 6), BS))
    req.all_token_ids = IDS[:51]  # a generated token
    (job,) = side.build_connector_meta(scheduler_output([], {"r1": (40, ([4], [8]))}, {"r1": 10})).saves
    assert job.blocks == (BlockRef(hashes[2], (3, 7), BS),)
    assert (
        side.build_connector_meta(scheduler_output([], {"r1": (50, None)}, {"r1": 1})).saves == []
    )  # nothing completes
